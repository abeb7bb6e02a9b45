/* The arm64 ternary and q8 row kernels:
 *   dotprod  FEAT_DotProd (checked at run time): nibble -> w in {-1,0,1} via vqtbl1q,
 *            then vdotq_s32
 *   addsub   baseline NEON: +1/-1 masks select the input, pairwise-add into int16
 * Each returns the exact int32 dots of the scalar reference in ../../kernels.c. */
#include "arch/arch.h"

#if defined(__aarch64__)
#include <arm_neon.h>
#if defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#elif defined(__APPLE__)
#include <sys/sysctl.h>
#endif

#if defined(__ARM_FEATURE_DOTPROD)
#define DOTPROD_FN
#elif defined(__clang__)
#define DOTPROD_FN __attribute__((target("dotprod")))
#else
#define DOTPROD_FN __attribute__((target("arch=armv8.2-a+dotprod")))
#endif

/* Nibble decode as on x86: vqtbl1q returns 0 for indices >= 16, so a nibble (two codes)
 * indexes a 16-entry table giving w of its low code or of its high code; v & 15 and
 * v >> 4 are the only unpacking steps.  Two rows share the activation loads. */
#define SPEL_W(c) ((c) == 1 ? 1 : (c) == 3 ? -1 : 0)
#define SPEL_WLO(i) SPEL_W((i) & 3)
#define SPEL_WHI(i) SPEL_W((i) >> 2)

DOTPROD_FN static inline void tern_pair_dotprod(const uint8_t *pa, const uint8_t *pb, int64_t nb,
                                                const int8_t *xp, int32_t *out_a, int32_t *out_b) {
    const int8x16_t lut_lo = {SPEL_LUT16(SPEL_WLO)}, lut_hi = {SPEL_LUT16(SPEL_WHI)};
    const uint8x16_t m4 = vdupq_n_u8(15);
    int32x4_t a0 = vdupq_n_s32(0), a1 = a0, b0 = a0, b1 = a0;
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *xb = xp + b * 64;
        int8x16_t x0 = vld1q_s8(xb), x1 = vld1q_s8(xb + 16), x2 = vld1q_s8(xb + 32), x3 = vld1q_s8(xb + 48);
        uint8x16_t va = vld1q_u8(pa + 16 * b), vb = vld1q_u8(pb + 16 * b);
        uint8x16_t la = vandq_u8(va, m4), ha = vshrq_n_u8(va, 4);
        uint8x16_t lb = vandq_u8(vb, m4), hb = vshrq_n_u8(vb, 4);
        a0 = vdotq_s32(a0, vqtbl1q_s8(lut_lo, la), x0);
        a1 = vdotq_s32(a1, vqtbl1q_s8(lut_hi, la), x1);
        a0 = vdotq_s32(a0, vqtbl1q_s8(lut_lo, ha), x2);
        a1 = vdotq_s32(a1, vqtbl1q_s8(lut_hi, ha), x3);
        b0 = vdotq_s32(b0, vqtbl1q_s8(lut_lo, lb), x0);
        b1 = vdotq_s32(b1, vqtbl1q_s8(lut_hi, lb), x1);
        b0 = vdotq_s32(b0, vqtbl1q_s8(lut_lo, hb), x2);
        b1 = vdotq_s32(b1, vqtbl1q_s8(lut_hi, hb), x3);
    }
    *out_a = vaddvq_s32(vaddq_s32(a0, a1));
    *out_b = vaddvq_s32(vaddq_s32(b0, b1));
}

DOTPROD_FN static void tern_rows_dotprod(const uint8_t *packed, int64_t row_bytes, int64_t r0, int64_t r1,
                                         const spel_act *a, int32_t *out) {
    const int64_t nb = row_bytes / 16;
    int64_t r = r0;
    for (; r + 2 <= r1; r += 2)
        tern_pair_dotprod(packed + r * row_bytes, packed + (r + 1) * row_bytes, nb, a->xperm,
                          &out[r - r0], &out[r - r0 + 1]);
    if (r < r1) {
        int32_t dup;
        tern_pair_dotprod(packed + r * row_bytes, packed + r * row_bytes, nb, a->xperm, &out[r - r0], &dup);
    }
}

DOTPROD_FN static void q8_rows_dotprod(const int8_t *q, int64_t stride, int64_t r0, int64_t r1,
                                       const spel_act *a, int32_t *out) {
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *w = q + r * stride;
        int32x4_t acc0 = vdupq_n_s32(0), acc1 = vdupq_n_s32(0);
        for (int64_t i = 0; i < a->npad; i += 32) {
            acc0 = vdotq_s32(acc0, vld1q_s8(w + i), vld1q_s8(a->xq + i));
            acc1 = vdotq_s32(acc1, vld1q_s8(w + i + 16), vld1q_s8(a->xq + i + 16));
        }
        out[r - r0] = vaddvq_s32(vaddq_s32(acc0, acc1));
    }
}

/* addsub: t = (x & [w=+1]) - (x & [w=-1]) (|t| <= 127), pairwise-accumulated into int16;
 * each int16 lane grows by at most 4*254 per block, flushed every 16 blocks. */
static void tern_rows_addsub(const uint8_t *packed, int64_t row_bytes, int64_t r0, int64_t r1,
                             const spel_act *a, int32_t *out) {
    const uint8x16_t m3 = vdupq_n_u8(3), one = vdupq_n_u8(1), three = vdupq_n_u8(3);
    const int64_t nb = row_bytes / 16;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *p = packed + r * row_bytes;
        int32x4_t acc32 = vdupq_n_s32(0);
        for (int64_t b0 = 0; b0 < nb; b0 += 16) {
            int64_t bend = b0 + 16 < nb ? b0 + 16 : nb;
            int16x8_t acc16 = vdupq_n_s16(0);
            for (int64_t b = b0; b < bend; b++) {
                const int8_t *xb = a->xperm + b * 64;
                uint8x16_t v = vld1q_u8(p + 16 * b);
                uint8x16_t c[4] = {vandq_u8(v, m3), vandq_u8(vshrq_n_u8(v, 2), m3),
                                   vandq_u8(vshrq_n_u8(v, 4), m3), vshrq_n_u8(v, 6)};
                for (int k = 0; k < 4; k++) {
                    int8x16_t x = vld1q_s8(xb + 16 * k);
                    int8x16_t plus = vandq_s8(x, vreinterpretq_s8_u8(vceqq_u8(c[k], one)));
                    int8x16_t minus = vandq_s8(x, vreinterpretq_s8_u8(vceqq_u8(c[k], three)));
                    acc16 = vpadalq_s8(acc16, vsubq_s8(plus, minus));
                }
            }
            acc32 = vpadalq_s16(acc32, acc16);
        }
        out[r - r0] = vaddvq_s32(acc32);
    }
}

/* q8 without dotprod: widening multiplies, pairwise-accumulated into int32. */
static void q8_rows_addsub(const int8_t *q, int64_t stride, int64_t r0, int64_t r1,
                           const spel_act *a, int32_t *out) {
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *w = q + r * stride;
        int32x4_t acc0 = vdupq_n_s32(0), acc1 = vdupq_n_s32(0);
        for (int64_t i = 0; i < a->npad; i += 16) {
            int8x16_t wv = vld1q_s8(w + i), xv = vld1q_s8(a->xq + i);
            acc0 = vpadalq_s16(acc0, vmull_s8(vget_low_s8(wv), vget_low_s8(xv)));
            acc1 = vpadalq_s16(acc1, vmull_high_s8(wv, xv));
        }
        out[r - r0] = vaddvq_s32(vaddq_s32(acc0, acc1));
    }
}

static int cpu_has_dotprod(void) {
#if defined(__linux__)
    return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#elif defined(__APPLE__)
    int v = 0;
    size_t len = sizeof v;
    if (sysctlbyname("hw.optional.arm.FEAT_DotProd", &v, &len, NULL, 0) != 0) return 0;
    return v != 0;
#else
    return 0;
#endif
}

int spel_arm_available(int kernel) {
    switch (kernel) {
    case SPEL_KERNEL_DOTPROD: return cpu_has_dotprod();
    case SPEL_KERNEL_ADDSUB: return 1;
    default: return 0;
    }
}

spel_tern_rows_fn spel_arm_tern(int kernel) {
    switch (kernel) {
    case SPEL_KERNEL_DOTPROD: return tern_rows_dotprod;
    case SPEL_KERNEL_ADDSUB: return tern_rows_addsub;
    default: return NULL;
    }
}

spel_q8_rows_fn spel_arm_q8(int kernel) {
    switch (kernel) {
    case SPEL_KERNEL_DOTPROD: return q8_rows_dotprod;
    case SPEL_KERNEL_ADDSUB: return q8_rows_addsub;
    default: return NULL;
    }
}
#endif /* __aarch64__ */
