/* The draft's GEMVs: the quantized ones row-parallel on its pool, the FP32 ones
 * (the LM head), a float dot of fixed order, and a standalone matrix for benchmarks. */
#include "draft_engine.h"

#include <stdlib.h>
#include <string.h>

/* Fixed summation order (16 interleaved partial sums, then a fixed tree) so the
 * compiler may vectorize it without changing the result. */
SPEL_FLOAT_FN float spel_dot_f32(const float *a, const float *b, int64_t n) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[i + l] * b[i + l];
    for (int l = 0; i < n; i++, l++) acc[l] += a[i] * b[i];
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

/* ------------------------------------------------------------------ GEMVs */
typedef struct {
    const spel_qmat *m[2];
    float *y[2];
    int64_t rows0, total, bs;
    const spel_act *a;
    int kernel;
} qgemv_job;

static void qgemv_block(void *ctx, int64_t b) {
    const qgemv_job *j = ctx;
    int64_t r = b * j->bs, rend = r + j->bs < j->total ? r + j->bs : j->total;
    int32_t dots[ROWS_CHUNK];
    while (r < rend) {
        int which = r >= j->rows0;
        int64_t base = which ? j->rows0 : 0;
        const spel_qmat *m = j->m[which];
        int64_t seg_end = base + m->rows < rend ? base + m->rows : rend;
        for (int64_t c0 = r - base; c0 < seg_end - base; c0 += ROWS_CHUNK) {
            int64_t c1 = c0 + ROWS_CHUNK < seg_end - base ? c0 + ROWS_CHUNK : seg_end - base;
            if (m->ternary)
                spel_tern_kernel(j->kernel)(m->data, m->stride, c0, c1, j->a, dots);
            else
                spel_q8_kernel(j->kernel)((const int8_t *)m->data, m->stride, c0, c1, j->a, dots);
            float *y = j->y[which];
            for (int64_t i = c0; i < c1; i++) y[i] = (m->scale[i] * j->a->sx) * (float)dots[i - c0];
        }
        r = seg_end;
    }
}

void spel_qgemv(spel_pool *pool, int kernel, const spel_qmat *m0, float *y0, const spel_qmat *m1,
                float *y1, const spel_act *a) {
    qgemv_job j = {{m0, m1 ? m1 : m0}, {y0, y1}, m0->rows, m0->rows + (m1 ? m1->rows : 0), 0, a, kernel};
    j.bs = spel_pool_block_rows(pool, j.total);
    spel_pool_run(pool, qgemv_block, &j, (j.total + j.bs - 1) / j.bs);
}

typedef struct {
    const float *w, *x;
    float *y;
    int64_t rows, cols, bs;
} fgemv_job;

static void fgemv_block(void *ctx, int64_t b) {
    const fgemv_job *j = ctx;
    int64_t r0 = b * j->bs, r1 = r0 + j->bs < j->rows ? r0 + j->bs : j->rows;
    for (int64_t r = r0; r < r1; r++) j->y[r] = spel_dot_f32(j->w + r * j->cols, j->x, j->cols);
}

void spel_fgemv(spel_pool *pool, const float *w, int64_t rows, int64_t cols, const float *x, float *y) {
    fgemv_job j = {w, x, y, rows, cols, spel_pool_block_rows(pool, rows)};
    spel_pool_run(pool, fgemv_block, &j, (rows + j.bs - 1) / j.bs);
}

int spel_f32_gemv(spel_pool *pool, const float *w, int64_t rows, int64_t cols, const float *x, float *y) {
    spel_fgemv(pool, w, rows, cols, x, y);
    return 0;
}

/* ------------------------------------------------- standalone bench matrix */
struct spel_matrix {
    spel_qmat m;
    spel_act act;
};

spel_matrix *spel_matrix_new(const float *w, int64_t rows, int64_t cols, int ternary) {
    spel_matrix *mx = calloc(1, sizeof *mx);
    if (!mx) return NULL;
    if (spel_qmat_init(&mx->m, w, rows, cols, ternary)) { free(mx); return NULL; }
    mx->act.xq = spel_alloc64((size_t)spel_pad_cols(cols));
    mx->act.xperm = spel_alloc64((size_t)spel_pad_cols(cols));
    if (!mx->act.xq || !mx->act.xperm) { spel_matrix_free(mx); return NULL; }
    return mx;
}

void spel_matrix_free(spel_matrix *mx) {
    if (!mx) return;
    spel_qmat_release(&mx->m);
    free(mx->act.xq);
    free(mx->act.xperm);
    free(mx);
}

int spel_matrix_gemv(spel_matrix *mx, spel_pool *pool, int kernel, const float *x, float *y) {
    kernel = spel_kernel_resolve(kernel);
    if (kernel < 0) return -1;
    spel_act_quantize(&mx->act, x, mx->m.cols, kernel);
    spel_qgemv(pool, kernel, &mx->m, y, NULL, NULL, &mx->act);
    return 0;
}
