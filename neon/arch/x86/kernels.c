/* The x86-64 ternary and q8 row kernels, chosen at run time (__builtin_cpu_supports):
 *   avx2  code -> (w+1) in {0,1,2} via a byte shuffle, then vpmaddubsw against the int8
 *         input and a final subtraction of sum(x) (the +1 offset), so no per-row extra
 *         data is needed
 *   vnni  AVX512-VNNI/VL: the avx2 decode with vpdpbusd (u8 x s8 -> int32)
 * Each returns the exact int32 dots of the scalar reference in ../../kernels.c. */
#include "arch/arch.h"

#ifdef SPEL_X86
#include <immintrin.h>

#define AVX2_FN __attribute__((target("avx2,fma")))

AVX2_FN static inline int32_t hsum256_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* Decode without per-code masks: shuffle_epi8 looks only at the low 4 bits (bit 7 clear),
 * so a nibble holding two codes indexes a 16-entry table that returns (w+1) of its low
 * code (LUT_LO) or of its high code (LUT_HI).  Code -> w+1: 0->1, 1->2, 2->1, 3->0. */
#define SPEL_U(c) ((c) == 1 ? 2 : (c) == 3 ? 0 : 1)
#define SPEL_LUT_LO(i) SPEL_U((i) & 3)
#define SPEL_LUT_HI(i) SPEL_U((i) >> 2)

AVX2_FN static inline void tern_pair_avx2(const uint8_t *pa, const uint8_t *pb, int64_t row_bytes,
                                          const spel_act *a, int32_t *out_a, int32_t *out_b) {
    const __m256i lut_lo = _mm256_setr_epi8(SPEL_LUT16(SPEL_LUT_LO), SPEL_LUT16(SPEL_LUT_LO));
    const __m256i lut_hi = _mm256_setr_epi8(SPEL_LUT16(SPEL_LUT_HI), SPEL_LUT16(SPEL_LUT_HI));
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i ones16 = _mm256_set1_epi16(1);
    const int64_t npairs = row_bytes / 32;
    const int8_t *xp = a->xperm;
    __m256i acc32a = _mm256_setzero_si256(), acc32b = _mm256_setzero_si256();
    for (int64_t p0 = 0; p0 < npairs; p0 += 8) {
        int64_t pend = p0 + 8 < npairs ? p0 + 8 : npairs;
        __m256i acca = _mm256_setzero_si256(), accb = _mm256_setzero_si256();
        for (int64_t p = p0; p < pend; p++) {
            const int8_t *xb = xp + p * 128;
            __m256i x0 = _mm256_loadu_si256((const __m256i *)(xb));
            __m256i x1 = _mm256_loadu_si256((const __m256i *)(xb + 32));
            __m256i x2 = _mm256_loadu_si256((const __m256i *)(xb + 64));
            __m256i x3 = _mm256_loadu_si256((const __m256i *)(xb + 96));
            __m256i va = _mm256_loadu_si256((const __m256i *)(pa + p * 32));
            __m256i vb = _mm256_loadu_si256((const __m256i *)(pb + p * 32));
            __m256i la = _mm256_and_si256(va, m4), ha = _mm256_and_si256(_mm256_srli_epi16(va, 4), m4);
            __m256i lb = _mm256_and_si256(vb, m4), hb = _mm256_and_si256(_mm256_srli_epi16(vb, 4), m4);
            __m256i sa = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_shuffle_epi8(lut_lo, la), x0),
                                          _mm256_maddubs_epi16(_mm256_shuffle_epi8(lut_hi, la), x1));
            __m256i ta = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_shuffle_epi8(lut_lo, ha), x2),
                                          _mm256_maddubs_epi16(_mm256_shuffle_epi8(lut_hi, ha), x3));
            __m256i sb = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_shuffle_epi8(lut_lo, lb), x0),
                                          _mm256_maddubs_epi16(_mm256_shuffle_epi8(lut_hi, lb), x1));
            __m256i tb = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_shuffle_epi8(lut_lo, hb), x2),
                                          _mm256_maddubs_epi16(_mm256_shuffle_epi8(lut_hi, hb), x3));
            acca = _mm256_add_epi16(acca, _mm256_add_epi16(sa, ta));
            accb = _mm256_add_epi16(accb, _mm256_add_epi16(sb, tb));
        }
        acc32a = _mm256_add_epi32(acc32a, _mm256_madd_epi16(acca, ones16));
        acc32b = _mm256_add_epi32(acc32b, _mm256_madd_epi16(accb, ones16));
    }
    int32_t da = hsum256_epi32(acc32a), db = hsum256_epi32(acc32b);
    if ((row_bytes / 16) & 1) {   /* odd last 64-weight block: the same steps at 128 bits */
        const __m128i llo = _mm256_castsi256_si128(lut_lo), lhi = _mm256_castsi256_si128(lut_hi);
        const __m128i m4s = _mm_set1_epi8(0x0F);
        const int8_t *xb = xp + npairs * 128;
        __m128i x0 = _mm_loadu_si128((const __m128i *)xb), x1 = _mm_loadu_si128((const __m128i *)(xb + 16));
        __m128i x2 = _mm_loadu_si128((const __m128i *)(xb + 32)), x3 = _mm_loadu_si128((const __m128i *)(xb + 48));
        for (int h = 0; h < 2; h++) {
            __m128i v = _mm_loadu_si128((const __m128i *)((h ? pb : pa) + npairs * 32));
            __m128i lo = _mm_and_si128(v, m4s), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4s);
            __m128i s = _mm_add_epi16(
                _mm_add_epi16(_mm_maddubs_epi16(_mm_shuffle_epi8(llo, lo), x0),
                              _mm_maddubs_epi16(_mm_shuffle_epi8(lhi, lo), x1)),
                _mm_add_epi16(_mm_maddubs_epi16(_mm_shuffle_epi8(llo, hi), x2),
                              _mm_maddubs_epi16(_mm_shuffle_epi8(lhi, hi), x3)));
            __m128i s32 = _mm_madd_epi16(s, _mm_set1_epi16(1));
            s32 = _mm_add_epi32(s32, _mm_shuffle_epi32(s32, 0x4E));
            s32 = _mm_add_epi32(s32, _mm_shuffle_epi32(s32, 0xB1));
            if (h) db += _mm_cvtsi128_si32(s32); else da += _mm_cvtsi128_si32(s32);
        }
    }
    *out_a = da - a->sum;   /* remove the +1 offset of the (w+1) encoding */
    *out_b = db - a->sum;
}

/* Two rows at a time share the activation loads. Per 32 packed bytes (128 weights) and
 * row: 2 masks + 1 shift, 4 shuffles, 4 vpmaddubsw, int16 adds; flushed to int32 every 8
 * pairs (each int16 lane grows by at most 4*508 per pair: 8*2032 < 32767). */
AVX2_FN static void tern_rows_avx2(const uint8_t *packed, int64_t row_bytes, int64_t r0, int64_t r1,
                                   const spel_act *a, int32_t *out) {
    int64_t r = r0;
    for (; r + 2 <= r1; r += 2)
        tern_pair_avx2(packed + r * row_bytes, packed + (r + 1) * row_bytes, row_bytes, a,
                       &out[r - r0], &out[r - r0 + 1]);
    if (r < r1) {   /* a last odd row: pair it with itself */
        int32_t dup;
        tern_pair_avx2(packed + r * row_bytes, packed + r * row_bytes, row_bytes, a, &out[r - r0], &dup);
    }
}

/* q8: vpmaddubsw(|q|, sign(x, q)) = pairwise q*x in int16 (|pair| <= 2*127*127 < 32767). */
AVX2_FN static void q8_rows_avx2(const int8_t *q, int64_t stride, int64_t r0, int64_t r1,
                                 const spel_act *a, int32_t *out) {
    const __m256i ones16 = _mm256_set1_epi16(1);
    const int8_t *x = a->xq;
    const int64_t n32 = a->npad / 32;
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *w = q + r * stride;
        __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
        int64_t i = 0;
        for (; i + 2 <= n32; i += 2) {
            __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + 32 * i));
            __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 32 * i + 32));
            __m256i x0 = _mm256_loadu_si256((const __m256i *)(x + 32 * i));
            __m256i x1 = _mm256_loadu_si256((const __m256i *)(x + 32 * i + 32));
            __m256i p0 = _mm256_maddubs_epi16(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(x0, w0));
            __m256i p1 = _mm256_maddubs_epi16(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(x1, w1));
            acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(p0, ones16));
            acc1 = _mm256_add_epi32(acc1, _mm256_madd_epi16(p1, ones16));
        }
        for (; i < n32; i++) {
            __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + 32 * i));
            __m256i x0 = _mm256_loadu_si256((const __m256i *)(x + 32 * i));
            __m256i p0 = _mm256_maddubs_epi16(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(x0, w0));
            acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(p0, ones16));
        }
        out[r - r0] = hsum256_epi32(_mm256_add_epi32(acc0, acc1));
    }
}

/* ------------------------------------------------------------------ VNNI
 * x86 with AVX512-VNNI + AVX512VL (256-bit vpdpbusd): the x86 counterpart of vdotq_s32.
 * Ternary: the same (w+1) shuffle decode as avx2, but vpdpbusd accumulates u8 x s8
 * products straight into int32 (no int16 stage).  q8: the weight byte with its sign bit
 * flipped is w+128 as u8, so vpdpbusd gives sum (w+128) x and 128 sum(x) is removed. */
#define VNNI_FN __attribute__((target("avx2,fma,avx512f,avx512vl,avx512vnni")))

VNNI_FN static inline void tern_pair_vnni(const uint8_t *pa, const uint8_t *pb, int64_t row_bytes,
                                          const spel_act *a, int32_t *out_a, int32_t *out_b) {
    const __m256i lut_lo = _mm256_setr_epi8(SPEL_LUT16(SPEL_LUT_LO), SPEL_LUT16(SPEL_LUT_LO));
    const __m256i lut_hi = _mm256_setr_epi8(SPEL_LUT16(SPEL_LUT_HI), SPEL_LUT16(SPEL_LUT_HI));
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const int64_t npairs = row_bytes / 32;
    const int8_t *xp = a->xperm;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int64_t p = 0; p < npairs; p++) {
        const int8_t *xb = xp + p * 128;
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(xb));
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(xb + 32));
        __m256i x2 = _mm256_loadu_si256((const __m256i *)(xb + 64));
        __m256i x3 = _mm256_loadu_si256((const __m256i *)(xb + 96));
        __m256i va = _mm256_loadu_si256((const __m256i *)(pa + p * 32));
        __m256i vb = _mm256_loadu_si256((const __m256i *)(pb + p * 32));
        __m256i la = _mm256_and_si256(va, m4), ha = _mm256_and_si256(_mm256_srli_epi16(va, 4), m4);
        __m256i lb = _mm256_and_si256(vb, m4), hb = _mm256_and_si256(_mm256_srli_epi16(vb, 4), m4);
        a0 = _mm256_dpbusd_epi32(a0, _mm256_shuffle_epi8(lut_lo, la), x0);
        a1 = _mm256_dpbusd_epi32(a1, _mm256_shuffle_epi8(lut_hi, la), x1);
        a2 = _mm256_dpbusd_epi32(a2, _mm256_shuffle_epi8(lut_lo, ha), x2);
        a3 = _mm256_dpbusd_epi32(a3, _mm256_shuffle_epi8(lut_hi, ha), x3);
        b0 = _mm256_dpbusd_epi32(b0, _mm256_shuffle_epi8(lut_lo, lb), x0);
        b1 = _mm256_dpbusd_epi32(b1, _mm256_shuffle_epi8(lut_hi, lb), x1);
        b2 = _mm256_dpbusd_epi32(b2, _mm256_shuffle_epi8(lut_lo, hb), x2);
        b3 = _mm256_dpbusd_epi32(b3, _mm256_shuffle_epi8(lut_hi, hb), x3);
    }
    int32_t da = hsum256_epi32(_mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3)));
    int32_t db = hsum256_epi32(_mm256_add_epi32(_mm256_add_epi32(b0, b1), _mm256_add_epi32(b2, b3)));
    if ((row_bytes / 16) & 1) {   /* odd last 64-weight block at 128 bits */
        const __m128i llo = _mm256_castsi256_si128(lut_lo), lhi = _mm256_castsi256_si128(lut_hi);
        const __m128i m4s = _mm_set1_epi8(0x0F);
        const int8_t *xb = xp + npairs * 128;
        __m128i x0 = _mm_loadu_si128((const __m128i *)xb), x1 = _mm_loadu_si128((const __m128i *)(xb + 16));
        __m128i x2 = _mm_loadu_si128((const __m128i *)(xb + 32)), x3 = _mm_loadu_si128((const __m128i *)(xb + 48));
        for (int h = 0; h < 2; h++) {
            __m128i v = _mm_loadu_si128((const __m128i *)((h ? pb : pa) + npairs * 32));
            __m128i lo = _mm_and_si128(v, m4s), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4s);
            __m128i s = _mm_dpbusd_epi32(_mm_setzero_si128(), _mm_shuffle_epi8(llo, lo), x0);
            s = _mm_dpbusd_epi32(s, _mm_shuffle_epi8(lhi, lo), x1);
            s = _mm_dpbusd_epi32(s, _mm_shuffle_epi8(llo, hi), x2);
            s = _mm_dpbusd_epi32(s, _mm_shuffle_epi8(lhi, hi), x3);
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
            if (h) db += _mm_cvtsi128_si32(s); else da += _mm_cvtsi128_si32(s);
        }
    }
    *out_a = da - a->sum;
    *out_b = db - a->sum;
}

VNNI_FN static void tern_rows_vnni(const uint8_t *packed, int64_t row_bytes, int64_t r0, int64_t r1,
                                   const spel_act *a, int32_t *out) {
    int64_t r = r0;
    for (; r + 2 <= r1; r += 2)
        tern_pair_vnni(packed + r * row_bytes, packed + (r + 1) * row_bytes, row_bytes, a,
                       &out[r - r0], &out[r - r0 + 1]);
    if (r < r1) {
        int32_t dup;
        tern_pair_vnni(packed + r * row_bytes, packed + r * row_bytes, row_bytes, a, &out[r - r0], &dup);
    }
}

VNNI_FN static void q8_rows_vnni(const int8_t *q, int64_t stride, int64_t r0, int64_t r1,
                                 const spel_act *a, int32_t *out) {
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    const int8_t *x = a->xq;
    const int64_t n32 = a->npad / 32;   /* npad is a multiple of 64 */
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *w = q + r * stride;
        __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0;
        for (int64_t i = 0; i < n32; i += 2) {
            __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 32 * i)), flip);
            __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + 32 * i + 32)), flip);
            acc0 = _mm256_dpbusd_epi32(acc0, w0, _mm256_loadu_si256((const __m256i *)(x + 32 * i)));
            acc1 = _mm256_dpbusd_epi32(acc1, w1, _mm256_loadu_si256((const __m256i *)(x + 32 * i + 32)));
        }
        out[r - r0] = hsum256_epi32(_mm256_add_epi32(acc0, acc1)) - 128 * a->sum;
    }
}

static int cpu_has_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
}

static int cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

int spel_x86_available(int kernel) {
    switch (kernel) {
    case SPEL_KERNEL_AVX2: return cpu_has_avx2();
    case SPEL_KERNEL_VNNI: return cpu_has_vnni();
    default: return 0;
    }
}

spel_tern_rows_fn spel_x86_tern(int kernel) {
    switch (kernel) {
    case SPEL_KERNEL_AVX2: return tern_rows_avx2;
    case SPEL_KERNEL_VNNI: return tern_rows_vnni;
    default: return NULL;
    }
}

spel_q8_rows_fn spel_x86_q8(int kernel) {
    switch (kernel) {
    case SPEL_KERNEL_AVX2: return q8_rows_avx2;
    case SPEL_KERNEL_VNNI: return q8_rows_vnni;
    default: return NULL;
    }
}
#endif /* SPEL_X86 */
