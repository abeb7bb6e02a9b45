/* Integer GEMV row kernels: ternary (2-bit packed) and q8, every kernel returning
 * the identical exact int32 dot products.  Here: the scalar reference (portable C,
 * canonical packing, natural activation order) and the choice among it and the
 * architecture kernels, as ggml-cpu lays them out:
 *
 *   arch/x86/kernels.c   avx2, vnni (x86-64)
 *   arch/arm/kernels.c   dotprod, addsub (arm64)
 *
 * The SIMD ternary kernels read the canonical packing unchanged; the activation was
 * permuted to match once per GEMV (quant.c). */
#include <string.h>

#include "arch/arch.h"

/* ------------------------------------------------------------------ scalar */
static const int8_t DECODE[4] = {0, 1, 0, -1};   /* code 2 decodes as 0 */

static void tern_rows_scalar(const uint8_t *packed, int64_t row_bytes, int64_t r0, int64_t r1,
                             const spel_act *a, int32_t *out) {
    const int8_t *x = a->xq;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *p = packed + r * row_bytes;
        int32_t acc = 0;
        for (int64_t b = 0; b < row_bytes; b++) {
            uint8_t v = p[b];
            const int8_t *xb = x + 4 * b;
            acc += DECODE[v & 3] * xb[0] + DECODE[(v >> 2) & 3] * xb[1] +
                   DECODE[(v >> 4) & 3] * xb[2] + DECODE[(v >> 6) & 3] * xb[3];
        }
        out[r - r0] = acc;
    }
}

static void q8_rows_scalar(const int8_t *q, int64_t stride, int64_t r0, int64_t r1,
                           const spel_act *a, int32_t *out) {
    const int8_t *x = a->xq;
    for (int64_t r = r0; r < r1; r++) {
        const int8_t *w = q + r * stride;
        int32_t acc = 0;
        for (int64_t j = 0; j < a->npad; j++) acc += (int32_t)w[j] * (int32_t)x[j];
        out[r - r0] = acc;
    }
}

/* --------------------------------------------------------------- selection */
static const char *const NAMES[SPEL_KERNEL_COUNT] = {"scalar", "avx2", "dotprod", "addsub", "vnni"};

const char *spel_kernel_name(int kernel) {
    return kernel >= 0 && kernel < SPEL_KERNEL_COUNT ? NAMES[kernel] : "unknown";
}

int spel_kernel_available(int kernel) {
    if (kernel == SPEL_KERNEL_SCALAR) return 1;
#if defined(SPEL_X86)
    return spel_x86_available(kernel);
#elif defined(__aarch64__)
    return spel_arm_available(kernel);
#else
    return 0;
#endif
}

int spel_kernel_resolve(int kernel) {
    if (kernel == SPEL_KERNEL_AUTO) {
        static const int order[] = {SPEL_KERNEL_DOTPROD, SPEL_KERNEL_VNNI, SPEL_KERNEL_AVX2, SPEL_KERNEL_ADDSUB};
        for (int i = 0; i < 4; i++)
            if (spel_kernel_available(order[i])) return order[i];
        return SPEL_KERNEL_SCALAR;
    }
    return spel_kernel_available(kernel) ? kernel : -1;
}

spel_tern_rows_fn spel_tern_kernel(int kernel) {
    spel_tern_rows_fn fn = NULL;
#if defined(SPEL_X86)
    fn = spel_x86_tern(kernel);
#elif defined(__aarch64__)
    fn = spel_arm_tern(kernel);
#endif
    return fn ? fn : tern_rows_scalar;
}

spel_q8_rows_fn spel_q8_kernel(int kernel) {
    spel_q8_rows_fn fn = NULL;
#if defined(SPEL_X86)
    fn = spel_x86_q8(kernel);
#elif defined(__aarch64__)
    fn = spel_arm_q8(kernel);
#endif
    return fn ? fn : q8_rows_scalar;
}
