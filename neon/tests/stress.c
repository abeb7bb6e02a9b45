/* Hostile-use harness of the draft engine, built with the engine's sources under
 * AddressSanitizer and UBSan by tests/test_neon_sanitize.py:
 *
 *   stress [seed]   random forward / propose / async / cancel / commit / reset / sampling
 *                   sequences (valid
 *                   and invalid arguments) on odd shapes with every available kernel,
 *                   KV caches grown past several doublings, NaN / inf / huge inputs to
 *                   the quantizers and through the draft step, non-finite weights, and
 *                   two threads calling one engine at once.
 *   control cast    an (int8_t) cast of NaN      \  negative controls: the sanitizers
 *   control heap    a use after free             /  must report these
 *
 * Exit 0 when every call returned an allowed code and every check held; a sanitizer
 * report aborts the program. */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../spel_api.h"

static int failures;
#define CHECK(cond, ...)                                   \
    do {                                                   \
        if (!(cond)) {                                     \
            fprintf(stderr, "FAILED %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                  \
            fputc('\n', stderr);                           \
            failures++;                                    \
        }                                                  \
    } while (0)

typedef struct { uint64_t s; } rng;
static uint32_t rnd(rng *r) {
    r->s ^= r->s << 13;
    r->s ^= r->s >> 7;
    r->s ^= r->s << 17;
    return (uint32_t)(r->s >> 11);
}
static int rint_to(rng *r, int n) { return (int)(rnd(r) % (uint32_t)n); }
static float rfloat(rng *r) { return (float)rnd(r) / 2097152.0f - 1.0f; }   /* [-1, 1) */

typedef struct {
    int d, H, hd, ff, V, max_seq, ring, n_layers;
    int kinds[4];
} shape;

static float *random_array(rng *r, size_t n, float scale, float base) {
    float *a = malloc(4 * (n ? n : 1));
    for (size_t i = 0; i < n; i++) a[i] = base + scale * rfloat(r);
    return a;
}

/* A draft of shape s with random weights; norm_gain scales the norms (huge gains make
 * the activations overflow to inf / NaN inside the step). */
static spel_draft *make_draft(const shape *s, int kernel, int threads, float norm_gain, rng *r) {
    spel_draft_config c = {s->d, s->H, s->hd, s->ff, s->V, s->max_seq, s->n_layers, s->ring,
                           10000.0f, 1e-5f, threads, kernel, 0};
    spel_draft *d = spel_draft_new(&c, s->kinds);
    if (!d) return NULL;
    if (spel_draft_error(d)[0]) { spel_draft_free(d); return NULL; }
    size_t vd = (size_t)s->V * s->d, inner = (size_t)s->H * s->hd;
    float *emb = random_array(r, vd, 1.0f, 0.0f), *fn = random_array(r, s->d, 0.1f, norm_gain);
    float *head = random_array(r, vd, 0.2f, 0.0f);
    CHECK(spel_draft_set_shared(d, emb, fn, head) == 0, "set_shared: %s", spel_draft_error(d));
    free(emb); free(fn); free(head);
    for (int l = 0; l < s->n_layers; l++) {
        float *an = random_array(r, s->d, 0.1f, norm_gain), *fnm = random_array(r, s->d, 0.1f, norm_gain);
        float *conv = random_array(r, 3 * (size_t)s->d, 0.2f, 0.3f);
        float *wqkv = random_array(r, 3 * inner * s->d, 0.3f, 0.0f), *wo = random_array(r, inner * s->d, 0.3f, 0.0f);
        float *dec = random_array(r, s->H, 1.0f, 3.0f), *beta = random_array(r, s->H, 0.5f, 0.0f);
        float *w1 = random_array(r, (size_t)s->ff * s->d, 0.3f, 0.0f), *w3 = random_array(r, (size_t)s->ff * s->d, 0.3f, 0.0f);
        float *w2 = random_array(r, (size_t)s->d * s->ff, 0.3f, 0.0f);
        int gdn = s->kinds[l] == SPEL_LAYER_GDN;
        CHECK(spel_draft_set_layer(d, l, an, gdn ? conv : NULL, wqkv, wo, gdn ? dec : NULL, gdn ? beta : NULL, fnm,
                                   w1, w3, w2) == 0, "set_layer %d: %s", l, spel_draft_error(d));
        free(an); free(fnm); free(conv); free(wqkv); free(wo); free(dec); free(beta); free(w1); free(w3); free(w2);
    }
    CHECK(spel_draft_ready(d) == 0, "ready: %s", spel_draft_error(d));
    return d;
}

/* One random call (valid or not); returns its code. */
static int random_call(spel_draft *d, const shape *s, rng *r, int *async_out) {
    int32_t toks[8], out[9];
    float *logits = malloc(4 * (size_t)8 * s->V);
    int m = 1 + rint_to(r, s->ring), k = 1 + rint_to(r, s->ring - 1), start = rint_to(r, 3), rc;
    for (int i = 0; i < 8; i++) toks[i] = rint_to(r, 50) == 0 ? s->V : rint_to(r, s->V);   /* some out of range */
    spel_sampling smp = {rint_to(r, 4) ? 0.8 : (rint_to(r, 2) ? 0.0 : NAN), rint_to(r, 2) ? 1.0 : 0.9, 1.1,
                         rint_to(r, 3), 16, rnd(r)};
    double *q = malloc(sizeof(double) * (size_t)s->V);
    switch (rint_to(r, 15)) {
    case 0: rc = spel_draft_forward_from(d, toks, m, start, rint_to(r, 2) ? logits : NULL); break;
    case 1: rc = spel_draft_propose_at(d, toks[0], k, start, rint_to(r, 2), out); break;
    case 2: rc = spel_draft_propose_at_async(d, toks[0], k, 0, rint_to(r, 2)); if (!rc) *async_out = 1; break;
    case 3: rc = spel_draft_wait(d, out); if (rc != SPEL_BUSY) *async_out = 0; break;
    case 4: rc = spel_draft_commit(d, 1 + rint_to(r, s->ring)); break;
    case 5: rc = spel_draft_commit_keep(d, 1 + rint_to(r, s->ring)); break;
    case 6: rc = spel_draft_step(d, toks[0], logits); break;
    case 7: rc = spel_draft_propose(d, toks[0], k, out); break;
    case 9: rc = spel_draft_cancel(d); break;
    case 10: rc = spel_draft_set_sampling(d, rint_to(r, 4) ? &smp : NULL, rint_to(r, 2)); break;
    case 11: rc = spel_draft_set_context(d, toks, rint_to(r, 9), rint_to(r, 100)); break;
    case 12: rc = spel_draft_probs(d, rint_to(r, s->ring + 1) - 1, q); break;
    case 13: rc = spel_draft_prefill_async(d, toks, rint_to(r, 9), rint_to(r, 2)); if (!rc) *async_out = 1; break;
    case 14: rc = spel_draft_shadow_async(d, toks, rint_to(r, 9), toks[0], k); if (!rc) *async_out = 1; break;
    default: rc = rint_to(r, 4) == 0 ? spel_draft_reset(d) : spel_draft_step(d, toks[1], logits); break;
    }
    free(q);
    free(logits);
    return rc;
}

static void run_sequence(spel_draft *d, const shape *s, rng *r, int n_calls) {
    int async = 0;
    for (int i = 0; i < n_calls; i++) {
        int rc = random_call(d, s, r, &async);
        CHECK(rc == 0 || rc == -1 || rc == SPEL_ASYNC_PENDING || rc == SPEL_CANCELLED,
              "single-threaded call returned %d", rc);
        int64_t pos = spel_draft_pos(d);
        CHECK(pos >= 0 && pos <= s->max_seq, "pos %lld outside 0..%d", (long long)pos, s->max_seq);
        if (pos > s->max_seq - 2 * s->ring && rint_to(r, 4) == 0) spel_draft_reset(d);
    }
    if (async) spel_draft_wait(d, NULL);
}

/* --- two threads on one engine ------------------------------------------------ */
typedef struct {
    spel_draft *d;
    const shape *s;
    uint64_t seed;
    int calls, busy, bad;
} worker;

static void *worker_main(void *arg) {
    worker *w = arg;
    rng r = {w->seed};
    int async = 0;
    for (int i = 0; i < w->calls; i++) {   /* calls that got in; the refused ones are retried */
        int rc;
        while ((rc = random_call(w->d, w->s, &r, &async)) == SPEL_BUSY) {
            w->busy++;
            sched_yield();
        }
        if (rc != 0 && rc != -1 && rc != SPEL_ASYNC_PENDING && rc != SPEL_CANCELLED) w->bad++;
    }
    while (async && spel_draft_wait(w->d, NULL) == SPEL_BUSY) {
    }
    return NULL;
}

static void two_threads(const shape *s, int threads, rng *r) {
    spel_draft *d = make_draft(s, SPEL_KERNEL_AUTO, threads, 1.0f, r);
    CHECK(d != NULL, "make_draft");
    if (!d) return;
    worker w[2] = {{d, s, 0x1234567ull + rnd(r), 1500, 0, 0}, {d, s, 0x7654321ull + rnd(r), 1500, 0, 0}};
    pthread_t th[2];
    for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, worker_main, &w[i]);
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    CHECK(w[0].bad == 0 && w[1].bad == 0, "two threads: unexpected return codes");
    CHECK(w[0].busy + w[1].busy > 0, "two threads never met inside the engine");
    printf("two threads (%d pool threads): %d and %d calls refused as busy\n", threads, w[0].busy, w[1].busy);
    int32_t t = 1;
    float *logits = malloc(4 * (size_t)s->V);
    spel_draft_reset(d);
    CHECK(spel_draft_step(d, t, logits) == 0, "the engine still works after two threads: %s", spel_draft_error(d));
    free(logits);
    spel_draft_free(d);
}

/* --- non-finite values ------------------------------------------------------- */
static void quantizers_non_finite(void) {
    float w[2][8] = {{NAN, 1.0f, -2.0f, INFINITY, -INFINITY, 3e38f, -0.5f, 0.0f},
                     {NAN, NAN, NAN, NAN, NAN, NAN, NAN, NAN}};
    int8_t q[16], t[16];
    float s[2], st[2];
    spel_quantize_q8(&w[0][0], 2, 8, q, s);
    CHECK(q[0] == 0 && q[3] == 127 && q[4] == -127, "q8 of NaN/inf: %d %d %d", q[0], q[3], q[4]);
    for (int j = 0; j < 8; j++) CHECK(q[8 + j] == 0, "q8 of an all-NaN row");
    spel_quantize_ternary(&w[0][0], 2, 8, t, st);
    for (int j = 0; j < 16; j++) CHECK(t[j] >= -1 && t[j] <= 1, "ternary code %d", t[j]);
    int8_t xq[8];
    spel_quantize_activation(&w[0][0], 8, xq);
    CHECK(xq[0] == 0 && xq[3] == 127 && xq[4] == -127, "activation of NaN/inf saturates");
}

static void nonfinite_weights_refused(const shape *s, rng *r) {
    spel_draft_config c = {s->d, s->H, s->hd, s->ff, s->V, s->max_seq, s->n_layers, s->ring, 10000.0f, 1e-5f, 1,
                           SPEL_KERNEL_AUTO, 0};
    spel_draft *d = spel_draft_new(&c, s->kinds);
    size_t vd = (size_t)s->V * s->d, inner = (size_t)s->H * s->hd;
    float *emb = random_array(r, vd, 1.0f, 0.0f), *fn = random_array(r, s->d, 0.1f, 1.0f);
    float *head = random_array(r, vd, 0.2f, 0.0f);
    head[vd / 2] = NAN;
    CHECK(spel_draft_set_shared(d, emb, fn, head) == -1 && strstr(spel_draft_error(d), "lm_head.weight"),
          "NaN in lm_head refused: %s", spel_draft_error(d));
    head[vd / 2] = 0.0f;
    CHECK(spel_draft_set_shared(d, emb, fn, head) == 0, "finite shared tensors load");
    float *w = random_array(r, 3 * inner * s->d + (size_t)s->ff * s->d * 3 + 4 * (size_t)s->d + 2 * (size_t)s->H,
                            0.3f, 0.0f);
    float *w1 = w + 3 * inner * s->d;
    w1[(size_t)s->ff * s->d - 1] = INFINITY;
    int gdn = s->kinds[0] == SPEL_LAYER_GDN;
    CHECK(spel_draft_set_layer(d, 0, fn, gdn ? w : NULL, w, w, gdn ? fn : NULL, gdn ? fn : NULL, fn, w1, w1, w1) == -1 &&
          strstr(spel_draft_error(d), "draft.layers.0.mlp.w1.weight"), "inf in w1 refused: %s", spel_draft_error(d));
    free(emb); free(fn); free(head); free(w);
    spel_draft_free(d);
}

static void control(const char *what) {
    volatile float nan = NAN;
    if (!strcmp(what, "cast")) {
        volatile int8_t v = (int8_t)nan;
        printf("%d\n", v);
    } else {
        volatile char *volatile p = malloc(8);
        free((void *)p);
        p[0] = 1;
    }
}

int main(int argc, char **argv) {
    if (argc > 2 && !strcmp(argv[1], "control")) {
        control(argv[2]);
        return 0;
    }
    rng r = {argc > 1 ? strtoull(argv[1], NULL, 10) | 1 : 0x9E3779B97F4A7C15ull};
    const shape shapes[] = {
        {100, 3, 30, 70, 37, 300, 5, 3, {SPEL_LAYER_GDN, SPEL_LAYER_ATTN, SPEL_LAYER_GDN}},   /* odd widths */
        {1, 1, 2, 1, 2, 150, 2, 2, {SPEL_LAYER_ATTN, SPEL_LAYER_GDN}},                         /* the smallest */
        {130, 2, 64, 129, 128, 70, 3, 1, {SPEL_LAYER_ATTN}},                                   /* one past 64 */
    };
    quantizers_non_finite();
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const shape *s = &shapes[i];
        for (int k = 0; k < SPEL_KERNEL_COUNT; k++) {
            if (!spel_kernel_available(k)) continue;
            for (int threads = 1; threads <= 3; threads += 2) {
                spel_draft *d = make_draft(s, k, threads, 1.0f, &r);
                CHECK(d != NULL, "make_draft shape %zu kernel %d", i, k);
                if (d) { run_sequence(d, s, &r, 400); spel_draft_free(d); }
            }
        }
        spel_draft *big = make_draft(s, SPEL_KERNEL_AUTO, 2, 1e30f, &r);   /* activations overflow */
        CHECK(big != NULL, "make_draft with huge norms");
        if (big) { run_sequence(big, s, &r, 200); spel_draft_free(big); }
        nonfinite_weights_refused(s, &r);
    }
    two_threads(&shapes[0], 1, &r);
    two_threads(&shapes[0], 3, &r);
    if (failures) {
        fprintf(stderr, "%d check(s) failed\n", failures);
        return 1;
    }
    printf("stress OK\n");
    return 0;
}
