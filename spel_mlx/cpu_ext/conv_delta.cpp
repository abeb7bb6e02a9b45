// The GDN layer's sequence primitives: the causal 3-tap conv + SiLU, and the gated
// delta rule token by token (scalar reference and AVX2 variant side by side).
//
//   conv(x, tail, conv)            -> u = silu(causal 3-tap conv), tails
//   delta(q, k, v, a, beta, S0)    -> o (already / sqrt(hd)), every token's state
//   gdn_delta(qkv, a, beta, S0)    -> the same from the raw projection, and unit q, k
#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>

#include "common.h"
#include "kernels.h"
#include "ops.h"

namespace spel {
namespace {

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// The recurrence of one head over M tokens, from S0 (or the previous token's
// state in S_all): S_t = a S + beta (v - S k) k^T, o_t = S_t q / sqrt(hd).
void delta_head_ref(float* SA, float* O, int64_t M, int64_t H, int64_t h, int64_t hd, float ah, float bh,
                    const float* const* q, const float* const* k, const float* const* v, const View* S0v) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int64_t t = 0; t < M; t++) {
    float* St = SA + ((t * H + h) * hd) * hd;                              // S_t [hd, hd]
    for (int64_t i = 0; i < hd; i++) {
      float* row = St + i * hd;
      if (t) {
        const float* prow = SA + (((t - 1) * H + h) * hd + i) * hd;
        for (int64_t j = 0; j < hd; j++) row[j] = prow[j];
      } else if (S0v->s[2] == 1) {
        const float* src = S0v->p + h * S0v->s[0] + i * S0v->s[1];
        for (int64_t j = 0; j < hd; j++) row[j] = src[j];
      } else {
        for (int64_t j = 0; j < hd; j++) row[j] = S0v->at(h, i, j);
      }
      const float err = bh * (v[t][i] - dot(row, k[t], hd));              // beta (v - S k)_i
      for (int64_t j = 0; j < hd; j++) row[j] = ah * row[j] + err * k[t][j];
      O[(t * H + h) * hd + i] = dot(row, q[t], hd) * scale;
    }
  }
}

#if SPEL_AVX2
// dot() of 8 rows at once: acc[r] holds row r's 8 lane sums; returns the 8 dots
// with dot()'s tree ((0+1)+(2+3))+((4+5)+(6+7)) per row (hadd adds adjacent pairs).
SPEL_TARGET_AVX2 inline __m256 reduce8(const __m256* acc) {
  const __m256 h01 = _mm256_hadd_ps(acc[0], acc[1]), h23 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 h45 = _mm256_hadd_ps(acc[4], acc[5]), h67 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 g0 = _mm256_hadd_ps(h01, h23), g1 = _mm256_hadd_ps(h45, h67);   // [lo r0-3 | hi r0-3]
  return _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
}

// delta_head_ref for hd a multiple of 8, eight state rows at a time.
SPEL_TARGET_AVX2 void delta_head_avx2(float* SA, float* O, int64_t M, int64_t H, int64_t h,
                                      int64_t hd, float ah, float bh, const float* const* q,
                                      const float* const* k, const float* const* v, const View* S0v) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const __m256 a8 = _mm256_set1_ps(ah), b8 = _mm256_set1_ps(bh), sc8 = _mm256_set1_ps(scale);
  __m256 acc[8];
  for (int64_t t = 0; t < M; t++) {
    float* St = SA + ((t * H + h) * hd) * hd;
    const float* kt = k[t];
    const float* qt = q[t];
    for (int64_t i0 = 0; i0 < hd; i0 += 8) {
      const float* prev[8];
      for (int r = 0; r < 8; r++)
        prev[r] = t ? SA + (((t - 1) * H + h) * hd + i0 + r) * hd
                    : S0v->p + h * S0v->s[0] + (i0 + r) * S0v->s[1];
      // The next eight rows' state (read) and output lines (written) are fetched now: the
      // state comes from memory a pass wrote long ago, and every output line is new.
      if (i0 + 8 < hd) {
        const int64_t step = 8 * (t ? hd : S0v->s[1]);
        for (int r = 0; r < 8; r++)
          for (int64_t j = 0; j < hd; j += 16) {
            __builtin_prefetch(prev[r] + step + j, 0, 3);
            __builtin_prefetch(St + (i0 + 8 + r) * hd + j, 1, 3);
          }
      }
      // the eight rows' sums advance side by side (each row's own order unchanged): eight
      // independent add chains instead of one, so the adds' latency is hidden
#pragma GCC unroll 8
      for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
      for (int64_t j = 0; j < hd; j += 8) {                             // S k, 8 rows
        const __m256 kj = _mm256_loadu_ps(kt + j);
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++)
          acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(_mm256_loadu_ps(prev[r] + j), kj));
      }
      const __m256 err = _mm256_mul_ps(b8, _mm256_sub_ps(_mm256_loadu_ps(v[t] + i0), reduce8(acc)));
      alignas(32) float e[8];
      _mm256_store_ps(e, err);
#pragma GCC unroll 8
      for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
      for (int64_t j = 0; j < hd; j += 8) {                             // S' = a S + err k^T; S' q
        const __m256 kj = _mm256_loadu_ps(kt + j), qj = _mm256_loadu_ps(qt + j);
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) {
          const __m256 x = _mm256_add_ps(_mm256_mul_ps(a8, _mm256_loadu_ps(prev[r] + j)),
                                         _mm256_mul_ps(_mm256_broadcast_ss(e + r), kj));
          _mm256_storeu_ps(St + (i0 + r) * hd + j, x);
          acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(x, qj));
        }
      }
      _mm256_storeu_ps(O + (t * H + h) * hd + i0, _mm256_mul_ps(reduce8(acc), sc8));
    }
  }
}
#endif

// One head's recurrence from the state view S0v (its rows contiguous for AVX2).
void delta_head(float* SA, float* O, int64_t M, int64_t H, int64_t h, int64_t hd, float ah, float bh,
                const float* const* q, const float* const* k, const float* const* v, const View* S0v) {
#if SPEL_AVX2
  if (use_avx2() && hd % 8 == 0 && S0v->s[2] == 1) {
    delta_head_avx2(SA, O, M, H, h, hd, ah, bh, q, k, v, S0v);
    return;
  }
#endif
  delta_head_ref(SA, O, M, H, h, hd, ah, bh, q, k, v, S0v);
}

// The delta rule over all heads; rows(t, h, q, k, v) fills token t's head-h rows.
template <class Rows>
void delta_body(int64_t M, int64_t H, int64_t hd, const View& A, const View& B, const View& S0v, float* O,
                float* SA, Rows rows) {
  std::vector<float> buf(3 * M * hd);    // contiguous per-token rows of q, k, v for one head
  std::vector<const float*> qp(M), kp(M), vp(M);
  for (int64_t h = 0; h < H; h++) {
    for (int64_t t = 0; t < M; t++) {
      float* qb = buf.data() + (3 * t) * hd;
      rows(t, h, qb, qb + hd, qb + 2 * hd);
      qp[t] = qb;
      kp[t] = qb + hd;
      vp[t] = qb + 2 * hd;
    }
    delta_head(SA, O, M, H, h, hd, A.at(h), B.at(h), qp.data(), kp.data(), vp.data(), &S0v);
  }
}

class SpelConv : public CpuPrimitive {
 public:
  explicit SpelConv(mx::Stream s) : CpuPrimitive(s, P_CONV) {}
  const char* name() const override { return "SpelConv"; }

 protected:
  Task task() const override {
    return [](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
      conv_body(View(in[0]), View(in[1]), View(in[2]), in[0].shape(0), in[0].shape(1), out[0].data<float>(),
                out[1].data<float>());
    };
  }
};

// Inputs q, k, v [M,H,hd] (q, k unit), a, beta [H], S0 [H,hd,hd]; outputs o, S_all.
// With raw=true the inputs are qkv [M, 3*H*hd] (the wqkv projection), a, beta, S0
// and q, k are L2-normalized here (x / sqrt(sum x^2 + 1e-6), model.l2_normalize);
// the unit q and k are two more outputs (what NoteBank captures).
class SpelDelta : public ParamPrimitive {
 public:
  SpelDelta(mx::Stream s, bool raw) : ParamPrimitive(s, P_DELTA, raw) {}
  const char* name() const override { return kind_ ? "SpelGDNDelta" : "SpelDelta"; }

 protected:
  Task task() const override {
    return [raw = kind_ != 0](const std::vector<mx::array>& ins, std::vector<mx::array>& outs) {
      const int64_t M = outs[0].shape(0), H = outs[0].shape(1), hd = outs[0].shape(2);
      const int n_in = raw ? 1 : 3;
      View A(ins[n_in]), B(ins[n_in + 1]), S0v(ins[n_in + 2]);
      if (raw) {
        gdn_delta_body(View(ins[0]), A, B, S0v, M, H, hd, outs[0].data<float>(), outs[1].data<float>(),
                       outs[2].data<float>(), outs[3].data<float>());
        return;
      }
      View Q(ins[0]), K(ins[1]), V(ins[2]);
      delta_body(M, H, hd, A, B, S0v, outs[0].data<float>(), outs[1].data<float>(),
                 [&](int64_t t, int64_t h, float* qb, float* kb, float* vb) {
                   for (int64_t j = 0; j < hd; j++) {
                     qb[j] = Q.at(t, h, j);
                     kb[j] = K.at(t, h, j);
                     vb[j] = V.at(t, h, j);
                   }
                 });
    };
  }
};

}  // namespace

void conv_body(const View& X, const View& T, const View& C, int64_t M, int64_t d, float* U, float* TL) {
  // row r of [tail; x]: r < 2 from the tail, else x[r - 2]
  auto xs = [&](int64_t r, int64_t c) { return r < 2 ? T.at(r, c) : X.at(r - 2, c); };
  for (int64_t m = 0; m < M; m++) {
    for (int64_t c = 0; c < d; c++) {
      float a0 = xs(m, c), a1 = xs(m + 1, c), a2 = xs(m + 2, c);
      float pre = C.at(0, c) * a0 + C.at(1, c) * a1;
      pre = pre + C.at(2, c) * a2;
      U[m * d + c] = silu(pre);
      TL[(m * 2) * d + c] = a1;
      TL[(m * 2 + 1) * d + c] = a2;
    }
  }
}

void gdn_delta_body(const View& X, const View& A, const View& B, const View& S0v, int64_t M, int64_t H,
                    int64_t hd, float* O, float* SA, float* Qo, float* Ko) {
  delta_body(M, H, hd, A, B, S0v, O, SA, [&](int64_t t, int64_t h, float* qb, float* kb, float* vb) {
    for (int64_t j = 0; j < hd; j++) {
      qb[j] = X.at(t, h * hd + j);
      kb[j] = X.at(t, (H + h) * hd + j);
      vb[j] = X.at(t, (2 * H + h) * hd + j);
    }
    const float qi = 1.0f / std::sqrt(dot(qb, qb, hd) + 1e-6f);
    const float ki = 1.0f / std::sqrt(dot(kb, kb, hd) + 1e-6f);
    float* qo = Qo + (t * H + h) * hd;
    float* ko = Ko + (t * H + h) * hd;
    for (int64_t j = 0; j < hd; j++) {
      qo[j] = qb[j] *= qi;
      ko[j] = kb[j] *= ki;
    }
  });
}

std::vector<mx::array> conv(const mx::array& x, const mx::array& tail, const mx::array& conv_w) {
  check_f32(x, "conv", "x", 2);
  check_f32(tail, "conv", "tail", 2);
  check_f32(conv_w, "conv", "conv", 2);
  const int M = x.shape(0), d = x.shape(1);
  if (tail.shape(0) != 2 || tail.shape(1) != d || conv_w.shape(0) != 3 || conv_w.shape(1) != d)
    throw std::invalid_argument("conv: expected tail [2, d] and conv [3, d] for x [M, d]");
  return mx::array::make_arrays({{M, d}, {M, 2, d}}, {mx::float32, mx::float32},
                                std::make_shared<SpelConv>(cpu_stream()), {x, tail, conv_w});
}

std::vector<mx::array> delta(const mx::array& q, const mx::array& k, const mx::array& v,
                             const mx::array& a, const mx::array& beta, const mx::array& S0) {
  for (auto* t : {&q, &k, &v}) check_f32(*t, "delta", "q, k and v", 3);
  check_f32(a, "delta", "a", 1);
  check_f32(beta, "delta", "beta", 1);
  check_f32(S0, "delta", "S0", 3);
  const int M = q.shape(0), H = q.shape(1), hd = q.shape(2);
  if (k.shape() != q.shape() || v.shape() != q.shape() || a.shape(0) != H || beta.shape(0) != H ||
      S0.shape(0) != H || S0.shape(1) != hd || S0.shape(2) != hd)
    throw std::invalid_argument("delta: expected q, k, v [M, H, hd], a and beta [H], S0 [H, hd, hd]");
  return mx::array::make_arrays({{M, H, hd}, {M, H, hd, hd}}, {mx::float32, mx::float32},
                                std::make_shared<SpelDelta>(cpu_stream(), false), {q, k, v, a, beta, S0});
}

std::vector<mx::array> gdn_delta(const mx::array& qkv, const mx::array& a, const mx::array& beta,
                                 const mx::array& S0) {
  check_f32(qkv, "gdn_delta", "qkv", 2);
  check_f32(a, "gdn_delta", "a", 1);
  check_f32(beta, "gdn_delta", "beta", 1);
  check_f32(S0, "gdn_delta", "S0", 3);
  const int M = qkv.shape(0), H = S0.shape(0), hd = S0.shape(1);
  if (S0.shape(2) != hd || qkv.shape(1) != 3 * H * hd || a.shape(0) != H || beta.shape(0) != H)
    throw std::invalid_argument("gdn_delta: expected qkv [M, 3*H*hd], a and beta [H], S0 [H, hd, hd]");
  return mx::array::make_arrays({{M, H, hd}, {M, H, hd, hd}, {M, H, hd}, {M, H, hd}},
                                {mx::float32, mx::float32, mx::float32, mx::float32},
                                std::make_shared<SpelDelta>(cpu_stream(), true), {qkv, a, beta, S0});
}

}  // namespace spel
