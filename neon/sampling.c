/* Sampling in C: the per-position noise stream, the transforms of one position, and
 * the sampled choice of the draft (spel_sampler) and of the target's rows.
 *
 * Transforms: the same steps and the same float64 arithmetic as
 * spel_mlx.decoding.sampling.probabilities_reference (numpy): repetition penalty on each
 * distinct recent token, temperature, top-k (ties at the boundary kept), softmax, top-p
 * (the smallest prefix by descending p, ties by index, whose mass reaches
 * top_p - 1e-12), renormalized.  Results agree with numpy to ~1e-15 (summation order)
 * and give the same nucleus (tests/test_sampling.py).
 *
 * Coupled sampling (docs/decoding.md): the token at sequence index i is
 * argmax over the support of (s_t + g(seed, i, t)), s the penalized logits over the
 * temperature and g Gumbel noise from a counter-based stream, so it is an exact sample
 * of the position's distribution.  Draft and target call the same noise function, so
 * where their distributions agree they pick the same token. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "spel_internal.h"

/* The softmax loops get AVX-512 and AVX2 clones on x86-64 glibc (chosen at load).  With
 * -ffp-contract=off every clone does the same IEEE operations per element and the sums
 * run in a fixed blocked order, so the results are identical; only the width differs. */
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__GNUC__) && !defined(__clang__) && !defined(SPEL_NO_CLONES)
#define SAMPLING_FLOAT_FN __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define SAMPLING_FLOAT_FN
#endif

/* ------------------------------------------------------------ noise stream */
static inline uint64_t mix64(uint64_t z) {   /* the splitmix64 finalizer: a bijection */
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* 64 random bits of (seed, index, slot): each word absorbed through the mixer.  Slots
 * >= 0 are token ids (Gumbel noise); negative slots are per-index uniforms. */
uint64_t spel_noise_bits(uint64_t seed, int64_t index, int64_t slot) {
    uint64_t h = mix64(seed ^ 0x9E3779B97F4A7C15ull);
    h = mix64(h ^ ((uint64_t)index * 0xD1B54A32D192ED03ull + 0x8CB92BA72F3D8DD7ull));
    return mix64(h ^ ((uint64_t)slot * 0xAEF17502108EF2D9ull + 0x3C6EF372FE94F82Bull));
}

double spel_noise_uniform(uint64_t seed, int64_t index, int64_t slot) {
    return ((double)(spel_noise_bits(seed, index, slot) >> 11) + 0.5) * 0x1p-53;   /* in (0, 1) */
}

double spel_noise_gumbel(uint64_t seed, int64_t index, int32_t token) {
    return -log(-log(spel_noise_uniform(seed, index, token)));
}

/* ------------------------------------------------------------- transforms */
typedef struct {
    double p;
    int i;
} cand;

/* descending p, ties by ascending index (numpy's stable argsort of -p) */
static int by_p_desc(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->p > y->p) return -1;
    if (x->p < y->p) return 1;
    return (x->i > y->i) - (x->i < y->i);
}

/* the k-th largest of v[0..n) (1 <= k <= n): quickselect on a copy, O(n) on average */
static double kth_largest(const double *v, int n, int k, double *tmp) {
    memcpy(tmp, v, sizeof(double) * (size_t)n);
    int lo = 0, hi = n - 1, want = n - k;             /* index in ascending order */
    while (lo < hi) {
        const double pivot = tmp[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (tmp[i] < pivot) i++;
            while (tmp[j] > pivot) j--;
            if (i <= j) {
                const double t = tmp[i];
                tmp[i] = tmp[j];
                tmp[j] = t;
                i++;
                j--;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else break;                                   /* between j and i: equal to pivot */
    }
    return tmp[want];
}

/* exp(x) for x <= 0 without a libm call, so the loop vectorizes: x = k ln2 + r,
 * |r| <= ln2/2 (ln2 split in two, the high part exact for |k| < 2^11), a degree-13
 * Taylor polynomial (truncation < 1e-17), times 2^k from the exponent bits.  Within
 * ~2 ulp of libm.  Arguments below -708 (subnormal results, -inf, NaN) are left to
 * libm by the caller. */
static inline double exp_nonpositive(double x) {
    const double shifter = 0x1.8p52, log2e = 0x1.71547652b82fep0;
    const double ln2_hi = 0x1.62e42fee00000p-1, ln2_lo = 0x1.a39ef35793c76p-33;
    const double t = x * log2e + shifter;
    const double k = t - shifter;
    const double r = (x - k * ln2_hi) - k * ln2_lo;
    double y = 1.0 / 6227020800.0;                    /* 1/13! */
    y = y * r + 1.0 / 479001600.0;
    y = y * r + 1.0 / 39916800.0;
    y = y * r + 1.0 / 3628800.0;
    y = y * r + 1.0 / 362880.0;
    y = y * r + 1.0 / 40320.0;
    y = y * r + 1.0 / 5040.0;
    y = y * r + 1.0 / 720.0;
    y = y * r + 1.0 / 120.0;
    y = y * r + 1.0 / 24.0;
    y = y * r + 1.0 / 6.0;
    y = y * r + 0.5;
    y = y * r + 1.0;
    y = y * r + 1.0;
    uint64_t tb, sb;
    memcpy(&tb, &t, sizeof tb);
    const uint64_t shb = 0x4338000000000000ull;          /* the bits of the shifter */
    sb = (tb - shb + 1023ull) << 52;                     /* 2^k, k >= -1022 here */
    double scale;
    memcpy(&scale, &sb, sizeof scale);
    return y * scale;
}

#define LANES 8
/* the sum of v[0..n) in a fixed blocked order (8 lanes, then a fixed tree) */
SAMPLING_FLOAT_FN static double blocked_sum(const double *v, int n) {
    double acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += v[i + l];
    for (int l = 0; i < n; i++, l++) acc[l] += v[i];
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

/* the largest of v[0..n) (NaN ignored; -inf when there is none) */
SAMPLING_FLOAT_FN static double max_of(const double *v, int n) {
    double acc[LANES];
    for (int l = 0; l < LANES; l++) acc[l] = -INFINITY;
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = v[i + l] > acc[l] ? v[i + l] : acc[l];
    for (int l = 0; i < n; i++, l++) acc[l] = v[i] > acc[l] ? v[i] : acc[l];
    double m = acc[0];
    for (int l = 1; l < LANES; l++) m = acc[l] > m ? acc[l] : m;
    return m;
}

/* p[i] = exp(z[i] - top); returns their sum */
SAMPLING_FLOAT_FN static double exp_shifted(const double *z, int V, double top, double *p) {
    for (int i = 0; i < V; i++) {
        const double x = z[i] - top;
        p[i] = exp_nonpositive(x >= -708.0 ? x : -708.0);
    }
    for (int i = 0; i < V; i++)
        if (!(z[i] - top >= -708.0)) p[i] = exp(z[i] - top);   /* tiny, zero or NaN */
    return blocked_sum(p, V);
}

SAMPLING_FLOAT_FN static void scale(double *v, int V, double by) {
    for (int i = 0; i < V; i++) v[i] = v[i] * by;
}

/* Scratch of one position's transform, allocated once per call or per sampler. */
#define NBUCKETS 512   /* 8 per octave of p: 64 octaves, the rest in the last bucket */
typedef struct {
    int V;
    double *s, *p, *tmp;       /* [V]: scores, probabilities, scratch */
    int32_t *sup;              /* [V]: the support's token ids */
    uint16_t *key;             /* [V]: the bucket of each p */
    cand *c;                   /* [V]: the boundary bucket, sorted */
    unsigned char *seen;       /* [V]: distinct recent tokens */
    double mass[NBUCKETS];
    int count[NBUCKETS];
} row_work;

static int work_init(row_work *w, int V) {
    memset(w, 0, sizeof *w);
    w->V = V;
    w->s = malloc(sizeof(double) * (size_t)V);
    w->p = malloc(sizeof(double) * (size_t)V);
    w->tmp = malloc(sizeof(double) * (size_t)V);
    w->sup = malloc(sizeof(int32_t) * (size_t)V);
    w->key = malloc(sizeof(uint16_t) * (size_t)V);
    w->c = malloc(sizeof(cand) * (size_t)V);
    w->seen = calloc((size_t)V, 1);
    return w->s && w->p && w->tmp && w->sup && w->key && w->c && w->seen ? 0 : -1;
}

static void work_free(row_work *w) {
    free(w->s);
    free(w->p);
    free(w->tmp);
    free(w->sup);
    free(w->key);
    free(w->c);
    free(w->seen);
}

static int params_ok(const spel_sampling *s) {
    return s->temperature >= 0.0 && s->penalty > 0.0 && s->top_k >= 0 && s->top_p > 0.0 && s->top_p <= 1.0 &&
           s->window >= 0;
}

/* the bucket of p > 0: its float64 bits (exponent, 3 mantissa bits) are monotone in p */
static inline int bucket_of(double p) {
    uint64_t bits;
    memcpy(&bits, &p, sizeof bits);
    const int top = (int)(0x3FF0000000000000ull >> 49);   /* p = 1 */
    const int b = top - (int)((bits >> 49) & 0x3FFF);
    return b < 0 ? NBUCKETS - 1 : b < NBUCKETS - 1 ? b : NBUCKETS - 1;   /* < 0: NaN or p > 1 */
}

/* The nucleus (top-p support) from the unnormalized e = exp(s - max) and their sum:
 * the smallest prefix by descending p (ties by id) whose mass reaches `need`, into
 * w->sup; returns its size.  A nucleus token has p > (1 - need) / V (the tokens left
 * out hold more than 1 - need, and none is larger), so only tokens above half that are
 * candidates; they are bucketed by p (8 buckets an octave) and only the bucket where
 * the mass reaches `need` is sorted: no per-row sort of the vocabulary. */
static int nucleus(row_work *w, const double *e, double sum, double need) {
    const int V = w->V;
    const double inv = 1.0 / sum, thr = 0.5 * (1.0 - need) / V * sum;
    int m = 0;
    for (int i = 0; i < V; i++) {   /* branch-free compaction of the candidates */
        w->sup[m] = i;
        m += e[i] > thr;
    }
    memset(w->mass, 0, sizeof w->mass);
    memset(w->count, 0, sizeof w->count);
    for (int j = 0; j < m; j++) {
        const double p = e[w->sup[j]] * inv;
        const int b = bucket_of(p);
        w->key[j] = (uint16_t)b;
        w->mass[b] += p;
        w->count[b]++;
    }
    double cum = 0.0;
    int bb = 0;
    while (bb < NBUCKETS - 1 && !(w->count[bb] && cum + w->mass[bb] >= need)) cum += w->mass[bb++];
    int n = 0, nc = 0;
    for (int j = 0; j < m; j++) {   /* in place: n <= j */
        const int i = w->sup[j];
        if (w->key[j] < bb) w->sup[n++] = i;
        else if (w->key[j] == bb) w->c[nc++] = (cand){e[i] * inv, i};
    }
    qsort(w->c, (size_t)nc, sizeof(cand), by_p_desc);
    for (int j = 0; j < nc; j++) {   /* the prefix of the boundary bucket, at least one token */
        w->sup[n++] = w->c[j].i;
        cum += w->c[j].p;
        if (cum >= need) break;
    }
    return n;
}

/* One position: scores w->s (penalized logits / temperature, -inf outside top-k) and
 * the support w->sup (returns its size); with `probs`, also the distribution there.
 * Temperature 0: the support is the argmax of the penalized logits. */
static int transform(row_work *w, const float *logits, const int32_t *recent, int n_recent,
                     const spel_sampling *s, double *probs) {
    const int V = w->V;
    double *z = w->s;
    for (int i = 0; i < V; i++) z[i] = (double)logits[i];
    if (s->penalty != 1.0) {
        for (int j = 0; j < n_recent; j++) {           /* each distinct token once */
            const int t = recent[j];
            if (t < 0 || t >= V || w->seen[t]) continue;
            w->seen[t] = 1;
            z[t] = z[t] > 0 ? z[t] / s->penalty : z[t] * s->penalty;
        }
        for (int j = 0; j < n_recent; j++)
            if (recent[j] >= 0 && recent[j] < V) w->seen[recent[j]] = 0;
    }
    if (s->temperature == 0.0) {
        int best = 0;
        for (int i = 1; i < V; i++)
            if (z[i] > z[best]) best = i;
        w->sup[0] = best;
        if (probs) {
            memset(probs, 0, sizeof(double) * (size_t)V);
            probs[best] = 1.0;
        }
        return 1;
    }
    scale(z, V, 1.0 / s->temperature);
    if (s->top_k > 0 && s->top_k < V) {
        const double kth = kth_largest(z, V, s->top_k, w->tmp);
        for (int i = 0; i < V; i++)
            if (!(z[i] >= kth)) z[i] = -INFINITY;
    }
    double *e = w->p;
    const double sum = exp_shifted(z, V, max_of(z, V), e);
    int n = 0;
    if (s->top_p < 1.0) {
        n = nucleus(w, e, sum, s->top_p - 1e-12);
    } else {
        for (int i = 0; i < V; i++) {
            w->sup[n] = i;
            n += e[i] > 0.0;
        }
    }
    if (probs) {
        if (s->top_p < 1.0) {   /* renormalized over the nucleus */
            memset(probs, 0, sizeof(double) * (size_t)V);
            for (int j = 0; j < n; j++) probs[w->sup[j]] = e[w->sup[j]];
            scale(probs, V, 1.0 / blocked_sum(probs, V));
        } else {
            memcpy(probs, e, sizeof(double) * (size_t)V);
            scale(probs, V, 1.0 / sum);
        }
    }
    return n;
}

/* The coupled choice at sequence index `index`: argmax over the support of s + g
 * (ties to the lower id).  Noise is drawn for the support only. */
static int32_t coupled_choice(const row_work *w, int n, uint64_t seed, int64_t index, int greedy) {
    if (n < 1) return -1;   /* no finite logit */
    if (greedy || n == 1) return w->sup[0];
    int32_t best = -1;
    double bv = -INFINITY;
    for (int j = 0; j < n; j++) {
        const int32_t t = w->sup[j];
        const double v = w->s[t] + spel_noise_gumbel(seed, index, t);
        if (v > bv || (v == bv && t < best) || best < 0) {
            bv = v;
            best = t;
        }
    }
    return best;
}

/* The scratch of the row calls, kept per thread: allocating ~60 KB per call cost more
 * than the transform (fresh pages each time). */
static _Thread_local row_work row_scratch;

static row_work *scratch(int V) {
    if (row_scratch.V == V && row_scratch.s) return &row_scratch;
    work_free(&row_scratch);
    if (work_init(&row_scratch, V)) {
        work_free(&row_scratch);
        memset(&row_scratch, 0, sizeof row_scratch);
        return NULL;
    }
    return &row_scratch;
}

int spel_sample_probs(const float *logits, int V, const int32_t *recent, int n_recent, double penalty,
                      double temperature, int top_k, double top_p, double *out) {
    const spel_sampling s = {temperature, top_p, penalty, top_k, n_recent, 0};
    if (V < 1 || !(temperature > 0.0) || !params_ok(&s)) return -1;
    row_work *w = scratch(V);
    if (!w) return -2;
    transform(w, logits, recent, n_recent, &s, out);
    return 0;
}

/* the recent window of row j: seq[max(0, n_ctx + j - window) .. n_ctx + j) */
static const int32_t *row_window(const int32_t *seq, int n_ctx, int j, int window, int *n) {
    const int end = n_ctx + j, start = end - window > 0 ? end - window : 0;
    *n = end - start;
    return seq + start;
}

int spel_sample_rows(const float *logits, int M, int V, const int32_t *seq, int n_ctx, int64_t index0,
                     const spel_sampling *s, int32_t *tokens, double *probs) {
    if (V < 1 || M < 1 || n_ctx < 0 || !params_ok(s)) return -1;
    row_work *w = scratch(V);
    if (!w) return -2;
    const int window = s->penalty != 1.0 ? s->window : 0;
    for (int j = 0; j < M; j++) {
        int nr;
        const int32_t *rec = row_window(seq, n_ctx, j, window, &nr);
        const int n = transform(w, logits + (size_t)j * V, rec, nr, s, probs ? probs + (size_t)j * V : NULL);
        const int32_t t = coupled_choice(w, n, s->seed, index0 + j, s->temperature == 0.0);
        if (t < 0) return -3;
        if (tokens) tokens[j] = t;
    }
    return 0;
}

/* ------------------------------------------------------ the draft's sampler */
struct spel_sampler {
    spel_sampling s;
    int on, want_q, V, R;
    int32_t *ctx, *win;         /* the context before the proposal's pending token; a window */
    int n_ctx;
    int64_t index;              /* sequence index of that pending token */
    double *q;                  /* [R][V]: the distribution at each batch offset (want_q) */
    row_work w;
};

spel_sampler *spel_sampler_new(int V, int R) {
    spel_sampler *sm = calloc(1, sizeof *sm);
    if (!sm) return NULL;
    sm->V = V;
    sm->R = R;
    if (work_init(&sm->w, V)) {
        spel_sampler_free(sm);
        return NULL;
    }
    return sm;
}

void spel_sampler_free(spel_sampler *sm) {
    if (!sm) return;
    work_free(&sm->w);
    free(sm->ctx);
    free(sm->win);
    free(sm->q);
    free(sm);
}

int spel_sampler_configure(spel_sampler *sm, const spel_sampling *s, int want_q) {
    if (!s) {
        sm->on = 0;
        return 0;
    }
    if (!params_ok(s)) return -1;
    const int window = s->penalty != 1.0 ? s->window : 0;
    int32_t *ctx = realloc(sm->ctx, sizeof(int32_t) * ((size_t)window + 1));
    if (ctx) sm->ctx = ctx;
    int32_t *win = realloc(sm->win, sizeof(int32_t) * ((size_t)window + (size_t)sm->R + 1));
    if (win) sm->win = win;
    if (!ctx || !win) return -2;
    if (want_q && !sm->q && !(sm->q = malloc(sizeof(double) * (size_t)sm->R * (size_t)sm->V))) return -2;
    sm->s = *s;
    sm->s.window = window;
    sm->want_q = want_q;
    sm->n_ctx = 0;
    sm->on = 1;
    return 0;
}

int spel_sampler_on(const spel_sampler *sm) { return sm && sm->on; }

void spel_sampler_context(spel_sampler *sm, const int32_t *ctx, int n, int64_t index) {
    const int keep = n < sm->s.window ? n : sm->s.window;
    if (keep > 0) memcpy(sm->ctx, ctx + (n - keep), sizeof(int32_t) * (size_t)keep);
    sm->n_ctx = keep > 0 ? keep : 0;
    sm->index = index;
}

/* prediction j of a proposal from `pending` (out[0..j) chosen so far), at batch offset
 * `offset`: the context is ctx + [pending] + out[0..j), the sequence index index + 1 + j */
int32_t spel_sampler_pick(spel_sampler *sm, const float *logits, int32_t pending, const int32_t *out, int j,
                          int offset) {
    int nr = 0;
    const int W = sm->s.window;
    if (W > 0) {   /* the last W tokens of ctx + [pending] + out[0..j) */
        memcpy(sm->win, sm->ctx, sizeof(int32_t) * (size_t)sm->n_ctx);
        nr = sm->n_ctx;
        sm->win[nr++] = pending;
        memcpy(sm->win + nr, out, sizeof(int32_t) * (size_t)j);
        nr += j;
    }
    const int32_t *rec = nr > W ? sm->win + (nr - W) : sm->win;
    if (nr > W) nr = W;
    double *q = sm->want_q && offset >= 0 && offset < sm->R ? sm->q + (size_t)offset * sm->V : NULL;
    const int n = transform(&sm->w, logits, rec, nr, &sm->s, q);
    return coupled_choice(&sm->w, n, sm->s.seed, sm->index + 1 + j, sm->s.temperature == 0.0);
}

const double *spel_sampler_q(const spel_sampler *sm, int offset) {
    if (!sm || !sm->want_q || !sm->q || offset < 0 || offset >= sm->R) return NULL;
    return sm->q + (size_t)offset * sm->V;
}
