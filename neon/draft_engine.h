/* The draft engine's own declarations, shared by its C files (draft.c: the engine and
 * its weights; forward.c: the forward pass, commit and proposals; ahead.c: proposals
 * and prefills on the engine's own thread; gemv.c: the GEMVs). */
#ifndef SPEL_DRAFT_ENGINE_H
#define SPEL_DRAFT_ENGINE_H

#if defined(__linux__) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE   /* SCHED_IDLE */
#endif
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

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
        int idle;     /* the request runs at SCHED_IDLE throughout (else normal once started) */
        int cancel;   /* spel_draft_cancel: stop after the forward in progress (atomic) */
        int32_t pending, *out, *tokens;
        int64_t n_tokens;
    } ahead;
};


/* every file's helpers (draft.c) */
void *spel_alloc64_raw(size_t n);
void *spel_alloc64(size_t n);    /* zeroed */
int spel_draft_fail(spel_draft *d, const char *fmt, ...);   /* sets the error text, returns -1 */

/* One caller at a time.  Every entry point claims in_use or returns SPEL_BUSY at once,
 * so two threads on one draft get a clear error instead of sharing its scratch buffers,
 * state and pool.  (The error text is left alone: the other call may be writing it.) */
static inline int enter(spel_draft *d) {
    int idle = 0;
    return atomic_compare_exchange_strong_explicit(&d->in_use, &idle, 1, memory_order_acquire,
                                                   memory_order_relaxed);
}

static inline void leave(spel_draft *d) { atomic_store_explicit(&d->in_use, 0, memory_order_release); }

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

/* forward.c: what the engine's thread runs (no guard: the caller holds it) */
int spel_draft_prefill_now(spel_draft *d, const int32_t *tokens, int64_t n);
int spel_draft_check_propose(spel_draft *d, int k, int start);
int spel_draft_propose_now(spel_draft *d, int32_t pending, int k, int start, int guess, int32_t *out);

/* ahead.c */
void spel_draft_ahead_stop(spel_draft *d);
int spel_draft_wait_ahead(spel_draft *d, int32_t *out_tokens, int64_t timeout_us);

#endif
