// Primitives of the batched training forward and its backward (spel_mlx/model/
// training_ops.py): the spots where MLX's CPU graph spends its time on scalar exp and
// many small nodes.  The gated delta rule's recurrence with its backward (states
// recomputed per chunk from checkpoints), the SwiGLU gate's backward, and row-wise
// softmax, log-sum-exp and the cross-entropy gradient.  Training needs no bit-identity
// with decoding: each body has one portable form, compiled twice (AVX2 with FMA, and
// the baseline), with contracted multiply-adds (CMakeLists.txt);
// tests check both against MLX's autodiff of the plain formulas.  Items (rows, or
// (sequence, head) pairs) are shared with the helper thread on a second core.
#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"
#include "ops.h"

namespace spel {
namespace {

#define SPEL_INLINE inline __attribute__((always_inline))

// e^x for x <= 0 (softmax and sigmoid arguments are shifted there): 2^n e^r with
// r in [-ln2/2, ln2/2] and a degree-7 Taylor polynomial (relative error < 2e-7)
SPEL_INLINE float exp_nonpos(float x) {
  const float LOG2E = 1.44269504088896341f, LN2_HI = 0.693145751953125f, LN2_LO = 1.42860682030941723e-6f;
  x = x < -87.0f ? -87.0f : x;
  const float n = std::nearbyint(x * LOG2E);
  const float r = (x - n * LN2_HI) - n * LN2_LO;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// 1 / (1 + e^-x) without overflow: e^-|x| is in (0, 1]
SPEL_INLINE float sigmoid(float x) {
  const float e = exp_nonpos(x < 0.0f ? x : -x);
  return x < 0.0f ? e / (1.0f + e) : 1.0f / (1.0f + e);
}

// --- row-wise bodies: softmax, log-sum-exp, the cross-entropy gradient, the gate ------
SPEL_INLINE void softmax_row(const float* x, float* y, int64_t C, int64_t visible) {
  float m = x[0];
  for (int64_t c = 1; c < visible; c++) m = x[c] > m ? x[c] : m;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t c = 0;
  for (; c + 8 <= visible; c += 8)
    for (int l = 0; l < 8; l++) acc[l] += (y[c + l] = exp_nonpos(x[c + l] - m));
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; c < visible; c++) s += (y[c] = exp_nonpos(x[c] - m));
  const float inv = 1.0f / s;
  for (c = 0; c < visible; c++) y[c] *= inv;
  for (; c < C; c++) y[c] = 0.0f;
}

SPEL_INLINE float logsumexp_row(const float* x, int64_t C) {
  float m = x[0];
  for (int64_t c = 1; c < C; c++) m = x[c] > m ? x[c] : m;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t c = 0;
  for (; c + 8 <= C; c += 8)
    for (int l = 0; l < 8; l++) acc[l] += exp_nonpos(x[c + l] - m);
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; c < C; c++) s += exp_nonpos(x[c] - m);
  return m + std::log(s);
}

// d/dx of cot * (lse(x) - x[y]): cot * (softmax(x) - onehot(y))
SPEL_INLINE void xent_grad_row(const float* x, float lse, int32_t y, float cot, float* dx, int64_t C) {
  for (int64_t c = 0; c < C; c++) dx[c] = cot * exp_nonpos(x[c] - lse);
  if (y >= 0 && y < C) dx[y] -= cot;
}

// y = silu(a) b: da = dy b s (1 + a (1 - s)), db = dy a s, s = sigmoid(a)
SPEL_INLINE void silu_mul_grad_run(const float* a, const float* b, const float* dy, float* da, float* db,
                                   int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    const float s = sigmoid(a[i]);
    da[i] = dy[i] * b[i] * (s * (1.0f + a[i] * (1.0f - s)));
    db[i] = dy[i] * (a[i] * s);
  }
}

// --- the gated delta rule, per (sequence, head) ---------------------------------------
// S [hd, hd] (rows index v, columns k):  S_t = a S_{t-1} + beta (v_t - S_{t-1} k_t) k_t^T,
// o_t = S_t q_t / sqrt(hd).  Token t of a head: p + (t * H) * hd (token-major [T, H, hd]).
struct DeltaItem {
  const float *q, *k, *v;
  int64_t T, H, hd, chunk;
  float a, beta;
  const float* tok(const float* p, int64_t t) const { return p + t * H * hd; }
};

// S' = a S + beta e k^T with e = v - S k (written to e)
SPEL_INLINE void delta_step(const float* S, float* S1, const float* k, const float* v, float* e, int64_t hd,
                            float a, float beta) {
  for (int64_t i = 0; i < hd; i++) e[i] = v[i] - dot(S + i * hd, k, hd);
  for (int64_t i = 0; i < hd; i++) {
    const float be = beta * e[i];
    const float* s = S + i * hd;
    float* s1 = S1 + i * hd;
    for (int64_t j = 0; j < hd; j++) s1[j] = a * s[j] + be * k[j];
  }
}

// o (stride H*hd per token) and the state before each chunk (ck [NC, hd, hd])
SPEL_INLINE void delta_forward_item(const DeltaItem& it, float* o, float* ck) {
  const int64_t hd = it.hd, hh = hd * hd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  std::vector<float> S(hh, 0.0f), e(hd);
  for (int64_t t = 0; t < it.T; t++) {
    if (t % it.chunk == 0) std::memcpy(ck + (t / it.chunk) * hh, S.data(), hh * sizeof(float));
    delta_step(S.data(), S.data(), it.tok(it.k, t), it.tok(it.v, t), e.data(), hd, it.a, it.beta);
    const float* q = it.tok(it.q, t);
    float* ot = o + t * it.H * hd;
    for (int64_t i = 0; i < hd; i++) ot[i] = dot(S.data() + i * hd, q, hd) * scale;
  }
}

// The backward, chunk by chunk from the end: the chunk's states are recomputed from its
// checkpoint, then G = dL/dS_t runs back through the tokens.  da, dbeta: this item's sums.
SPEL_INLINE void delta_backward_item(const DeltaItem& it, const float* ck, const float* dO, float* dq, float* dk,
                                     float* dv, float* da, float* dbeta) {
  const int64_t hd = it.hd, hh = hd * hd, C = it.chunk, TH = it.H * hd;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd)), a = it.a, beta = it.beta;
  std::vector<float> G(hh, 0.0f), states((C + 1) * hh), E(C * hd), g(hd), gk(hd), acc(hd);
  float sum_a = 0.0f, sum_b = 0.0f;
  for (int64_t c = (it.T + C - 1) / C - 1; c >= 0; c--) {
    const int64_t t0 = c * C, t1 = t0 + C < it.T ? t0 + C : it.T;
    std::memcpy(states.data(), ck + c * hh, hh * sizeof(float));
    for (int64_t t = t0; t < t1; t++)
      delta_step(states.data() + (t - t0) * hh, states.data() + (t - t0 + 1) * hh, it.tok(it.k, t),
                 it.tok(it.v, t), E.data() + (t - t0) * hd, hd, a, beta);
    for (int64_t t = t1 - 1; t >= t0; t--) {
      const float *Sp = states.data() + (t - t0) * hh, *Sc = Sp + hh, *e = E.data() + (t - t0) * hd;
      const float *q = it.tok(it.q, t), *k = it.tok(it.k, t);
      const float* dOt = dO + t * TH;
      float *dqt = dq + t * TH, *dkt = dk + t * TH, *dvt = dv + t * TH;
      for (int64_t i = 0; i < hd; i++) g[i] = dOt[i] * scale;
      // dq = S_t^T g;  G += g q^T
      for (int64_t j = 0; j < hd; j++) dqt[j] = 0.0f;
      for (int64_t i = 0; i < hd; i++) {
        const float gi = g[i];
        const float* s = Sc + i * hd;
        float* Gi = G.data() + i * hd;
        for (int64_t j = 0; j < hd; j++) {
          dqt[j] += gi * s[j];
          Gi[j] += gi * q[j];
        }
      }
      for (int64_t i = 0; i < hd; i++) gk[i] = dot(G.data() + i * hd, k, hd);
      // dv = beta G k;  dbeta += e . G k;  da += <G, S_{t-1}>
      for (int64_t i = 0; i < hd; i++) dvt[i] = beta * gk[i];
      sum_b += dot(e, gk.data(), hd);
      sum_a += dot(G.data(), Sp, hh);
      // dk = beta (G^T e - S_{t-1}^T G k)
      for (int64_t j = 0; j < hd; j++) acc[j] = 0.0f;
      for (int64_t i = 0; i < hd; i++) {
        const float ei = e[i], gki = gk[i];
        const float *Gi = G.data() + i * hd, *s = Sp + i * hd;
        for (int64_t j = 0; j < hd; j++) acc[j] += ei * Gi[j] - gki * s[j];
      }
      for (int64_t j = 0; j < hd; j++) dkt[j] = beta * acc[j];
      // dL/dS_{t-1} = a G - beta (G k) k^T
      for (int64_t i = 0; i < hd; i++) {
        const float bg = beta * gk[i];
        float* Gi = G.data() + i * hd;
        for (int64_t j = 0; j < hd; j++) Gi[j] = a * Gi[j] - bg * k[j];
      }
    }
  }
  *da = sum_a;
  *dbeta = sum_b;
}

// Each body twice: for AVX2 with FMA (the same source, vectorized 8 wide; this file
// is built with -ffp-contract=fast) and the baseline.
#define SPEL_TWICE(name, params, args)                                        \
  void name##_base params { name args; }                                      \
  __attribute__((target("avx2,fma"))) void name##_avx2 params { name args; } \
  void name##_any params {                                                   \
    if (use_avx2()) name##_avx2 args; else name##_base args;                 \
  }
#if !SPEL_AVX2
#undef SPEL_TWICE
#define SPEL_TWICE(name, params, args) \
  void name##_any params { name args; }
#endif

SPEL_TWICE(softmax_row, (const float* x, float* y, int64_t C, int64_t visible), (x, y, C, visible))
SPEL_TWICE(xent_grad_row, (const float* x, float lse, int32_t y, float cot, float* dx, int64_t C),
           (x, lse, y, cot, dx, C))
SPEL_TWICE(silu_mul_grad_run, (const float* a, const float* b, const float* dy, float* da, float* db, int64_t n),
           (a, b, dy, da, db, n))
SPEL_TWICE(delta_forward_item, (const DeltaItem& it, float* o, float* ck), (it, o, ck))
SPEL_TWICE(delta_backward_item,
           (const DeltaItem& it, const float* ck, const float* dO, float* dq, float* dk, float* dv, float* da,
            float* dbeta),
           (it, ck, dO, dq, dk, dv, da, dbeta))

float logsumexp_row_base(const float* x, int64_t C) { return logsumexp_row(x, C); }
#if SPEL_AVX2
__attribute__((target("avx2,fma"))) float logsumexp_row_avx2(const float* x, int64_t C) {
  return logsumexp_row(x, C);
}
#endif
float logsumexp_row_any(const float* x, int64_t C) {
#if SPEL_AVX2
  if (use_avx2()) return logsumexp_row_avx2(x, C);
#endif
  return logsumexp_row_base(x, C);
}

// rows [0, R) in blocks of about 64 KB of work, shared with the helper thread
void for_rows(int64_t R, int64_t row_cost, const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t per = row_cost >= 16384 ? 1 : 16384 / (row_cost > 0 ? row_cost : 1);
  const int64_t n = (R + per - 1) / per;
  share_items(n, [&](int64_t i) { fn(i * per, (i + 1) * per < R ? (i + 1) * per : R); });
}

class TrainOp : public CpuPrimitive {
 public:
  TrainOp(const char* name, ProfKind prof, Task body) : CpuPrimitive(cpu_stream(), prof), name_(name),
                                                         body_(std::move(body)) {}
  const char* name() const override { return name_; }

 protected:
  Task task() const override { return body_; }

 private:
  const char* name_;
  Task body_;
};

void check_contiguous(const mx::array& a, const char* op, const char* what) {
  if (a.dtype() != mx::float32) throw std::invalid_argument(std::string(op) + ": " + what + " must be float32");
  if (!a.flags().row_contiguous)
    throw std::invalid_argument(std::string(op) + ": " + what + " must be row-contiguous");
}

mx::array node(const mx::Shape& shape, mx::Dtype dt, const char* name, ProfKind prof, Task body,
               std::vector<mx::array> in) {
  return mx::array(shape, dt, std::make_shared<TrainOp>(name, prof, std::move(body)), std::move(in));
}

void check_delta(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& a,
                 const mx::array& beta, int chunk, const char* op) {
  for (auto [x, what] : {std::pair{&q, "q"}, std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    check_contiguous(*x, op, what);
    if (x->ndim() != 4 || x->shape() != q.shape())
      throw std::invalid_argument(std::string(op) + ": q, k, v must be [N, T, H, hd] of one shape");
  }
  check_f32(a, op, "a", 1);
  check_f32(beta, op, "beta", 1);
  if (a.shape(0) != q.shape(2) || beta.shape(0) != q.shape(2))
    throw std::invalid_argument(std::string(op) + ": a and beta must be [H]");
  if (chunk < 1) throw std::invalid_argument(std::string(op) + ": chunk must be >= 1");
}

}  // namespace

std::vector<mx::array> delta_train(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& a,
                                   const mx::array& beta, int chunk) {
  check_delta(q, k, v, a, beta, chunk, "delta_train");
  const int N = q.shape(0), T = q.shape(1), H = q.shape(2), hd = q.shape(3), NC = (T + chunk - 1) / chunk;
  auto body = [chunk](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
    const int64_t N = in[0].shape(0), T = in[0].shape(1), H = in[0].shape(2), hd = in[0].shape(3);
    const int64_t NC = (T + chunk - 1) / chunk;
    std::vector<float> av, bv;
    const float *A = contiguous_1d(in[3], av), *B = contiguous_1d(in[4], bv);
    const float *Q = in[0].data<float>(), *K = in[1].data<float>(), *V = in[2].data<float>();
    float *O = out[0].data<float>(), *CK = out[1].data<float>();
    share_items(N * H, [&](int64_t i) {
      const int64_t n = i / H, h = i % H, off = (n * T * H + h) * hd;
      DeltaItem it{Q + off, K + off, V + off, T, H, hd, chunk, A[h], B[h]};
      delta_forward_item_any(it, O + off, CK + i * NC * hd * hd);
    });
  };
  auto prim = std::make_shared<TrainOp>("SpelDeltaTrain", P_DELTA, body);
  return mx::array::make_arrays({q.shape(), {N, H, NC, hd, hd}}, {mx::float32, mx::float32}, prim,
                                {q, k, v, a, beta});
}

std::vector<mx::array> delta_train_grad(const mx::array& q, const mx::array& k, const mx::array& v,
                                        const mx::array& a, const mx::array& beta, const mx::array& ck,
                                        const mx::array& dO, int chunk) {
  check_delta(q, k, v, a, beta, chunk, "delta_train_grad");
  check_contiguous(ck, "delta_train_grad", "checkpoints");
  check_contiguous(dO, "delta_train_grad", "dO");
  const int N = q.shape(0), T = q.shape(1), H = q.shape(2), hd = q.shape(3), NC = (T + chunk - 1) / chunk;
  if (dO.shape() != q.shape()) throw std::invalid_argument("delta_train_grad: dO must have q's shape");
  if (ck.shape() != mx::Shape{N, H, NC, hd, hd})
    throw std::invalid_argument("delta_train_grad: checkpoints must be [N, H, ceil(T/chunk), hd, hd]");
  auto body = [chunk](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
    const int64_t N = in[0].shape(0), T = in[0].shape(1), H = in[0].shape(2), hd = in[0].shape(3);
    const int64_t NC = (T + chunk - 1) / chunk;
    std::vector<float> av, bv;
    const float *A = contiguous_1d(in[3], av), *B = contiguous_1d(in[4], bv);
    const float *Q = in[0].data<float>(), *K = in[1].data<float>(), *V = in[2].data<float>();
    const float *CK = in[5].data<float>(), *DO = in[6].data<float>();
    float *DQ = out[0].data<float>(), *DK = out[1].data<float>(), *DV = out[2].data<float>();
    float *DA = out[3].data<float>(), *DB = out[4].data<float>();
    share_items(N * H, [&](int64_t i) {
      const int64_t n = i / H, h = i % H, off = (n * T * H + h) * hd;
      DeltaItem it{Q + off, K + off, V + off, T, H, hd, chunk, A[h], B[h]};
      delta_backward_item_any(it, CK + i * NC * hd * hd, DO + off, DQ + off, DK + off, DV + off, DA + i, DB + i);
    });
  };
  auto prim = std::make_shared<TrainOp>("SpelDeltaTrainGrad", P_DELTA, body);
  return mx::array::make_arrays({q.shape(), q.shape(), q.shape(), {N, H}, {N, H}},
                                {mx::float32, mx::float32, mx::float32, mx::float32, mx::float32}, prim,
                                {q, k, v, a, beta, ck, dO});
}

mx::array softmax_rows(const mx::array& x, bool causal) {
  check_contiguous(x, "softmax_rows", "x");
  if (x.ndim() < 1 || (causal && (x.ndim() < 2 || x.shape(-1) != x.shape(-2))))
    throw std::invalid_argument("softmax_rows: x must be [..., C] ([..., T, T] when causal)");
  return node(x.shape(), mx::float32, "SpelSoftmaxRows", P_ROWWISE,
              [causal](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
                const int64_t C = in[0].shape(-1), R = in[0].size() / C;
                const float* X = in[0].data<float>();
                float* Y = out[0].data<float>();
                for_rows(R, C, [&](int64_t r0, int64_t r1) {
                  for (int64_t r = r0; r < r1; r++)
                    softmax_row_any(X + r * C, Y + r * C, C, causal ? r % C + 1 : C);
                });
              },
              {x});
}

mx::array logsumexp_rows(const mx::array& x) {
  check_contiguous(x, "logsumexp_rows", "x");
  if (x.ndim() != 2) throw std::invalid_argument("logsumexp_rows: x must be [R, C]");
  return node({x.shape(0)}, mx::float32, "SpelLogSumExpRows", P_ROWWISE,
              [](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
                const int64_t R = in[0].shape(0), C = in[0].shape(1);
                const float* X = in[0].data<float>();
                float* Y = out[0].data<float>();
                for_rows(R, C, [&](int64_t r0, int64_t r1) {
                  for (int64_t r = r0; r < r1; r++) Y[r] = logsumexp_row_any(X + r * C, C);
                });
              },
              {x});
}

mx::array xent_grad(const mx::array& x, const mx::array& lse, const mx::array& y, const mx::array& cot) {
  check_contiguous(x, "xent_grad", "logits");
  check_contiguous(lse, "xent_grad", "lse");
  check_contiguous(cot, "xent_grad", "cotangent");
  if (y.dtype() != mx::int32 || !y.flags().row_contiguous)
    throw std::invalid_argument("xent_grad: targets must be row-contiguous int32");
  if (x.ndim() != 2 || lse.shape() != mx::Shape{x.shape(0)} || y.shape() != lse.shape() ||
      cot.shape() != lse.shape())
    throw std::invalid_argument("xent_grad: logits [R, C], lse, targets and cotangent [R]");
  return node(x.shape(), mx::float32, "SpelXentGrad", P_ROWWISE,
              [](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
                const int64_t R = in[0].shape(0), C = in[0].shape(1);
                const float *X = in[0].data<float>(), *L = in[1].data<float>(), *G = in[3].data<float>();
                const int32_t* Yt = in[2].data<int32_t>();
                float* D = out[0].data<float>();
                for_rows(R, C, [&](int64_t r0, int64_t r1) {
                  for (int64_t r = r0; r < r1; r++) xent_grad_row_any(X + r * C, L[r], Yt[r], G[r], D + r * C, C);
                });
              },
              {x, lse, y, cot});
}

std::vector<mx::array> silu_mul_grad(const mx::array& a, const mx::array& b, const mx::array& dy) {
  check_contiguous(a, "silu_mul_grad", "a");
  check_contiguous(b, "silu_mul_grad", "b");
  check_contiguous(dy, "silu_mul_grad", "dy");
  if (a.shape() != b.shape() || a.shape() != dy.shape())
    throw std::invalid_argument("silu_mul_grad: a, b and dy must have one shape");
  auto body = [](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
    const int64_t n = in[0].size();
    const float *A = in[0].data<float>(), *B = in[1].data<float>(), *DY = in[2].data<float>();
    float *DA = out[0].data<float>(), *DB = out[1].data<float>();
    for_rows(n, 1, [&](int64_t i0, int64_t i1) {
      silu_mul_grad_run_any(A + i0, B + i0, DY + i0, DA + i0, DB + i0, i1 - i0);
    });
  };
  auto prim = std::make_shared<TrainOp>("SpelSiluMulGrad", P_ROWWISE, body);
  return mx::array::make_arrays({a.shape(), a.shape()}, {mx::float32, mx::float32}, prim, {a, b, dy});
}

}  // namespace spel
