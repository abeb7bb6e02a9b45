/* The CPU draft engine (SPEC 2 draft, 3, 4): its configuration, weights (q8 wqkv/wo,
 * ternary SwiGLU, the FP32 or optional q8 LM head), state and scratch, the one-caller
 * guard, the sampling settings.  The forward pass is in forward.c, the proposals on
 * the engine's own thread in ahead.c, the GEMVs in gemv.c (docs/neon.md). */
#include "draft_engine.h"

#include <errno.h>
#include <math.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---------------------------------------------------------------- helpers */
void *spel_alloc64_raw(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? n : 64) != 0) return NULL;
    return p;
}

void *spel_alloc64(size_t n) {
    void *p = spel_alloc64_raw(n);
    if (p) memset(p, 0, n ? n : 64);
    return p;
}


int spel_draft_fail(spel_draft *d, const char *fmt, ...) {
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
    d->x = spel_alloc64(4 * (size_t)dm);
    d->xn = spel_alloc64(4 * (size_t)dm);
    d->h = spel_alloc64(4 * (size_t)dm);
    d->u = spel_alloc64(4 * (size_t)dm);
    d->qkv = spel_alloc64(4 * (size_t)(3 * inner));
    d->o = spel_alloc64(4 * (size_t)inner);
    d->mix = spel_alloc64(4 * (size_t)dm);
    d->g1 = spel_alloc64(4 * (size_t)ff);
    d->g3 = spel_alloc64(4 * (size_t)ff);
    d->scores_len = KV_MIN_ROWS > cfg->head_dim ? KV_MIN_ROWS : cfg->head_dim;   /* grows with the KV caches */
    d->scores = spel_alloc64(4 * (size_t)d->scores_len);
    d->inv_freq = spel_alloc64(sizeof(double) * (size_t)(cfg->head_dim / 2 + 1));
    d->rope_cs = spel_alloc64(4 * (size_t)cfg->head_dim);
    if (d->inv_freq)
        for (int i = 0; i < cfg->head_dim / 2; i++)
            d->inv_freq[i] = pow((double)cfg->rope_theta, -2.0 * i / cfg->head_dim);
    d->act.xq = spel_alloc64((size_t)spel_pad_cols(wmax));
    d->act.xperm = spel_alloc64((size_t)spel_pad_cols(wmax));
    if (!d->pool || !d->L || !d->x || !d->xn || !d->h || !d->u || !d->qkv || !d->o || !d->mix || !d->g1 ||
        !d->g3 || !d->scores || !d->inv_freq || !d->rope_cs || !d->act.xq || !d->act.xperm) {
        snprintf(d->err, sizeof d->err, "out of memory creating the draft (or its %d-thread pool)", cfg->threads);
        return d;
    }
    for (int l = 0; l < cfg->n_layers; l++) {
        dlayer *L = &d->L[l];
        L->kind = kinds[l];
        if (L->kind == SPEL_LAYER_GDN) {
            L->ring_S = spel_alloc64(4 * (size_t)d->R * cfg->n_heads * cfg->head_dim * cfg->head_dim);
            L->ring_tail = spel_alloc64(4 * (size_t)d->R * 2 * dm);
            if (!L->ring_S || !L->ring_tail) { snprintf(d->err, sizeof d->err, "out of memory (GDN ring)"); return d; }
        }   /* attention: the KV caches are allocated by reserve_kv as positions are used */
    }
    return d;
}

static float *copy_f32(const float *src, size_t n) {
    float *p = spel_alloc64(4 * n);
    if (p) memcpy(p, src, 4 * n);
    return p;
}

/* Non-finite weights would make quantization scales, and so every logit, NaN: refused,
 * naming the tensor (layer < 0: a shared tensor). */
static int check_finite(spel_draft *d, const float *a, size_t n, int layer, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(a[i])) {
            if (layer < 0)
                return spel_draft_fail(d, "tensor %s holds a non-finite value (%g) at element %zu", name, (double)a[i], i);
            return spel_draft_fail(d, "tensor draft.layers.%d.%s holds a non-finite value (%g) at element %zu", layer, name,
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
    if (!d->emb || !d->fnorm || !d->head) return spel_draft_fail(d, "out of memory (shared tensors)");
    if (c->q8_head && spel_qmat_init(&d->head_q, head, c->vocab, c->d_model, 0))
        return spel_draft_fail(d, "out of memory (q8 head)");
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
    if (l < 0 || l >= c->n_layers) return spel_draft_fail(d, "layer %d out of range", l);
    dlayer *L = &d->L[l];
    int dm = c->d_model, H = c->n_heads, inner = H * c->head_dim, ff = c->d_ff;
    int gdn = L->kind == SPEL_LAYER_GDN;
    if (gdn && (!conv || !decay_logit || !beta_logit)) return spel_draft_fail(d, "GDN layer %d needs conv, decay and beta", l);
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
    if (!L->attn_norm || !L->ffn_norm) return spel_draft_fail(d, "out of memory (norms)");
    if (gdn) {
        L->conv = copy_f32(conv, 3 * (size_t)dm);
        L->decay = spel_alloc64(4 * (size_t)H);
        L->beta = spel_alloc64(4 * (size_t)H);
        if (!L->conv || !L->decay || !L->beta) return spel_draft_fail(d, "out of memory (GDN params)");
        for (int h = 0; h < H; h++) {
            L->decay[h] = (float)(1.0 / (1.0 + exp(-(double)decay_logit[h])));
            L->beta[h] = (float)(1.0 / (1.0 + exp(-(double)beta_logit[h])));
        }
    }
    if (spel_qmat_init(&L->wqkv, wqkv, 3 * inner, dm, 0) || spel_qmat_init(&L->wo, wo, dm, inner, 0) ||
        spel_qmat_init(&L->w1, w1, ff, dm, 1) || spel_qmat_init(&L->w3, w3, ff, dm, 1) ||
        spel_qmat_init(&L->w2, w2, dm, ff, 1))
        return spel_draft_fail(d, "out of memory (quantized layer %d)", l);
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
    if (!d->shared_set) return spel_draft_fail(d, "shared tensors (tok_emb, final_norm, lm_head) not set");
    for (int l = 0; l < d->cfg.n_layers; l++)
        if (!d->L[l].set) return spel_draft_fail(d, "draft layer %d not set", l);
    return reset(d);
}

int spel_draft_ready(spel_draft *d) { GUARDED(d, ready(d)); }


void spel_draft_free(spel_draft *d) {
    if (!d) return;
    while (!enter(d)) sched_yield();   /* a call running on another thread finishes first */
    spel_draft_ahead_stop(d);
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


static int reset(spel_draft *d) {
    const spel_draft_config *c = &d->cfg;
    if (d->ahead.busy) spel_draft_wait_ahead(d, NULL, -1);   /* finish a running proposal first */
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

/* --- sampled proposals (the sampler lives in sampling.c) ----------------------- */
static int set_sampling(spel_draft *d, const spel_sampling *s, int want_q) {
    REFUSE_IF_BUSY(d);
    if (!s) {
        if (d->sampler) spel_sampler_configure(d->sampler, NULL, 0);
        return 0;
    }
    if (!d->sampler && !(d->sampler = spel_sampler_new(d->cfg.vocab, d->R))) return spel_draft_fail(d, "out of memory");
    const int rc = spel_sampler_configure(d->sampler, s, want_q);
    if (rc == -1) return spel_draft_fail(d, "bad sampling parameters");
    return rc ? spel_draft_fail(d, "out of memory") : 0;
}

int spel_draft_set_sampling(spel_draft *d, const spel_sampling *s, int want_q) {
    GUARDED(d, set_sampling(d, s, want_q));
}

static int set_context(spel_draft *d, const int32_t *ctx, int n, int64_t index) {
    REFUSE_IF_BUSY(d);
    if (!spel_sampler_on(d->sampler)) return spel_draft_fail(d, "set_context: sampling is off");
    if (n < 0 || index < 0) return spel_draft_fail(d, "set_context: bad length %d or index %lld", n, (long long)index);
    spel_sampler_context(d->sampler, ctx, n, index);
    return 0;
}

int spel_draft_set_context(spel_draft *d, const int32_t *ctx, int n, int64_t index) {
    GUARDED(d, set_context(d, ctx, n, index));
}

static int probs(spel_draft *d, int offset, double *out) {
    REFUSE_IF_BUSY(d);
    const double *q = spel_sampler_on(d->sampler) ? spel_sampler_q(d->sampler, offset) : NULL;
    if (!q) return spel_draft_fail(d, "no distribution kept at offset %d (sampling with want_q is off)", offset);
    memcpy(out, q, sizeof(double) * (size_t)d->cfg.vocab);
    return 0;
}

int spel_draft_probs(spel_draft *d, int offset, double *out) { GUARDED(d, probs(d, offset, out)); }
