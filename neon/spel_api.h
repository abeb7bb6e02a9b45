/* Public C API of the spel draft engine (cffi reads this file as its cdef, so it
 * holds only declarations: no #include, no #if). */

typedef struct spel_pool spel_pool;
typedef struct spel_draft spel_draft;

/* kernel ids; SPEL_KERNEL_AUTO resolves to the best available one */
enum {
    SPEL_KERNEL_AUTO = -1,
    SPEL_KERNEL_SCALAR = 0,
    SPEL_KERNEL_AVX2 = 1,
    SPEL_KERNEL_DOTPROD = 2,
    SPEL_KERNEL_ADDSUB = 3,
    SPEL_KERNEL_VNNI = 4,
    SPEL_KERNEL_COUNT = 5
};

const char *spel_kernel_name(int kernel);
int spel_kernel_available(int kernel);
int spel_kernel_resolve(int kernel);          /* AUTO -> best; unavailable -> -1 */

/* --- quantizers (bit-exact twins of spel_mlx/quant.py) --- */
void spel_quantize_q8(const float *w, int64_t rows, int64_t cols, int8_t *q, float *s);
void spel_quantize_ternary(const float *w, int64_t rows, int64_t cols, int8_t *t, float *s);
int64_t spel_ternary_row_bytes(int64_t cols);
void spel_pack_ternary(const int8_t *t, int64_t rows, int64_t cols, uint8_t *packed);
float spel_quantize_activation(const float *x, int64_t n, int8_t *xq);

/* --- raw int32 dot products of every row with an int8 vector (tests, benchmarks) ---
 * packed: [rows][spel_ternary_row_bytes(cols)]; q8: [rows][cols]. Return 0, or -1 when
 * the kernel is not available on this CPU. */
int spel_dot_ternary(int kernel, const uint8_t *packed, int64_t rows, int64_t cols,
                     const int8_t *xq, int32_t *out);
int spel_dot_q8(int kernel, const int8_t *q, int64_t rows, int64_t cols,
                const int8_t *xq, int32_t *out);

/* --- persistent worker pool --- */
spel_pool *spel_pool_create(int threads);      /* threads 1..6 (caller included) */
void spel_pool_destroy(spel_pool *pool);
int spel_pool_threads(const spel_pool *pool);
/* stress/diagnostic: n dispatches of nblocks empty-ish blocks; returns the count of
 * blocks executed (must be n * nblocks) */
int64_t spel_pool_stress(spel_pool *pool, int64_t n, int64_t nblocks);

/* --- a standalone quantized matrix for benchmarks: y = W x on the pool --- */
typedef struct spel_matrix spel_matrix;
spel_matrix *spel_matrix_new(const float *w, int64_t rows, int64_t cols, int ternary);
void spel_matrix_free(spel_matrix *m);
int spel_matrix_gemv(spel_matrix *m, spel_pool *pool, int kernel, const float *x, float *y);
int spel_f32_gemv(spel_pool *pool, const float *w, int64_t rows, int64_t cols,
                  const float *x, float *y);

/* --- the draft engine ---
 * Calls return 0, or -1 with a message in spel_draft_error; SPEL_BUSY when another
 * thread is inside a call on the same draft (one caller at a time; nothing was done);
 * SPEL_ASYNC_PENDING when an asynchronous proposal is out (spel_draft_wait first).
 * Weights holding NaN or infinity are refused by set_shared / set_layer (-1, naming
 * the tensor).  The KV caches grow with the positions used, up to max_seq. */
enum { SPEL_BUSY = -2, SPEL_ASYNC_PENDING = -3 };
typedef struct {
    int d_model, n_heads, head_dim, d_ff, vocab, max_seq, n_layers, ring;
    float rope_theta, norm_eps;
    int threads, kernel, q8_head;
} spel_draft_config;

/* layer kinds */
enum { SPEL_LAYER_GDN = 0, SPEL_LAYER_ATTN = 1 };

spel_draft *spel_draft_new(const spel_draft_config *cfg, const int *layer_kinds);
const char *spel_draft_error(const spel_draft *d);
/* shared tensors: tok_emb [V,d], final_norm [d], lm_head [V,d] */
int spel_draft_set_shared(spel_draft *d, const float *tok_emb, const float *final_norm,
                          const float *lm_head);
/* one layer; conv/decay/beta are NULL for attention layers */
int spel_draft_set_layer(spel_draft *d, int layer, const float *attn_norm, const float *conv,
                         const float *wqkv, const float *wo, const float *decay_logit,
                         const float *beta_logit, const float *ffn_norm, const float *w1,
                         const float *w3, const float *w2);
int spel_draft_ready(spel_draft *d);          /* all tensors set -> 0 */
void spel_draft_free(spel_draft *d);

int spel_draft_forward(spel_draft *d, const int32_t *tokens, int m, float *logits);
/* continue the uncommitted batch at offset start (0 <= start <= its length) */
int spel_draft_forward_from(spel_draft *d, const int32_t *tokens, int m, int start, float *logits);
int spel_draft_step(spel_draft *d, int32_t token, float *logits);
int spel_draft_propose(spel_draft *d, int32_t pending, int k, int32_t *out_tokens);
/* propose continuing the uncommitted batch at offset start; guess != 0: the last
 * forward also runs the head and out_tokens[k] is the draft's next-token guess */
int spel_draft_propose_at(spel_draft *d, int32_t pending, int k, int start, int guess,
                          int32_t *out_tokens);
/* the same proposal on the draft's own thread: returns at once (0, or -1 for a bad
 * request); spel_draft_wait blocks until it is done and gives its rc and the k
 * (+1 with guess) tokens.  In between, every other call on d fails ("wait first"). */
int spel_draft_propose_at_async(spel_draft *d, int32_t pending, int k, int start, int guess);
/* feed and commit n tokens (from a committed state; the state spel_draft_forward and
 * spel_draft_commit leave over the same tokens, bit for bit) on the draft's own thread:
 * at normal priority (a prompt's prefill beside the target's), or with `background`
 * at the lowest (a catch-up while the target decodes; a wait lifts it).  The tokens
 * are copied; spel_draft_wait (out_tokens unused) gives its rc. */
int spel_draft_prefill_async(spel_draft *d, const int32_t *tokens, int64_t n, int background);
/* that catch-up over n tokens, then spel_draft_propose_at(pending, k, 0, no guess), on
 * the draft's own thread at the lowest priority: an unverified proposal made off the
 * caller's path.  spel_draft_wait gives its rc and k tokens; the batch stays uncommitted. */
int spel_draft_shadow_async(spel_draft *d, const int32_t *tokens, int64_t n, int32_t pending, int k);
int spel_draft_wait(spel_draft *d, int32_t *out_tokens);
/* spel_draft_wait for at most timeout_us microseconds: SPEL_TIMEOUT when the request is
 * still running (it stays out: wait again later) */
enum { SPEL_TIMEOUT = -8 };
int spel_draft_wait_for(spel_draft *d, int32_t *out_tokens, int64_t timeout_us);
/* stop a running asynchronous proposal after its current forward; its wait then
 * returns SPEL_CANCELLED (if it had not finished) and the batch before its offset stays */
enum { SPEL_CANCELLED = -7 };
int spel_draft_cancel(spel_draft *d);
int spel_draft_commit(spel_draft *d, int n);
/* commit n and keep the rest of the last batch uncommitted (shifted to offset 0) */
int spel_draft_commit_keep(spel_draft *d, int n);
int spel_draft_reset(spel_draft *d);
int64_t spel_draft_pos(const spel_draft *d);
int spel_draft_kernel(const spel_draft *d);
int spel_draft_threads(const spel_draft *d);
int64_t spel_draft_packed_bytes(const spel_draft *d, int which);  /* 0 q8, 1 ternary */

/* --- sampling (neon/sampling.c; the numpy reference is spel_mlx.decoding.sampling) --- */
typedef struct {
    double temperature;   /* 0: the argmax of the penalized logits */
    double top_p;         /* 1 = off */
    double penalty;       /* repetition penalty, 1 = off */
    int top_k;            /* 0 = off */
    int window;           /* how many recent tokens the penalty sees */
    uint64_t seed;        /* of the noise stream */
} spel_sampling;

/* The noise stream: 64 bits of (seed, sequence index, slot), a uniform in (0, 1) from
 * them, and the Gumbel noise -log(-log(u)) of token `token` at sequence index `index`.
 * Slots >= 0 are token ids; negative slots are per-index uniforms (the residual rule). */
uint64_t spel_noise_bits(uint64_t seed, int64_t index, int64_t slot);
double spel_noise_uniform(uint64_t seed, int64_t index, int64_t slot);
double spel_noise_gumbel(uint64_t seed, int64_t index, int32_t token);

/* The sampling distribution of one position (float64, sums to 1): repetition penalty
 * on the distinct tokens of recent[0..n_recent), temperature (> 0), top-k (0 = off),
 * top-p (1 = off).  Returns 0, -1 for a bad parameter, -2 out of memory. */
int spel_sample_probs(const float *logits, int V, const int32_t *recent, int n_recent, double penalty,
                      double temperature, int top_k, double top_p, double *out);

/* M positions at once.  Row j of logits [M][V] is the position of sequence index
 * index0 + j; its penalty sees seq[max(0, n_ctx + j - window) .. n_ctx + j) (seq: the
 * context, then the tokens of rows 0..M-2).  tokens[j] (or NULL): the coupled sample,
 * argmax over the support of logit/T + Gumbel(seed, index0 + j, token); probs [M][V] (or
 * NULL): the distributions.  Returns 0, -1 bad parameter, -2 out of memory, -3 a row
 * without a finite logit. */
int spel_sample_rows(const float *logits, int M, int V, const int32_t *seq, int n_ctx, int64_t index0,
                     const spel_sampling *s, int32_t *tokens, double *probs);

/* The draft samples its proposals (the coupled choice above) instead of taking the
 * argmax: s NULL switches back to argmax; want_q keeps each proposal's distribution
 * (spel_draft_probs).  set_context gives, once per proposal, the tokens before its
 * pending token (the penalty's window is taken from their end) and that token's
 * sequence index. */
int spel_draft_set_sampling(spel_draft *d, const spel_sampling *s, int want_q);
int spel_draft_set_context(spel_draft *d, const int32_t *ctx, int n, int64_t index);
/* the distribution the token at batch offset `offset` was sampled from ([V]) */
int spel_draft_probs(spel_draft *d, int offset, double *out);
