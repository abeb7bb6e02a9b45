/* The draft's forward pass: one token through every layer (embedding row, RMSNorm,
 * GDN conv + delta rule over the (K+1)-slot state ring, RoPE attention over the KV
 * cache, the SwiGLU MLP), a prompt's prefill layer by layer, commit, and proposals.
 * Quantized GEMVs run row-parallel on the draft's pool; everything else is serial on
 * the calling thread, so logits do not depend on the thread count. */
#include "draft_engine.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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
        float *sc = spel_alloc64_raw(4 * (size_t)rows);
        if (!sc) return spel_draft_fail(d, "out of memory growing the attention scratch to %lld positions", (long long)rows);
        free(d->scores);
        d->scores = sc;
        d->scores_len = rows;
    }
    size_t inner = (size_t)c->n_heads * c->head_dim, keep = (size_t)(p < L->kv_rows ? p : L->kv_rows);
    float *k = spel_alloc64_raw(4 * (size_t)rows * inner), *v = spel_alloc64_raw(4 * (size_t)rows * inner);
    if (!k || !v) {
        free(k);
        free(v);
        return spel_draft_fail(d, "out of memory growing the KV cache to %lld positions", (long long)rows);
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
    if (tok < 0 || tok >= c->vocab) return spel_draft_fail(d, "token %d out of range 0..%d", tok, c->vocab - 1);
    if (p >= c->max_seq) return spel_draft_fail(d, "position %lld reaches max_seq=%d", (long long)p, c->max_seq);
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
    if (m < 1) return spel_draft_fail(d, "forward needs at least one token");
    if (start < 0 || start > d->last_m) return spel_draft_fail(d, "start %d beyond the %d uncommitted tokens", start, d->last_m);
    /* a batch that filled the whole ring overwrote the committed slot: only commit
     * (or continuing it) is possible, not a fresh batch */
    if (start == 0 && d->last_m == d->R)
        return spel_draft_fail(d, "the last batch filled the ring (%d slots); commit before starting a new batch", d->R);
    if (start + m > d->R) return spel_draft_fail(d, "batch of %d tokens exceeds the ring (%d slots)", start + m, d->R);
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
    if (n < 1 || n > d->last_m) return spel_draft_fail(d, "commit(%d): the last batch has %d uncommitted tokens", n, d->last_m);
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
int spel_draft_prefill_now(spel_draft *d, const int32_t *tokens, int64_t n) {
    const spel_draft_config *c = &d->cfg;
    size_t inner = (size_t)c->n_heads * c->head_dim, B = PREFILL_BATCH, ss = (size_t)(d->pos + n);
    float *X = spel_alloc64_raw(4 * B * (size_t)c->d_model), *Q = spel_alloc64_raw(4 * B * inner),
          *O = spel_alloc64_raw(4 * B * inner), *S = spel_alloc64_raw(4 * B * ss);
    int rc = X && Q && O && S ? 0 : spel_draft_fail(d, "out of memory (prefill scratch)");
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
int spel_draft_check_propose(spel_draft *d, int k, int start) {
    if (k < 1 || start < 0 || start + k + 1 > d->R)
        return spel_draft_fail(d, "propose(K=%d) at offset %d needs offset+K+1 <= ring (%d)", k, start, d->R);
    if (start > d->last_m) return spel_draft_fail(d, "propose at offset %d beyond the %d uncommitted tokens", start, d->last_m);
    return 0;
}

int spel_draft_propose_now(spel_draft *d, int32_t pending, int k, int start, int guess, int32_t *out) {
    if (spel_draft_check_propose(d, k, start)) return -1;
    if (start == 0 && d->last_m == d->R)
        return spel_draft_fail(d, "the last batch filled the ring (%d slots); commit before proposing", d->R);
    float *logits = malloc(4 * (size_t)d->cfg.vocab);
    if (!logits) return spel_draft_fail(d, "out of memory");
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
                rc = spel_draft_fail(d, "no finite draft logit at offset %d", start + j);
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
    return spel_draft_propose_now(d, pending, k, start, guess, out);
}

int spel_draft_propose_at(spel_draft *d, int32_t pending, int k, int start, int guess, int32_t *out) {
    GUARDED(d, propose_at_sync(d, pending, k, start, guess, out));
}

int spel_draft_propose(spel_draft *d, int32_t pending, int k, int32_t *out) {
    return spel_draft_propose_at(d, pending, k, 0, 0, out);
}
