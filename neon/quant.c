/* Quantizers, 2-bit packing and activation preparation.
 *
 * Bit-exact twins of spel_mlx/quant.py: round-half-to-even (rintf), one float32
 * division per element, scale sums in double strictly left to right.  Built with
 * -ffp-contract=off so no multiply-add is fused behind our back. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "spel_internal.h"

static inline float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

/* rintf (round half to even) without a libm call: for |v| < 2^22, v + 1.5*2^23 lands in
 * [2^23, 2^24) where the float spacing is 1, so the addition itself rounds to an integer
 * (ties to even: 1.5*2^23 is even) and the subtraction is exact.  Larger |v| are already
 * integers, and NaN passes through.  Every caller clamps afterwards, so the sign of a
 * zero does not matter.  (Without -ffast-math the compiler may not fold (v+c)-c.) */
static inline float rint_even(float v) {
    const float c = 0x1.8p23f;
    if (!(fabsf(v) < 0x1p22f)) return v;
    return (v + c) - c;
}

/* float -> int8 code, defined for every input: NaN gives 0 and values beyond +-lim
 * saturate (casting NaN or an out-of-range float to an integer is undefined behaviour). */
static inline int8_t code_i8(float v, float lim) {
    if (v != v) return 0;
    return (int8_t)clampf(v, -lim, lim);
}

/* Non-finite input is defined too (the draft refuses non-finite weights at load, but
 * activations may overflow): NaN is ignored by the max and coded 0, and +-inf saturate
 * like the largest finite float, so they get the codes +-127. */
void spel_quantize_q8(const float *w, int64_t rows, int64_t cols, int8_t *q, float *s) {
    for (int64_t r = 0; r < rows; r++) {
        const float *wr = w + r * cols;
        float amax = 0.0f;
        for (int64_t j = 0; j < cols; j++) {
            float v = fabsf(wr[j]);
            if (v > amax) amax = v;
        }
        if (amax > FLT_MAX) amax = FLT_MAX;
        float sr = amax / 127.0f;
        s[r] = sr;
        for (int64_t j = 0; j < cols; j++)
            q[r * cols + j] = sr != 0.0f ? code_i8(rint_even(wr[j] / sr), 127.0f) : 0;
    }
}

float spel_quantize_activation(const float *x, int64_t n, int8_t *xq) {
    float s;
    spel_quantize_q8(x, 1, n, xq, &s);
    return s;
}

/* One row's ternary codes at scale s (s != 0) as floats in {-1, 0, 1}, in a loop of their
 * own so the compiler can vectorize it: each division is the same IEEE division whatever
 * the vector width, and rint_even / code_i8 are written as selects.  +0.0 for the zeros,
 * as the scalar code_i8 gives. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-trapping-math")))   /* lets GCC compute both sides of the selects */
#endif
static void ternary_codes(const float *w, int64_t n, float s, float *q) {
    const float c = 0x1.8p23f;
    for (int64_t j = 0; j < n; j++) {
        float v = w[j] / s;
        float r = fabsf(v) < 0x1p22f ? (v + c) - c : v;
        float k = r > 1.0f ? 1.0f : (r < -1.0f ? -1.0f : r);
        q[j] = k == k ? k + 0.0f : 0.0f;
    }
}

/* The scalar reference, one row at a time (and the fallback without memory). */
static void quantize_ternary_rows(const float *w, int64_t rows, int64_t cols, int8_t *t, float *s) {
    for (int64_t r = 0; r < rows; r++) {
        const float *wr = w + r * cols;
        int8_t *tr = t + r * cols;
        if (cols == 0) { s[r] = 0.0f; continue; }
        double acc = 0.0;
        for (int64_t j = 0; j < cols; j++) acc += (double)fabsf(wr[j]);
        float sr = (float)(acc / (double)cols);
        for (int it = 0; it <= 3; it++) {
            double wq = 0.0;
            int64_t qq = 0;
            for (int64_t j = 0; j < cols; j++) {
                float qj = sr != 0.0f ? (float)code_i8(rint_even(wr[j] / sr), 1.0f) : 0.0f;
                if (it == 3) { tr[j] = (int8_t)qj; continue; }   /* final q with final s */
                wq += (double)(wr[j] * qj);
                qq += qj != 0.0f;
            }
            if (it < 3 && qq > 0) sr = (float)(wq / (double)qq);
        }
        s[r] = sr;
    }
}

/* Four rows at once, the same arithmetic: every row's sums still run left to right in
 * double (four independent chains instead of one, so the adds' latency overlaps), and its
 * codes come from ternary_codes.  Bit for bit the scalar reference (tests). */
static void quantize_ternary_4(const float *w, int64_t cols, int8_t *t, float *s, float *q) {
    const float *w0 = w, *w1 = w + cols, *w2 = w + 2 * cols, *w3 = w + 3 * cols;
    float *q0 = q, *q1 = q + cols, *q2 = q + 2 * cols, *q3 = q + 3 * cols;
    double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
    for (int64_t j = 0; j < cols; j++) {
        a0 += (double)fabsf(w0[j]); a1 += (double)fabsf(w1[j]);
        a2 += (double)fabsf(w2[j]); a3 += (double)fabsf(w3[j]);
    }
    float sr[4] = {(float)(a0 / (double)cols), (float)(a1 / (double)cols),
                   (float)(a2 / (double)cols), (float)(a3 / (double)cols)};
    for (int it = 0; it <= 3; it++) {
        for (int i = 0; i < 4; i++) {
            if (sr[i] != 0.0f) ternary_codes(w + i * cols, cols, sr[i], q + i * cols);
            else memset(q + i * cols, 0, sizeof(float) * (size_t)cols);
        }
        if (it == 3) break;
        double p0 = 0.0, p1 = 0.0, p2 = 0.0, p3 = 0.0;
        int64_t n0 = 0, n1 = 0, n2 = 0, n3 = 0;
        for (int64_t j = 0; j < cols; j++) {
            p0 += (double)(w0[j] * q0[j]); n0 += q0[j] != 0.0f;
            p1 += (double)(w1[j] * q1[j]); n1 += q1[j] != 0.0f;
            p2 += (double)(w2[j] * q2[j]); n2 += q2[j] != 0.0f;
            p3 += (double)(w3[j] * q3[j]); n3 += q3[j] != 0.0f;
        }
        if (n0 > 0) sr[0] = (float)(p0 / (double)n0);
        if (n1 > 0) sr[1] = (float)(p1 / (double)n1);
        if (n2 > 0) sr[2] = (float)(p2 / (double)n2);
        if (n3 > 0) sr[3] = (float)(p3 / (double)n3);
    }
    for (int i = 0; i < 4; i++) {
        for (int64_t j = 0; j < cols; j++) t[i * cols + j] = (int8_t)q[i * cols + j];
        s[i] = sr[i];
    }
}

void spel_quantize_ternary(const float *w, int64_t rows, int64_t cols, int8_t *t, float *s) {
    int64_t r = 0;
    float *q = rows >= 4 && cols > 0 ? malloc(sizeof(float) * 4 * (size_t)cols) : NULL;
    if (q)
        for (; r + 4 <= rows; r += 4) quantize_ternary_4(w + r * cols, cols, t + r * cols, s + r, q);
    free(q);
    quantize_ternary_rows(w + r * cols, rows - r, cols, t + r * cols, s + r);
}

int64_t spel_ternary_row_bytes(int64_t cols) { return spel_pad_cols(cols) / 4; }

void spel_pack_ternary(const int8_t *t, int64_t rows, int64_t cols, uint8_t *packed) {
    int64_t rb = spel_ternary_row_bytes(cols);
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *pr = packed + r * rb;
        memset(pr, 0, (size_t)rb);
        for (int64_t j = 0; j < cols; j++) {
            int8_t v = t[r * cols + j];
            uint8_t code = v > 0 ? 1 : (v < 0 ? 3 : 0);
            pr[j >> 2] |= (uint8_t)(code << (2 * (j & 3)));
        }
    }
}

/* Ternary SIMD kernels read the canonical packing directly; instead of shuffling
 * weights they get the activation pre-permuted once per GEMV so that "sub-block k"
 * (the codes at bit offset 2k of each byte, i.e. weights 4j+k) meets its inputs:
 *   NEON (16-byte vectors): block b of 64 weights -> xperm[b*64 + k*16 + j] = x[b*64 + 4j + k]
 *   AVX2 (32-byte vectors): block pair p          -> xperm[p*128 + k*32 + h*16 + j]
 *                                                     = x[(2p+h)*64 + 4j + k]
 *   an odd last block on AVX2 uses the NEON form. */
static void permute_for_kernel(const int8_t *xq, int64_t npad, int kernel, int8_t *xp) {
    int64_t nb = npad / SPEL_PAD;
    if (kernel == SPEL_KERNEL_SCALAR) {
        memcpy(xp, xq, (size_t)npad);
        return;
    }
    int64_t b = 0;
    if (kernel == SPEL_KERNEL_AVX2 || kernel == SPEL_KERNEL_VNNI) {
        for (; b + 1 < nb; b += 2) {
            int8_t *dst = xp + b * SPEL_PAD;
            for (int k = 0; k < 4; k++)
                for (int h = 0; h < 2; h++)
                    for (int j = 0; j < 16; j++)
                        dst[k * 32 + h * 16 + j] = xq[(b + h) * SPEL_PAD + 4 * j + k];
        }
    }
    for (; b < nb; b++) {
        int8_t *dst = xp + b * SPEL_PAD;
        for (int k = 0; k < 4; k++)
            for (int j = 0; j < 16; j++) dst[k * 16 + j] = xq[b * SPEL_PAD + 4 * j + k];
    }
}

static void act_finish(spel_act *a, int64_t n, int kernel) {
    a->n = n;
    a->npad = spel_pad_cols(n);
    memset(a->xq + n, 0, (size_t)(a->npad - n));
    int32_t sum = 0;
    for (int64_t i = 0; i < n; i++) sum += a->xq[i];
    a->sum = sum;
    permute_for_kernel(a->xq, a->npad, kernel, a->xperm);
}

void spel_act_quantize(spel_act *a, const float *x, int64_t n, int kernel) {
    a->sx = spel_quantize_activation(x, n, a->xq);
    act_finish(a, n, kernel);
}

void spel_act_from_int8(spel_act *a, const int8_t *xq, int64_t n, int kernel) {
    memmove(a->xq, xq, (size_t)n);
    a->sx = 1.0f;
    act_finish(a, n, kernel);
}

static void *alloc64(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? n : 64) != 0) return NULL;
    return p;
}

int spel_qmat_init(spel_qmat *m, const float *w, int64_t rows, int64_t cols, int ternary) {
    memset(m, 0, sizeof *m);
    m->ternary = ternary;
    m->rows = rows;
    m->cols = cols;
    m->stride = ternary ? spel_ternary_row_bytes(cols) : spel_pad_cols(cols);
    m->data = alloc64((size_t)(m->stride * rows));
    m->scale = alloc64((size_t)rows * sizeof(float));
    const int64_t group = ternary ? 4 : 1;   /* ternary rows are quantized four at a time */
    int8_t *tmp = malloc((size_t)(cols ? group * cols : 1));
    if (!m->data || !m->scale || !tmp) {
        free(tmp);
        spel_qmat_release(m);
        return -1;
    }
    for (int64_t r = 0; r < rows; r += ternary ? group : 1) {
        if (ternary) {
            const int64_t n = rows - r < group ? rows - r : group;
            spel_quantize_ternary(w + r * cols, n, cols, tmp, &m->scale[r]);
            for (int64_t i = 0; i < n; i++) spel_pack_ternary(tmp + i * cols, 1, cols, m->data + (r + i) * m->stride);
        } else {
            int8_t *dst = (int8_t *)m->data + r * m->stride;
            spel_quantize_q8(w + r * cols, 1, cols, dst, &m->scale[r]);
            memset(dst + cols, 0, (size_t)(m->stride - cols));
        }
    }
    free(tmp);
    return 0;
}

void spel_qmat_release(spel_qmat *m) {
    free(m->data);
    free(m->scale);
    m->data = NULL;
    m->scale = NULL;
}

/* --- raw integer dots (tests and benchmarks) --- */
static int act_alloc(spel_act *a, int64_t n) {
    int64_t npad = spel_pad_cols(n);
    a->xq = alloc64((size_t)npad);
    a->xperm = alloc64((size_t)npad);
    if (!a->xq || !a->xperm) { free(a->xq); free(a->xperm); return -1; }
    return 0;
}

int spel_dot_ternary(int kernel, const uint8_t *packed, int64_t rows, int64_t cols,
                     const int8_t *xq, int32_t *out) {
    kernel = spel_kernel_resolve(kernel);
    if (kernel < 0) return -1;
    spel_act a;
    if (act_alloc(&a, cols)) return -2;
    spel_act_from_int8(&a, xq, cols, kernel);
    spel_tern_kernel(kernel)(packed, spel_ternary_row_bytes(cols), 0, rows, &a, out);
    free(a.xq);
    free(a.xperm);
    return 0;
}

int spel_dot_q8(int kernel, const int8_t *q, int64_t rows, int64_t cols, const int8_t *xq, int32_t *out) {
    kernel = spel_kernel_resolve(kernel);
    if (kernel < 0) return -1;
    int64_t stride = spel_pad_cols(cols);
    int8_t *padded = alloc64((size_t)(stride * rows));
    spel_act a;
    if (!padded || act_alloc(&a, cols)) { free(padded); return -2; }
    for (int64_t r = 0; r < rows; r++) {
        memcpy(padded + r * stride, q + r * cols, (size_t)cols);
        memset(padded + r * stride + cols, 0, (size_t)(stride - cols));
    }
    spel_act_from_int8(&a, xq, cols, kernel);
    spel_q8_kernel(kernel)(padded, stride, 0, rows, &a, out);
    free(padded);
    free(a.xq);
    free(a.xperm);
    return 0;
}
