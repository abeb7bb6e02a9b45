/* Internal declarations shared by the engine's C files. */
#ifndef SPEL_INTERNAL_H
#define SPEL_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "spel_api.h"

#define SPEL_PAD 64          /* ternary/q8 rows are padded to this many weights */
#define SPEL_MAX_THREADS 6
#define SPEL_BLOCKS_PER_THREAD 6

static inline int64_t spel_pad_cols(int64_t cols) { return (cols + SPEL_PAD - 1) / SPEL_PAD * SPEL_PAD; }

/* An activation vector quantized once per GEMV, in every layout a kernel may want. */
typedef struct {
    int64_t n, npad;
    float sx;
    int32_t sum;        /* sum of xq: the AVX2 ternary kernel's offset correction */
    int8_t *xq;         /* natural order, zero padded to npad */
    int8_t *xperm;      /* ternary SIMD order for the chosen kernel (see quant.c) */
} spel_act;

void spel_act_quantize(spel_act *a, const float *x, int64_t n, int kernel);
void spel_act_from_int8(spel_act *a, const int8_t *xq, int64_t n, int kernel);

/* Row kernels: integer dots of rows [r0, r1) into out[0 .. r1-r0). */
typedef void (*spel_tern_rows_fn)(const uint8_t *packed, int64_t row_bytes, int64_t r0, int64_t r1,
                                  const spel_act *a, int32_t *out);
typedef void (*spel_q8_rows_fn)(const int8_t *q, int64_t stride, int64_t r0, int64_t r1,
                                const spel_act *a, int32_t *out);
spel_tern_rows_fn spel_tern_kernel(int kernel);
spel_q8_rows_fn spel_q8_kernel(int kernel);

/* Pool: fn(ctx, block) for block in [0, nblocks), blocks claimed dynamically. */
typedef void (*spel_task_fn)(void *ctx, int64_t block);
void spel_pool_run(spel_pool *pool, spel_task_fn fn, void *ctx, int64_t nblocks);
int64_t spel_pool_block_rows(const spel_pool *pool, int64_t rows);

/* Quantized matrices as the engine stores them. */
typedef struct {
    int ternary;
    int64_t rows, cols, stride;   /* stride: bytes per row (packed or padded q8) */
    uint8_t *data;
    float *scale;
} spel_qmat;

int spel_qmat_init(spel_qmat *m, const float *w, int64_t rows, int64_t cols, int ternary);
void spel_qmat_release(spel_qmat *m);

/* y[r] = (s_r * s_x) * (float)dot_r for the rows of up to two matrices sharing one input. */
void spel_qgemv(spel_pool *pool, int kernel, const spel_qmat *m0, float *y0,
                const spel_qmat *m1, float *y1, const spel_act *a);
void spel_fgemv(spel_pool *pool, const float *w, int64_t rows, int64_t cols, const float *x, float *y);
float spel_dot_f32(const float *a, const float *b, int64_t n);

/* The draft's sampler (sampling.c): parameters, the context before the proposal, the
 * distributions of its batch offsets. */
typedef struct spel_sampler spel_sampler;
spel_sampler *spel_sampler_new(int V, int R);
void spel_sampler_free(spel_sampler *sm);
int spel_sampler_configure(spel_sampler *sm, const spel_sampling *s, int want_q);
int spel_sampler_on(const spel_sampler *sm);
void spel_sampler_context(spel_sampler *sm, const int32_t *ctx, int n, int64_t index);
int32_t spel_sampler_pick(spel_sampler *sm, const float *logits, int32_t pending, const int32_t *out, int j,
                          int offset);
const double *spel_sampler_q(const spel_sampler *sm, int offset);

#endif
