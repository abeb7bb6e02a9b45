/* The CPU draft step (SPEC 2 draft, 3, 4): embedding row, RMSNorm, GDN conv + delta
 * rule with a (K+1)-slot state ring, RoPE attention with a KV cache, q8 wqkv/wo,
 * ternary SwiGLU, final norm and the FP32 (or optional q8) LM head.  Quantized GEMVs
 * run row-parallel on the draft's persistent pool; everything else is serial on the
 * calling thread, so logits do not depend on the thread count. */
#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE   /* SCHED_IDLE */
#endif
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "spel_internal.h"

#define L2_EPS 1e-6f

/* Float-heavy functions get AVX-512 and AVX2 clones on x86-64 glibc (chosen at load by
 * ifunc).  With -ffp-contract=off every clone does the same IEEE operations in the same
 * order, so the results are identical; only the vector width differs. */
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__GNUC__) && !defined(__clang__) && !defined(SPEL_NO_CLONES)
#define SPEL_FLOAT_FN __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SPEL_FLOAT_FN
#endif
#define ROWS_CHUNK 256
#define KEY_BLOCK 256      /* cached positions per pass of attend_queries */
#define PREFILL_BATCH 64   /* tokens the prefill runs layer by layer */
#define KV_MIN_ROWS 64   /* first KV allocation; then doubling, at most max_seq */
#define MAX_WIDTH (1 << 17)   /* d_model, H*hd: q8 dots (127*127*cols) stay exact in int32 */

/* ---------------------------------------------------------------- helpers */
static void *alloc64_raw(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? n : 64) != 0) return NULL;
    return p;
}

static void *alloc64(size_t n) {
    void *p = alloc64_raw(n);
    if (p) memset(p, 0, n ? n : 64);
    return p;
}

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

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

static void rmsnorm(const float *x, const float *g, int64_t n, float eps, float *y) {
    float ms = spel_dot_f32(x, x, n) / (float)n;
    float r = 1.0f / sqrtf(ms + eps);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * r * g[i];
}

static void unit_vec(float *v, int64_t n) {
    float r = 1.0f / sqrtf(spel_dot_f32(v, v, n) + L2_EPS);
    for (int64_t i = 0; i < n; i++) v[i] *= r;
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
    mx->act.xq = alloc64((size_t)spel_pad_cols(cols));
    mx->act.xperm = alloc64((size_t)spel_pad_cols(cols));
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

/* ------------------------------------------------------------------ draft */
typedef struct {
    int kind, set;
    float *attn_norm, *ffn_norm, *conv, *decay, *beta;   /* decay/beta: sigmoid applied */
    spel_qmat wqkv, wo, w1, w3, w2;
    float *ring_S;     /* [R][H][hd][hd]: S transposed (rows index k, columns index v) */
    float *ring_tail;  /* [R][2][d]: the conv's last two normed inputs */
    float *kcache, *vcache;   /* k: [H][hd][kv_rows] (rotated, transposed); v: [H][kv_rows][hd] */
    int64_t kv_rows;          /* positions the caches hold; grows with use (reserve_kv) */
} dlayer;

struct spel_draft {
    spel_draft_config cfg;
    int kernel, R, read, last_m, shared_set;
    int64_t pos;
    spel_pool *pool;
    spel_pool *work_pool;   /* what the GEMVs run on: the pool, or NULL (one thread) on the ahead thread */
    dlayer *L;
    float *emb, *fnorm, *head;
    spel_qmat head_q;
    double *inv_freq;  /* theta^(-2i/hd), i < hd/2 */
    float *rope_cs;    /* cos and sin of the current position's angles */
    float *x, *xn, *h, *u, *qkv, *o, *mix, *g1, *g3, *scores;
    int64_t scores_len;
    spel_act act;
    spel_sampler *sampler;   /* proposals sampled instead of argmax when on (sampling.c) */
    char err[256];
    /* one caller at a time: every entry point claims this flag or returns SPEL_BUSY */
    atomic_int in_use;
    /* the asynchronous request (a proposal, spel_draft_propose_at_async, or a prefill,
     * spel_draft_prefill_async): one native worker, started on first use; while a
     * request is out (busy) no other call may run */
    struct {
        pthread_t th;
        pthread_mutex_t mu;
        pthread_cond_t cv;
        int started, busy, ready, quit, rc, k, start, guess, prefill;
        int cancel;   /* spel_draft_cancel: stop after the forward in progress (atomic) */
        int32_t pending, *out, *tokens;
        int64_t n_tokens;
    } ahead;
};

static int fail(spel_draft *d, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(d->err, sizeof d->err, fmt, ap);
    va_end(ap);
    return -1;
}

const char *spel_draft_error(const spel_draft *d) { return d ? d->err : "no draft"; }

/* One caller at a time.  Every entry point claims in_use or returns SPEL_BUSY at once,
 * so two threads on one draft get a clear error instead of sharing its scratch buffers,
 * state and pool.  (The error text is left alone: the other call may be writing it.) */
static int enter(spel_draft *d) {
    int idle = 0;
    return atomic_compare_exchange_strong_explicit(&d->in_use, &idle, 1, memory_order_acquire,
                                                   memory_order_relaxed);
}

static void leave(spel_draft *d) { atomic_store_explicit(&d->in_use, 0, memory_order_release); }

#define GUARDED(d, call)                   \
    do {                                   \
        if (!enter(d)) return SPEL_BUSY;   \
        int rc_ = (call);                  \
        leave(d);                          \
        return rc_;                        \
    } while (0)

/* a call while an asynchronous proposal runs would race with it (its worker may be
 * writing the error text, so this one returns a code, not a message) */
#define REFUSE_IF_BUSY(d) \
    if ((d)->ahead.busy) return SPEL_ASYNC_PENDING

spel_draft *spel_draft_new(const spel_draft_config *cfg, const int *kinds) {
    spel_draft *d = calloc(1, sizeof *d);
    if (!d) return NULL;
    d->cfg = *cfg;
    atomic_init(&d->in_use, 0);
    int64_t dm = cfg->d_model, inner = (int64_t)cfg->n_heads * cfg->head_dim, ff = cfg->d_ff;
    if (dm < 1 || cfg->n_heads < 1 || cfg->head_dim < 2 || (cfg->head_dim & 1) || ff < 1 || cfg->vocab < 1 ||
        cfg->max_seq < 1 || cfg->n_layers < 1 || cfg->ring < 2 || cfg->threads < 1 ||
        cfg->threads > SPEL_MAX_THREADS || dm > MAX_WIDTH || (int64_t)cfg->n_heads * cfg->head_dim > MAX_WIDTH) {
        snprintf(d->err, sizeof d->err, "invalid draft configuration");
        return d;   /* caller reads the error, then frees */
    }
    d->kernel = spel_kernel_resolve(cfg->kernel);
    if (d->kernel < 0) {
        snprintf(d->err, sizeof d->err, "kernel %s is not available on this CPU", spel_kernel_name(cfg->kernel));
        return d;
    }
    d->R = cfg->ring;
    d->pool = d->work_pool = spel_pool_create(cfg->threads);
    d->L = calloc((size_t)cfg->n_layers, sizeof(dlayer));
    int64_t wmax = dm > inner ? dm : inner;
    if (ff > wmax) wmax = ff;
    if (cfg->vocab > wmax) wmax = cfg->vocab;
    d->x = alloc64(4 * (size_t)dm);
    d->xn = alloc64(4 * (size_t)dm);
    d->h = alloc64(4 * (size_t)dm);
    d->u = alloc64(4 * (size_t)dm);
    d->qkv = alloc64(4 * (size_t)(3 * inner));
    d->o = alloc64(4 * (size_t)inner);
    d->mix = alloc64(4 * (size_t)dm);
    d->g1 = alloc64(4 * (size_t)ff);
    d->g3 = alloc64(4 * (size_t)ff);
    d->scores_len = KV_MIN_ROWS > cfg->head_dim ? KV_MIN_ROWS : cfg->head_dim;   /* grows with the KV caches */
    d->scores = alloc64(4 * (size_t)d->scores_len);
    d->inv_freq = alloc64(sizeof(double) * (size_t)(cfg->head_dim / 2 + 1));
    d->rope_cs = alloc64(4 * (size_t)cfg->head_dim);
    if (d->inv_freq)
        for (int i = 0; i < cfg->head_dim / 2; i++)
            d->inv_freq[i] = pow((double)cfg->rope_theta, -2.0 * i / cfg->head_dim);
    d->act.xq = alloc64((size_t)spel_pad_cols(wmax));
    d->act.xperm = alloc64((size_t)spel_pad_cols(wmax));
    if (!d->pool || !d->L || !d->x || !d->xn || !d->h || !d->u || !d->qkv || !d->o || !d->mix || !d->g1 ||
        !d->g3 || !d->scores || !d->inv_freq || !d->rope_cs || !d->act.xq || !d->act.xperm) {
        snprintf(d->err, sizeof d->err, "out of memory creating the draft (or its %d-thread pool)", cfg->threads);
        return d;
    }
    for (int l = 0; l < cfg->n_layers; l++) {
        dlayer *L = &d->L[l];
        L->kind = kinds[l];
        if (L->kind == SPEL_LAYER_GDN) {
            L->ring_S = alloc64(4 * (size_t)d->R * cfg->n_heads * cfg->head_dim * cfg->head_dim);
            L->ring_tail = alloc64(4 * (size_t)d->R * 2 * dm);
            if (!L->ring_S || !L->ring_tail) { snprintf(d->err, sizeof d->err, "out of memory (GDN ring)"); return d; }
        }   /* attention: the KV caches are allocated by reserve_kv as positions are used */
    }
    return d;
}

static float *copy_f32(const float *src, size_t n) {
    float *p = alloc64(4 * n);
    if (p) memcpy(p, src, 4 * n);
    return p;
}

/* Non-finite weights would make quantization scales, and so every logit, NaN: refused,
 * naming the tensor (layer < 0: a shared tensor). */
static int check_finite(spel_draft *d, const float *a, size_t n, int layer, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(a[i])) {
            if (layer < 0)
                return fail(d, "tensor %s holds a non-finite value (%g) at element %zu", name, (double)a[i], i);
            return fail(d, "tensor draft.layers.%d.%s holds a non-finite value (%g) at element %zu", layer, name,
                        (double)a[i], i);
        }
    return 0;
}

static int set_shared(spel_draft *d, const float *emb, const float *fnorm, const float *head) {
    const spel_draft_config *c = &d->cfg;
    size_t vd = (size_t)c->vocab * c->d_model;
    if (check_finite(d, emb, vd, -1, "tok_emb.weight") || check_finite(d, fnorm, c->d_model, -1, "final_norm.weight") ||
        check_finite(d, head, vd, -1, "lm_head.weight"))
        return -1;
    d->emb = copy_f32(emb, (size_t)c->vocab * c->d_model);
    d->fnorm = copy_f32(fnorm, (size_t)c->d_model);
    d->head = copy_f32(head, (size_t)c->vocab * c->d_model);
    if (!d->emb || !d->fnorm || !d->head) return fail(d, "out of memory (shared tensors)");
    if (c->q8_head && spel_qmat_init(&d->head_q, head, c->vocab, c->d_model, 0))
        return fail(d, "out of memory (q8 head)");
    d->shared_set = 1;
    return 0;
}

int spel_draft_set_shared(spel_draft *d, const float *emb, const float *fnorm, const float *head) {
    GUARDED(d, set_shared(d, emb, fnorm, head));
}

static int set_layer(spel_draft *d, int l, const float *attn_norm, const float *conv, const float *wqkv,
                     const float *wo, const float *decay_logit, const float *beta_logit, const float *ffn_norm,
                     const float *w1, const float *w3, const float *w2) {
    const spel_draft_config *c = &d->cfg;
    if (l < 0 || l >= c->n_layers) return fail(d, "layer %d out of range", l);
    dlayer *L = &d->L[l];
    int dm = c->d_model, H = c->n_heads, inner = H * c->head_dim, ff = c->d_ff;
    int gdn = L->kind == SPEL_LAYER_GDN;
    if (gdn && (!conv || !decay_logit || !beta_logit)) return fail(d, "GDN layer %d needs conv, decay and beta", l);
    const struct { const float *a; size_t n; const char *name; } ts[] = {
        {attn_norm, (size_t)dm, "attn_norm.weight"}, {gdn ? conv : NULL, 3 * (size_t)dm, "mixer.conv"},
        {wqkv, 3 * (size_t)inner * dm, "mixer.wqkv.weight"}, {wo, (size_t)dm * inner, "mixer.wo.weight"},
        {gdn ? decay_logit : NULL, (size_t)H, "mixer.decay_logit"}, {gdn ? beta_logit : NULL, (size_t)H, "mixer.beta_logit"},
        {ffn_norm, (size_t)dm, "ffn_norm.weight"}, {w1, (size_t)ff * dm, "mlp.w1.weight"},
        {w3, (size_t)ff * dm, "mlp.w3.weight"}, {w2, (size_t)dm * ff, "mlp.w2.weight"}};
    for (size_t t = 0; t < sizeof ts / sizeof ts[0]; t++)
        if (ts[t].a && check_finite(d, ts[t].a, ts[t].n, l, ts[t].name)) return -1;
    L->attn_norm = copy_f32(attn_norm, dm);
    L->ffn_norm = copy_f32(ffn_norm, dm);
    if (!L->attn_norm || !L->ffn_norm) return fail(d, "out of memory (norms)");
    if (gdn) {
        L->conv = copy_f32(conv, 3 * (size_t)dm);
        L->decay = alloc64(4 * (size_t)H);
        L->beta = alloc64(4 * (size_t)H);
        if (!L->conv || !L->decay || !L->beta) return fail(d, "out of memory (GDN params)");
        for (int h = 0; h < H; h++) {
            L->decay[h] = (float)(1.0 / (1.0 + exp(-(double)decay_logit[h])));
            L->beta[h] = (float)(1.0 / (1.0 + exp(-(double)beta_logit[h])));
        }
    }
    if (spel_qmat_init(&L->wqkv, wqkv, 3 * inner, dm, 0) || spel_qmat_init(&L->wo, wo, dm, inner, 0) ||
        spel_qmat_init(&L->w1, w1, ff, dm, 1) || spel_qmat_init(&L->w3, w3, ff, dm, 1) ||
        spel_qmat_init(&L->w2, w2, dm, ff, 1))
        return fail(d, "out of memory (quantized layer %d)", l);
    L->set = 1;
    return 0;
}

int spel_draft_set_layer(spel_draft *d, int l, const float *attn_norm, const float *conv, const float *wqkv,
                         const float *wo, const float *decay_logit, const float *beta_logit,
                         const float *ffn_norm, const float *w1, const float *w3, const float *w2) {
    GUARDED(d, set_layer(d, l, attn_norm, conv, wqkv, wo, decay_logit, beta_logit, ffn_norm, w1, w3, w2));
}

static int reset(spel_draft *d);

static int ready(spel_draft *d) {
    if (d->err[0]) return -1;
    if (!d->shared_set) return fail(d, "shared tensors (tok_emb, final_norm, lm_head) not set");
    for (int l = 0; l < d->cfg.n_layers; l++)
        if (!d->L[l].set) return fail(d, "draft layer %d not set", l);
    return reset(d);
}

int spel_draft_ready(spel_draft *d) { GUARDED(d, ready(d)); }

static void ahead_stop(spel_draft *d);

void spel_draft_free(spel_draft *d) {
    if (!d) return;
    while (!enter(d)) sched_yield();   /* a call running on another thread finishes first */
    ahead_stop(d);
    spel_pool_destroy(d->pool);
    if (d->L) {
        for (int l = 0; l < d->cfg.n_layers; l++) {
            dlayer *L = &d->L[l];
            free(L->attn_norm); free(L->ffn_norm); free(L->conv); free(L->decay); free(L->beta);
            spel_qmat_release(&L->wqkv); spel_qmat_release(&L->wo);
            spel_qmat_release(&L->w1); spel_qmat_release(&L->w3); spel_qmat_release(&L->w2);
            free(L->ring_S); free(L->ring_tail); free(L->kcache); free(L->vcache);
        }
        free(d->L);
    }
    free(d->emb); free(d->fnorm); free(d->head);
    spel_qmat_release(&d->head_q);
    free(d->x); free(d->xn); free(d->h); free(d->u); free(d->qkv); free(d->o); free(d->mix);
    free(d->g1); free(d->g3); free(d->scores); free(d->inv_freq); free(d->rope_cs); free(d->act.xq); free(d->act.xperm);
    spel_sampler_free(d->sampler);
    free(d);
}

static int wait_ahead(spel_draft *d, int32_t *out_tokens, int64_t timeout_us);

static int reset(spel_draft *d) {
    const spel_draft_config *c = &d->cfg;
    if (d->ahead.busy) wait_ahead(d, NULL, -1);   /* finish a running proposal first */
    d->read = 0;
    __atomic_store_n(&d->pos, 0, __ATOMIC_RELAXED);
    d->last_m = 0;
    size_t s_slot = (size_t)c->n_heads * c->head_dim * c->head_dim;
    for (int l = 0; l < c->n_layers; l++) {
        dlayer *L = &d->L[l];
        if (L->kind == SPEL_LAYER_GDN) {   /* only the committed slot is ever read */
            memset(L->ring_S, 0, 4 * s_slot);
            memset(L->ring_tail, 0, 4 * 2 * (size_t)c->d_model);
        }
    }
    return 0;
}

int spel_draft_reset(spel_draft *d) { GUARDED(d, reset(d)); }

/* may be read while another thread's call commits (relaxed: a value, not a handshake) */
int64_t spel_draft_pos(const spel_draft *d) { return __atomic_load_n(&d->pos, __ATOMIC_RELAXED); }
int spel_draft_kernel(const spel_draft *d) { return d->kernel; }
int spel_draft_threads(const spel_draft *d) { return spel_pool_threads(d->pool); }

int64_t spel_draft_packed_bytes(const spel_draft *d, int which) {
    int64_t n = 0;
    for (int l = 0; l < d->cfg.n_layers; l++) {
        const dlayer *L = &d->L[l];
        const spel_qmat *ms[5] = {&L->wqkv, &L->wo, &L->w1, &L->w3, &L->w2};
        for (int i = 0; i < 5; i++)
            if (ms[i]->ternary == which) n += ms[i]->rows * (ms[i]->stride + 4);
    }
    return n;
}

/* x -> quantized act, y = W x (one or two matrices sharing the input) */
static void qlinear(spel_draft *d, const float *x, int64_t n, const spel_qmat *m0, float *y0,
                    const spel_qmat *m1, float *y1) {
    spel_act_quantize(&d->act, x, n, d->kernel);
    spel_qgemv(d->work_pool, d->kernel, m0, y0, m1, y1, &d->act);
}

/* Rotate pairs (2i, 2i+1) by the angles whose cos/sin the caller computed once per position. */
static void rope(float *v, int hd, const float *cs, const float *sn) {
    for (int i = 0; i < hd / 2; i++) {
        float a = v[2 * i], b = v[2 * i + 1];
        v[2 * i] = a * cs[i] - b * sn[i];
        v[2 * i + 1] = a * sn[i] + b * cs[i];
    }
}

/* GDN mixer.  The ring stores each head's S TRANSPOSED (ST[j][i] = S[i][j], rows index k)
 * so every pass below is a reduction-free axpy over contiguous rows:
 *   Sk = sum_j k[j] ST[j]          e = beta (v - Sk)
 *   ST'[j] = a ST[j] + k[j] e      o = sum_j q[j] ST'[j] / sqrt(hd)          */
SPEL_FLOAT_FN static void gdn_mixer(spel_draft *d, dlayer *L, int j) {
    const spel_draft_config *c = &d->cfg;
    int dm = c->d_model, H = c->n_heads, hd = c->head_dim, inner = H * hd;
    int src = (d->read + j) % d->R, dst = (d->read + 1 + j) % d->R;
    const float *ts = L->ring_tail + (size_t)src * 2 * dm;
    float *td = L->ring_tail + (size_t)dst * 2 * dm;
    for (int i = 0; i < dm; i++)
        d->u[i] = L->conv[i] * ts[i] + L->conv[dm + i] * ts[dm + i] + L->conv[2 * dm + i] * d->xn[i];
    for (int i = 0; i < dm; i++) d->u[i] = silu(d->u[i]);
    memcpy(td, ts + dm, 4 * (size_t)dm);
    memcpy(td + dm, d->xn, 4 * (size_t)dm);
    qlinear(d, d->u, dm, &L->wqkv, d->qkv, NULL, NULL);
    const float inv_sqrt_hd = 1.0f / sqrtf((float)hd);
    size_t s_slot = (size_t)H * hd * hd;
    float *sk = d->scores;   /* hd floats of scratch */
    for (int h = 0; h < H; h++) {
        float *q = d->qkv + h * hd, *k = d->qkv + inner + h * hd, *v = d->qkv + 2 * inner + h * hd;
        unit_vec(q, hd);
        unit_vec(k, hd);
        const float *ST = L->ring_S + src * s_slot + (size_t)h * hd * hd;
        float *STd = L->ring_S + dst * s_slot + (size_t)h * hd * hd;
        float a = L->decay[h], beta = L->beta[h];
        float *o = d->o + h * hd;
        for (int i = 0; i < hd; i++) sk[i] = 0.0f;
        for (int t = 0; t < hd; t++) {
            const float *row = ST + (size_t)t * hd;
            float kt = k[t];
            for (int i = 0; i < hd; i++) sk[i] += kt * row[i];
        }
        for (int i = 0; i < hd; i++) {
            sk[i] = beta * (v[i] - sk[i]);   /* e */
            o[i] = 0.0f;
        }
        for (int t = 0; t < hd; t++) {
            const float *row = ST + (size_t)t * hd;
            float *drow = STd + (size_t)t * hd;
            float kt = k[t], qt = q[t];
            for (int i = 0; i < hd; i++) {
                drow[i] = a * row[i] + kt * sk[i];
                o[i] += qt * drow[i];
            }
        }
        for (int i = 0; i < hd; i++) o[i] *= inv_sqrt_hd;
    }
}

/* Grow layer L's caches to hold position p: rows double from KV_MIN_ROWS (at most
 * max_seq), so memory follows the positions used and the copies cost O(1) per token
 * amortized.  The score scratch grows with them. */
static int reserve_kv(spel_draft *d, dlayer *L, int64_t p) {
    const spel_draft_config *c = &d->cfg;
    if (p < L->kv_rows) return 0;
    int64_t rows = L->kv_rows ? L->kv_rows : KV_MIN_ROWS;
    while (rows <= p) rows *= 2;
    if (rows > c->max_seq) rows = c->max_seq;
    if (d->scores_len < rows) {
        float *sc = alloc64_raw(4 * (size_t)rows);
        if (!sc) return fail(d, "out of memory growing the attention scratch to %lld positions", (long long)rows);
        free(d->scores);
        d->scores = sc;
        d->scores_len = rows;
    }
    size_t inner = (size_t)c->n_heads * c->head_dim, keep = (size_t)(p < L->kv_rows ? p : L->kv_rows);
    float *k = alloc64_raw(4 * (size_t)rows * inner), *v = alloc64_raw(4 * (size_t)rows * inner);
    if (!k || !v) {
        free(k);
        free(v);
        return fail(d, "out of memory growing the KV cache to %lld positions", (long long)rows);
    }
    if (keep) {   /* positions < p are the ones ever read again */
        size_t hd = (size_t)c->head_dim;
        for (size_t r = 0; r < inner; r++) memcpy(k + r * rows, L->kcache + r * L->kv_rows, 4 * keep);
        for (size_t r = 0; r < inner; r += hd) memcpy(v + r * rows, L->vcache + r * L->kv_rows, 4 * keep * hd);
    }
    free(L->kcache);
    free(L->vcache);
    L->kcache = k;
    L->vcache = v;
    L->kv_rows = rows;
    return 0;
}

/* Attention.  The K cache is stored per head transposed, kcache[h][i][t], so the scores
 * of all cached positions are axpys over t; the V cache per head, vcache[h][t][i], so each
 * head's pass over t reads one contiguous stream (docs/neon.md).
 * attn_project: token p's q, k (unit, rotated) and v; k and v written to the caches
 * (grown to hold p), the rotated q left in d->qkv[0, inner). */
SPEL_FLOAT_FN static int attn_project(spel_draft *d, dlayer *L, int64_t p) {
    const spel_draft_config *c = &d->cfg;
    int dm = c->d_model, H = c->n_heads, hd = c->head_dim, inner = H * hd;
    if (reserve_kv(d, L, p)) return -1;
    const int64_t T = L->kv_rows;
    qlinear(d, d->xn, dm, &L->wqkv, d->qkv, NULL, NULL);
    float *cs = d->rope_cs, *sn = d->rope_cs + hd / 2;
    for (int i = 0; i < hd / 2; i++) {   /* angle pos * theta^(-2i/hd), in double */
        double ang = (double)p * d->inv_freq[i];
        cs[i] = (float)cos(ang);
        sn[i] = (float)sin(ang);
    }
    for (int h = 0; h < H; h++) {
        float *q = d->qkv + h * hd, *k = d->qkv + inner + h * hd;
        unit_vec(q, hd);
        unit_vec(k, hd);
        rope(q, hd, cs, sn);
        rope(k, hd, cs, sn);
        float *kc = L->kcache + (size_t)h * hd * T;
        for (int i = 0; i < hd; i++) kc[(size_t)i * T + p] = k[i];
    }
    for (int h = 0; h < H; h++)
        memcpy(L->vcache + ((size_t)h * T + p) * hd, d->qkv + 2 * inner + h * hd, 4 * (size_t)hd);
    return 0;
}

/* Causal softmax attention of m queries at positions p0.. (query j: Q + j*inner, sees
 * positions <= p0+j; its scores in S + j*ss) into O + j*inner.  Every query's operations
 * are those of a lone one in the same order (the score of position t summed over i,
 * the output over t), so m queries give each the bits of one; the cached rows are read
 * once for all m (a prompt's prefill), in blocks of KEY_BLOCK positions. */
SPEL_FLOAT_FN static void attend_queries(spel_draft *d, dlayer *L, int64_t p0, int m, const float *Q, float *O,
                                         float *S, int64_t ss) {
    const spel_draft_config *c = &d->cfg;
    int H = c->n_heads, hd = c->head_dim, inner = H * hd;
    const int64_t T = L->kv_rows, n_max = p0 + m;
    const float scale = sqrtf((float)hd);
    float sums[PREFILL_BATCH];
    for (int h = 0; h < H; h++) {
        const float *kc = L->kcache + (size_t)h * hd * T;
        for (int j = 0; j < m; j++)
            for (int64_t t = 0; t <= p0 + j; t++) S[(size_t)j * ss + t] = 0.0f;
        for (int64_t t0 = 0; t0 < n_max; t0 += KEY_BLOCK)
            for (int i = 0; i < hd; i++) {
                const float *col = kc + (size_t)i * T;
                for (int j = 0; j < m; j++) {
                    float *sc = S + (size_t)j * ss, qi = Q[(size_t)j * inner + h * hd + i];
                    const int64_t t1 = p0 + j + 1 < t0 + KEY_BLOCK ? p0 + j + 1 : t0 + KEY_BLOCK;
                    for (int64_t t = t0; t < t1; t++) sc[t] += qi * col[t];
                }
            }
        for (int j = 0; j < m; j++) {
            float *sc = S + (size_t)j * ss, top = -INFINITY, sum = 0.0f;
            const int64_t n = p0 + j + 1;
            for (int64_t t = 0; t < n; t++) {
                sc[t] *= scale;
                if (sc[t] > top) top = sc[t];
            }
            for (int64_t t = 0; t < n; t++) {
                sc[t] = expf(sc[t] - top);
                sum += sc[t];
            }
            sums[j] = sum;
            for (int i = 0; i < hd; i++) O[(size_t)j * inner + h * hd + i] = 0.0f;
        }
        for (int64_t t = 0; t < n_max; t++) {
            const float *vt = L->vcache + ((size_t)h * T + t) * hd;
            for (int j = t > p0 ? (int)(t - p0) : 0; j < m; j++) {
                float *o = O + (size_t)j * inner + h * hd, e = S[(size_t)j * ss + t];
                for (int i = 0; i < hd; i++) o[i] += e * vt[i];
            }
        }
        for (int j = 0; j < m; j++) {
            float *o = O + (size_t)j * inner + h * hd, inv = 1.0f / sums[j];
            for (int i = 0; i < hd; i++) o[i] *= inv;
        }
    }
}

/* The rest of a layer after its mixer (output in d->o): x += wo o, then the SwiGLU MLP. */
static void finish_layer(spel_draft *d, dlayer *L, float *x) {
    const spel_draft_config *c = &d->cfg;
    int dm = c->d_model, inner = c->n_heads * c->head_dim, ff = c->d_ff;
    qlinear(d, d->o, inner, &L->wo, d->mix, NULL, NULL);
    for (int i = 0; i < dm; i++) d->h[i] = x[i] + d->mix[i];
    rmsnorm(d->h, L->ffn_norm, dm, c->norm_eps, d->xn);
    qlinear(d, d->xn, dm, &L->w1, d->g1, &L->w3, d->g3);
    for (int i = 0; i < ff; i++) d->g1[i] = silu(d->g1[i]) * d->g3[i];
    qlinear(d, d->g1, ff, &L->w2, d->mix, NULL, NULL);
    for (int i = 0; i < dm; i++) x[i] = d->h[i] + d->mix[i];
}

/* Token at offset j of the uncommitted batch: GDN reads ring slot read+j, writes
 * read+1+j; attention writes KV at pos+j. */
static int run_token(spel_draft *d, int32_t tok, int j, float *logits) {
    const spel_draft_config *c = &d->cfg;
    int64_t p = d->pos + j;
    if (tok < 0 || tok >= c->vocab) return fail(d, "token %d out of range 0..%d", tok, c->vocab - 1);
    if (p >= c->max_seq) return fail(d, "position %lld reaches max_seq=%d", (long long)p, c->max_seq);
    int dm = c->d_model;
    memcpy(d->x, d->emb + (size_t)tok * dm, 4 * (size_t)dm);
    for (int l = 0; l < c->n_layers; l++) {
        dlayer *L = &d->L[l];
        rmsnorm(d->x, L->attn_norm, dm, c->norm_eps, d->xn);
        if (L->kind == SPEL_LAYER_GDN) {
            gdn_mixer(d, L, j);
        } else {
            if (attn_project(d, L, p)) return -1;
            attend_queries(d, L, p, 1, d->qkv, d->o, d->scores, 0);
        }
        finish_layer(d, L, d->x);
    }
    if (!logits) return 0;   /* state only: the FP32 head is ~a third of a token */
    rmsnorm(d->x, d->fnorm, dm, c->norm_eps, d->xn);
    if (c->q8_head) qlinear(d, d->xn, dm, &d->head_q, logits, NULL, NULL);
    else spel_fgemv(d->work_pool, d->head, c->vocab, dm, d->xn, logits);
    return 0;
}

/* m (<= PREFILL_BATCH) prompt tokens at offsets 0.. of a fresh batch, layer by layer (no
 * logits): each token's operations are run_token's in the same order (GDN slots read+j
 * -> read+1+j, the same state), but an attention layer attends all m queries in one
 * pass over the cache.  X [m][d], Q and O [m][inner], S [m][ss] (ss >= pos+m) are the
 * caller's scratch; m may exceed the ring (the slots are walked in order; prefill
 * commits all m). */
static int prefill_tokens(spel_draft *d, const int32_t *tokens, int m, float *X, float *Q, float *O, float *S,
                          int64_t ss) {
    const spel_draft_config *c = &d->cfg;
    int dm = c->d_model, inner = c->n_heads * c->head_dim;
    for (int j = 0; j < m; j++) memcpy(X + (size_t)j * dm, d->emb + (size_t)tokens[j] * dm, 4 * (size_t)dm);
    for (int l = 0; l < c->n_layers; l++) {
        dlayer *L = &d->L[l];
        for (int j = 0; j < m; j++) {
            rmsnorm(X + (size_t)j * dm, L->attn_norm, dm, c->norm_eps, d->xn);
            if (L->kind == SPEL_LAYER_GDN) {
                gdn_mixer(d, L, j);
                finish_layer(d, L, X + (size_t)j * dm);
            } else {
                if (attn_project(d, L, d->pos + j)) return -1;
                memcpy(Q + (size_t)j * inner, d->qkv, 4 * (size_t)inner);
            }
        }
        if (L->kind == SPEL_LAYER_GDN) continue;
        attend_queries(d, L, d->pos, m, Q, O, S, ss);
        for (int j = 0; j < m; j++) {
            memcpy(d->o, O + (size_t)j * inner, 4 * (size_t)inner);
            finish_layer(d, L, X + (size_t)j * dm);
        }
    }
    return 0;
}

static int forward_from(spel_draft *d, const int32_t *tokens, int m, int start, float *logits) {
    REFUSE_IF_BUSY(d);
    if (m < 1) return fail(d, "forward needs at least one token");
    if (start < 0 || start > d->last_m) return fail(d, "start %d beyond the %d uncommitted tokens", start, d->last_m);
    /* a batch that filled the whole ring overwrote the committed slot: only commit
     * (or continuing it) is possible, not a fresh batch */
    if (start == 0 && d->last_m == d->R)
        return fail(d, "the last batch filled the ring (%d slots); commit before starting a new batch", d->R);
    if (start + m > d->R) return fail(d, "batch of %d tokens exceeds the ring (%d slots)", start + m, d->R);
    for (int j = 0; j < m; j++)
        if (run_token(d, tokens[j], start + j, logits ? logits + (size_t)j * d->cfg.vocab : NULL)) {
            d->last_m = 0;
            return -1;
        }
    d->last_m = start + m;
    return 0;
}

int spel_draft_forward_from(spel_draft *d, const int32_t *tokens, int m, int start, float *logits) {
    GUARDED(d, forward_from(d, tokens, m, start, logits));
}

int spel_draft_forward(spel_draft *d, const int32_t *tokens, int m, float *logits) {
    return spel_draft_forward_from(d, tokens, m, 0, logits);
}

/* commit n tokens of the last batch; keep: the rest stays uncommitted (at offsets 0..) */
static int commit(spel_draft *d, int n, int keep) {
    REFUSE_IF_BUSY(d);
    if (n < 1 || n > d->last_m) return fail(d, "commit(%d): the last batch has %d uncommitted tokens", n, d->last_m);
    d->read = (d->read + n) % d->R;
    __atomic_store_n(&d->pos, d->pos + n, __ATOMIC_RELAXED);
    d->last_m = keep ? d->last_m - n : 0;
    return 0;
}

int spel_draft_commit(spel_draft *d, int n) { GUARDED(d, commit(d, n, 0)); }

int spel_draft_commit_keep(spel_draft *d, int n) { GUARDED(d, commit(d, n, 1)); }

static int step(spel_draft *d, int32_t token, float *logits) {
    int rc = forward_from(d, &token, 1, 0, logits);
    return rc ? rc : commit(d, 1, 0);
}

int spel_draft_step(spel_draft *d, int32_t token, float *logits) { GUARDED(d, step(d, token, logits)); }

/* n tokens fed and committed from a committed state: the state spel_draft_forward +
 * spel_draft_commit leave over ring-sized batches, bit for bit, in batches of
 * PREFILL_BATCH tokens run layer by layer (runs on the draft's thread: no guard) */
static int prefill(spel_draft *d, const int32_t *tokens, int64_t n) {
    const spel_draft_config *c = &d->cfg;
    size_t inner = (size_t)c->n_heads * c->head_dim, B = PREFILL_BATCH, ss = (size_t)(d->pos + n);
    float *X = alloc64_raw(4 * B * (size_t)c->d_model), *Q = alloc64_raw(4 * B * inner),
          *O = alloc64_raw(4 * B * inner), *S = alloc64_raw(4 * B * ss);
    int rc = X && Q && O && S ? 0 : fail(d, "out of memory (prefill scratch)");
    for (int64_t i = 0; i < n && rc == 0; i += PREFILL_BATCH) {
        int m = n - i < PREFILL_BATCH ? (int)(n - i) : PREFILL_BATCH;
        if ((rc = prefill_tokens(d, tokens + i, m, X, Q, O, S, (int64_t)ss)) == 0) {
            d->read = (int)((d->read + m) % d->R);
            __atomic_store_n(&d->pos, d->pos + m, __ATOMIC_RELAXED);
        }
    }
    free(X);
    free(Q);
    free(O);
    free(S);
    return rc;
}

/* the request checks of a proposal at offset start (also made before an async one is accepted) */
static int check_propose(spel_draft *d, int k, int start) {
    if (k < 1 || start < 0 || start + k + 1 > d->R)
        return fail(d, "propose(K=%d) at offset %d needs offset+K+1 <= ring (%d)", k, start, d->R);
    if (start > d->last_m) return fail(d, "propose at offset %d beyond the %d uncommitted tokens", start, d->last_m);
    return 0;
}

static int propose_at(spel_draft *d, int32_t pending, int k, int start, int guess, int32_t *out) {
    if (check_propose(d, k, start)) return -1;
    if (start == 0 && d->last_m == d->R)
        return fail(d, "the last batch filled the ring (%d slots); commit before proposing", d->R);
    float *logits = malloc(4 * (size_t)d->cfg.vocab);
    if (!logits) return fail(d, "out of memory");
    int32_t t = pending;
    int rc = 0;
    for (int j = 0; j <= k; j++) {
        if (__atomic_load_n(&d->ahead.cancel, __ATOMIC_RELAXED)) {
            rc = SPEL_CANCELLED;   /* the batch before `start` stays as it was */
            break;
        }
        /* the last forward extends the state over d_{k-1}; its logits (the draft's
         * guess at the target's next token, out[k]) only when asked for */
        if ((rc = run_token(d, t, start + j, j < k || guess ? logits : NULL))) break;
        if (j == k && !guess) break;
        int best = 0;
        if (spel_sampler_on(d->sampler)) {
            if ((best = spel_sampler_pick(d->sampler, logits, pending, out, j, start + j)) < 0) {
                rc = fail(d, "no finite draft logit at offset %d", start + j);
                break;
            }
        } else {
            for (int v = 1; v < d->cfg.vocab; v++)
                if (logits[v] > logits[best]) best = v;
        }
        out[j] = t = best;
    }
    free(logits);
    d->last_m = rc == SPEL_CANCELLED ? start : rc ? 0 : start + k + 1;
    return rc;
}

static int propose_at_sync(spel_draft *d, int32_t pending, int k, int start, int guess, int32_t *out) {
    REFUSE_IF_BUSY(d);
    return propose_at(d, pending, k, start, guess, out);
}

int spel_draft_propose_at(spel_draft *d, int32_t pending, int k, int start, int guess, int32_t *out) {
    GUARDED(d, propose_at_sync(d, pending, k, start, guess, out));
}

int spel_draft_propose(spel_draft *d, int32_t pending, int k, int32_t *out) {
    return spel_draft_propose_at(d, pending, k, 0, 0, out);
}

/* --- asynchronous proposal: the draft drafts on its own thread while the caller
 * (the target's verification) runs; started without any Python lock ----------- */
/* The worker drafts at the lowest priority (Linux SCHED_IDLE): on the CPU time the
 * target's threads leave, so the thread scheduling the target's pass never waits
 * behind it (measured: 1.90-1.97x -> 2.00-2.05x AR over three held-out texts).  A
 * caller that waits for an unfinished proposal lifts it back to normal, so a busy
 * machine cannot starve it. */
static void ahead_priority(pthread_t th, int idle) {
#if defined(__linux__)
    struct sched_param sp = {0};
    pthread_setschedparam(th, idle ? SCHED_IDLE : SCHED_OTHER, &sp);
#else
    (void)th;
    (void)idle;
#endif
}

static void *ahead_main(void *arg) {
    spel_draft *d = arg;
#if defined(__linux__)
    pthread_setname_np(pthread_self(), "spel-draft");   /* what top -H and perf show */
#endif
    pthread_mutex_lock(&d->ahead.mu);
    for (;;) {
        while (!d->ahead.quit && !(d->ahead.busy && !d->ahead.ready)) pthread_cond_wait(&d->ahead.cv, &d->ahead.mu);
        if (d->ahead.quit) break;
        pthread_mutex_unlock(&d->ahead.mu);
        /* a prefill runs beside the target's: at normal priority, it is on the critical path */
        ahead_priority(pthread_self(), !d->ahead.prefill);
        /* the target runs meanwhile: this thread alone, the pool's helpers stay for the
         * calls the target waits for */
        d->work_pool = NULL;
        int rc = d->ahead.prefill ? prefill(d, d->ahead.tokens, d->ahead.n_tokens)
                                  : propose_at(d, d->ahead.pending, d->ahead.k, d->ahead.start, d->ahead.guess,
                                               d->ahead.out);
        d->work_pool = d->pool;
        pthread_mutex_lock(&d->ahead.mu);
        d->ahead.rc = rc;
        d->ahead.ready = 1;
        pthread_cond_broadcast(&d->ahead.cv);
    }
    pthread_mutex_unlock(&d->ahead.mu);
    return NULL;
}

static void ahead_stop(spel_draft *d) {
    if (!d->ahead.started) return;
    pthread_mutex_lock(&d->ahead.mu);
    d->ahead.quit = 1;
    pthread_cond_broadcast(&d->ahead.cv);
    pthread_mutex_unlock(&d->ahead.mu);
    pthread_join(d->ahead.th, NULL);   /* a running request finishes first */
    pthread_cond_destroy(&d->ahead.cv);
    pthread_mutex_destroy(&d->ahead.mu);
    free(d->ahead.out);
    free(d->ahead.tokens);
    d->ahead.tokens = NULL;
    d->ahead.started = 0;
}

static int ahead_start(spel_draft *d) {
    if (!d->ahead.started) {
        d->ahead.out = malloc(sizeof(int32_t) * ((size_t)d->R + 1));
        if (!d->ahead.out) return fail(d, "out of memory");
        pthread_mutex_init(&d->ahead.mu, NULL);
        pthread_cond_init(&d->ahead.cv, NULL);
        d->ahead.quit = d->ahead.busy = d->ahead.ready = 0;
        if (pthread_create(&d->ahead.th, NULL, ahead_main, d)) {
            pthread_cond_destroy(&d->ahead.cv);
            pthread_mutex_destroy(&d->ahead.mu);
            free(d->ahead.out);
            d->ahead.out = NULL;
            return fail(d, "cannot start the draft's proposal thread");
        }
        d->ahead.started = 1;
    }
    return 0;
}

/* hand the request whose fields the caller set (holding ahead.mu) to the worker */
static void ahead_post(spel_draft *d) {
    d->ahead.ready = 0;
    __atomic_store_n(&d->ahead.cancel, 0, __ATOMIC_RELAXED);
    d->ahead.busy = 1;
    pthread_cond_broadcast(&d->ahead.cv);
    pthread_mutex_unlock(&d->ahead.mu);
}

static int propose_at_async(spel_draft *d, int32_t pending, int k, int start, int guess) {
    REFUSE_IF_BUSY(d);
    /* checked now, so an accepted request can only fail inside run_token */
    if (check_propose(d, k, start) || ahead_start(d)) return -1;
    pthread_mutex_lock(&d->ahead.mu);
    d->ahead.prefill = 0;
    d->ahead.pending = pending;
    d->ahead.k = k;
    d->ahead.start = start;
    d->ahead.guess = guess;
    ahead_post(d);
    return 0;
}

int spel_draft_propose_at_async(spel_draft *d, int32_t pending, int k, int start, int guess) {
    GUARDED(d, propose_at_async(d, pending, k, start, guess));
}

static int prefill_async(spel_draft *d, const int32_t *tokens, int64_t n) {
    REFUSE_IF_BUSY(d);
    if (n < 0) return fail(d, "prefill of %lld tokens", (long long)n);
    if (d->last_m) return fail(d, "prefill needs a committed state (commit the last batch first)");
    if (d->pos + n > d->cfg.max_seq)
        return fail(d, "prefill of %lld tokens at position %lld passes max_seq=%d", (long long)n,
                    (long long)d->pos, d->cfg.max_seq);
    for (int64_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= d->cfg.vocab)
            return fail(d, "token %d out of range 0..%d", tokens[i], d->cfg.vocab - 1);
    int32_t *copy = malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    if (!copy) return fail(d, "out of memory");
    memcpy(copy, tokens, sizeof(int32_t) * (size_t)n);
    if (ahead_start(d)) {
        free(copy);
        return -1;
    }
    pthread_mutex_lock(&d->ahead.mu);
    free(d->ahead.tokens);
    d->ahead.tokens = copy;
    d->ahead.n_tokens = n;
    d->ahead.prefill = 1;
    d->ahead.k = 0;
    d->ahead.guess = 0;
    ahead_post(d);
    return 0;
}

int spel_draft_prefill_async(spel_draft *d, const int32_t *tokens, int64_t n) {
    GUARDED(d, prefill_async(d, tokens, n));
}

/* timeout_us < 0: as long as it takes */
static int wait_ahead(spel_draft *d, int32_t *out_tokens, int64_t timeout_us) {
    if (!d->ahead.busy) return fail(d, "wait: no asynchronous proposal was started");
    pthread_mutex_lock(&d->ahead.mu);
    if (!d->ahead.ready) ahead_priority(d->ahead.th, 0);   /* now on the critical path */
    if (timeout_us < 0) {
        while (!d->ahead.ready) pthread_cond_wait(&d->ahead.cv, &d->ahead.mu);
    } else {
        struct timespec until;   /* the condition variable's clock: CLOCK_REALTIME */
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += (time_t)(timeout_us / 1000000);
        until.tv_nsec += (long)(timeout_us % 1000000) * 1000;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
        while (!d->ahead.ready)
            if (pthread_cond_timedwait(&d->ahead.cv, &d->ahead.mu, &until) == ETIMEDOUT) break;
        if (!d->ahead.ready) {
            pthread_mutex_unlock(&d->ahead.mu);
            return SPEL_TIMEOUT;
        }
    }
    d->ahead.busy = 0;
    __atomic_store_n(&d->ahead.cancel, 0, __ATOMIC_RELAXED);
    int rc = d->ahead.rc;
    pthread_mutex_unlock(&d->ahead.mu);
    if (rc == 0 && out_tokens && !d->ahead.prefill)
        memcpy(out_tokens, d->ahead.out, sizeof(int32_t) * ((size_t)d->ahead.k + (d->ahead.guess ? 1 : 0)));
    return rc;
}

int spel_draft_wait(spel_draft *d, int32_t *out_tokens) { GUARDED(d, wait_ahead(d, out_tokens, -1)); }

int spel_draft_wait_for(spel_draft *d, int32_t *out_tokens, int64_t timeout_us) {
    if (timeout_us < 0) return fail(d, "wait_for: negative timeout %lld us", (long long)timeout_us);
    GUARDED(d, wait_ahead(d, out_tokens, timeout_us));
}

/* --- sampled proposals (the sampler lives in sampling.c) ----------------------- */
static int set_sampling(spel_draft *d, const spel_sampling *s, int want_q) {
    REFUSE_IF_BUSY(d);
    if (!s) {
        if (d->sampler) spel_sampler_configure(d->sampler, NULL, 0);
        return 0;
    }
    if (!d->sampler && !(d->sampler = spel_sampler_new(d->cfg.vocab, d->R))) return fail(d, "out of memory");
    const int rc = spel_sampler_configure(d->sampler, s, want_q);
    if (rc == -1) return fail(d, "bad sampling parameters");
    return rc ? fail(d, "out of memory") : 0;
}

int spel_draft_set_sampling(spel_draft *d, const spel_sampling *s, int want_q) {
    GUARDED(d, set_sampling(d, s, want_q));
}

static int set_context(spel_draft *d, const int32_t *ctx, int n, int64_t index) {
    REFUSE_IF_BUSY(d);
    if (!spel_sampler_on(d->sampler)) return fail(d, "set_context: sampling is off");
    if (n < 0 || index < 0) return fail(d, "set_context: bad length %d or index %lld", n, (long long)index);
    spel_sampler_context(d->sampler, ctx, n, index);
    return 0;
}

int spel_draft_set_context(spel_draft *d, const int32_t *ctx, int n, int64_t index) {
    GUARDED(d, set_context(d, ctx, n, index));
}

static int probs(spel_draft *d, int offset, double *out) {
    REFUSE_IF_BUSY(d);
    const double *q = spel_sampler_on(d->sampler) ? spel_sampler_q(d->sampler, offset) : NULL;
    if (!q) return fail(d, "no distribution kept at offset %d (sampling with want_q is off)", offset);
    memcpy(out, q, sizeof(double) * (size_t)d->cfg.vocab);
    return 0;
}

int spel_draft_probs(spel_draft *d, int offset, double *out) { GUARDED(d, probs(d, offset, out)); }

/* Ask a running asynchronous proposal to stop after its current forward (its result is
 * then not wanted: the round did not accept everything).  spel_draft_wait returns
 * SPEL_CANCELLED for a proposal that stopped early; the batch before its offset stays. */
static int cancel(spel_draft *d) {
    if (!d->ahead.busy) return fail(d, "cancel: no asynchronous proposal was started");
    __atomic_store_n(&d->ahead.cancel, 1, __ATOMIC_RELAXED);
    return 0;
}

int spel_draft_cancel(spel_draft *d) { GUARDED(d, cancel(d)); }
