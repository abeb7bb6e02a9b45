// Fused CPU primitives for the MLX target: one graph node each instead of the
// 8-30 small MLX ops of MLXOps (spel_mlx/model.py).  On the CPU every MLX node
// costs a few microseconds of dispatch whatever its size, and a d256 pass has
// hundreds; these three sequence primitives were half of a K+1 verify pass.
//
//   conv(x, tail, conv)            -> u = silu(causal 3-tap conv), tails
//   delta(q, k, v, a, beta, S0)    -> o (already / sqrt(hd)), every token's state
//   attend(q, k_cache, v_cache, pos0) -> causal softmax attention, scale sqrt(hd)
//
// Shapes and meaning are exactly those of MLXOps.conv_step / delta_rule /
// attend (see there).  float32 only; inputs may be strided views (read through
// their strides).  Each primitive runs on the CPU stream's worker thread like
// MLX's own CPU ops (CommandEncoder::dispatch).  Reference: MLXOps, checked in
// tests/test_cpu_ops.py against it and against the float64 numpy reference.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "mlx/stream.h"

// The BLAS MLX itself calls: resolved at load time through the global scope
// first, where spel_mlx._blas put OpenBLAS (else MLX's bundled reference BLAS).
extern "C" void cblas_sgemm(int order, int transa, int transb, int m, int n, int k, float alpha,
                            const float* a, int lda, const float* b, int ldb, float beta, float* c,
                            int ldc);
enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111 };

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

// AVX2 variants of the hot loops (x86-64), chosen once at load time when the CPU
// has AVX2.  Each does exactly the float operations of its scalar reference in
// the same order (separate multiply and add, -ffp-contract=off; the same 8-lane
// partial sums and reduction tree as dot()), so both give identical bits.
// -DSPEL_NO_SIMD builds only the portable code (what other CPUs get; a compile check).
#if defined(__x86_64__) && !defined(SPEL_NO_SIMD) && (defined(__GNUC__) || defined(__clang__))
#define SPEL_AVX2 1
#define SPEL_TARGET_AVX2 __attribute__((target("avx2")))
const bool HAVE_AVX2 = __builtin_cpu_supports("avx2");
#else
#define SPEL_AVX2 0
const bool HAVE_AVX2 = false;
#endif
#if SPEL_AVX2
#define SPEL_TARGET_AVX512 __attribute__((target("avx512f")))
const bool HAVE_AVX512 = __builtin_cpu_supports("avx512f");
#else
const bool HAVE_AVX512 = false;
#endif
std::atomic<bool> simd_allowed{true};   // set_simd(False): the scalar references (tests)
inline bool use_avx2() { return HAVE_AVX2 && simd_allowed.load(std::memory_order_relaxed); }
inline bool use_avx512() { return HAVE_AVX512 && simd_allowed.load(std::memory_order_relaxed); }

// Optional per-primitive timing of the worker-thread bodies (profile(True)):
// where a pass's compute goes, beside the MLX nodes between them.
enum ProfKind { P_LINEAR, P_CONV, P_DELTA, P_ATTEND, P_ROWWISE, P_BLOCK, P_KINDS };
const char* const PROF_NAMES[P_KINDS] = {"linear", "conv", "delta", "attend", "rowwise", "block"};
std::atomic<bool> prof_on{false};
std::atomic<int64_t> prof_ns[P_KINDS], prof_calls[P_KINDS];

struct ProfScope {
  ProfKind kind;
  bool on;
  std::chrono::steady_clock::time_point t0;
  explicit ProfScope(ProfKind k) : kind(k), on(prof_on.load(std::memory_order_relaxed)) {
    if (on) t0 = std::chrono::steady_clock::now();
  }
  ~ProfScope() {
    if (!on) return;
    auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0);
    prof_ns[kind] += ns.count();
    prof_calls[kind] += 1;
  }
};

// Element (i, j, k) of a 1- to 3-D array through its strides (in elements).
struct View {
  const float* p;
  int64_t s[3] = {0, 0, 0};
  View(const mx::array& a) : p(a.data<float>()) {
    for (size_t i = 0; i < a.ndim() && i < 3; i++) s[i] = a.strides()[i];
  }
  View(const float* ptr, int64_t s0, int64_t s1 = 0, int64_t s2 = 0) : p(ptr), s{s0, s1, s2} {}
  float at(int64_t i, int64_t j = 0, int64_t k = 0) const { return p[i * s[0] + j * s[1] + k * s[2]]; }
};

void check_f32(const mx::array& a, const char* op, const char* what, int ndim) {
  if (a.dtype() != mx::float32)
    throw std::invalid_argument(std::string(op) + ": " + what + " must be float32");
  if (static_cast<int>(a.ndim()) != ndim)
    throw std::invalid_argument(std::string(op) + ": " + what + " must have " +
                                std::to_string(ndim) + " dimensions");
}

void alloc(mx::array& out) { out.set_data(mx::allocator::malloc(out.nbytes())); }

// Base of the module's primitives (CPU only): eval_cpu allocates the outputs,
// registers every array with the CPU stream's encoder and runs task() on the
// stream's worker thread, as MLX's own CPU ops do.  A task captures its parameters
// by value (the primitive may be gone when the worker runs it) and gets weak
// copies of the arrays.
using Task = std::function<void(const std::vector<mx::array>& in, std::vector<mx::array>& out)>;

class CpuPrimitive : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string(name()) + ": CPU only");
  }
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& out) override {
    for (auto& o : out) alloc(o);
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    for (auto& o : out) enc.set_output_array(o);
    std::vector<mx::array> ins, outs;
    for (auto& a : in) ins.push_back(mx::array::unsafe_weak_copy(a));
    for (auto& o : out) outs.push_back(mx::array::unsafe_weak_copy(o));
    enc.dispatch([f = task(), ins = std::move(ins), outs = std::move(outs)]() mutable { f(ins, outs); });
  }

 protected:
  virtual Task task() const = 0;
};

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// Dot product with 8 independent partial sums: the compiler keeps them in one
// vector register (a single running sum is a serial dependency chain and
// cannot be vectorized without reassociating float adds).
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; l++) acc[l] += a[i + l] * b[i + l];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

// Row r of a [R, H, hd]-shaped array for head h as a contiguous hd-vector:
// a pointer into the array when its last stride is 1, else gathered into buf.
inline const float* head_row(const View& v, int64_t r, int64_t h, int64_t hd, float* buf) {
  if (v.s[2] == 1) return v.p + r * v.s[0] + h * v.s[1];
  for (int64_t j = 0; j < hd; j++) buf[j] = v.at(r, h, j);
  return buf;
}

// --- conv ------------------------------------------------------------------
// u = silu(causal 3-tap conv over [tail; x]) [M, d] and the M conv tails [M, 2, d]
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

class SpelConv : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  const char* name() const override { return "SpelConv"; }

 protected:
  Task task() const override {
    return [](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
      ProfScope prof_(P_CONV);
      conv_body(View(in[0]), View(in[1]), View(in[2]), in[0].shape(0), in[0].shape(1), out[0].data<float>(),
                out[1].data<float>());
    };
  }
};

// --- gated delta rule -------------------------------------------------------
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
      for (int r = 0; r < 8; r++) {                                     // S k, 8 rows
        __m256 s = _mm256_setzero_ps();
        for (int64_t j = 0; j < hd; j += 8)
          s = _mm256_add_ps(s, _mm256_mul_ps(_mm256_loadu_ps(prev[r] + j), _mm256_loadu_ps(kt + j)));
        acc[r] = s;
      }
      const __m256 err = _mm256_mul_ps(b8, _mm256_sub_ps(_mm256_loadu_ps(v[t] + i0), reduce8(acc)));
      alignas(32) float e[8];
      _mm256_store_ps(e, err);
      for (int r = 0; r < 8; r++) {                                     // S' = a S + err k^T; S' q
        float* row = St + (i0 + r) * hd;
        const __m256 er = _mm256_set1_ps(e[r]);
        __m256 s = _mm256_setzero_ps();
        for (int64_t j = 0; j < hd; j += 8) {
          const __m256 x = _mm256_add_ps(_mm256_mul_ps(a8, _mm256_loadu_ps(prev[r] + j)),
                                         _mm256_mul_ps(er, _mm256_loadu_ps(kt + j)));
          _mm256_storeu_ps(row + j, x);
          s = _mm256_add_ps(s, _mm256_mul_ps(x, _mm256_loadu_ps(qt + j)));
        }
        acc[r] = s;
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

// From the raw projection X [M, 3*H*hd]: q, k L2-normalized (written to Qo, Ko), then the rule.
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

// Inputs q, k, v [M,H,hd] (q, k unit), a, beta [H], S0 [H,hd,hd]; outputs o, S_all.
// With raw=true the inputs are qkv [M, 3*H*hd] (the wqkv projection), a, beta, S0
// and q, k are L2-normalized here (x / sqrt(sum x^2 + 1e-6), model.l2_normalize);
// the unit q and k are two more outputs (what NoteBank captures).
class SpelDelta : public CpuPrimitive {
 public:
  SpelDelta(mx::Stream s, bool raw) : CpuPrimitive(s), raw_(raw) {}
  const char* name() const override { return raw_ ? "SpelGDNDelta" : "SpelDelta"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return raw_ == static_cast<const SpelDelta&>(other).raw_;
  }

 protected:
  Task task() const override {
    return [raw = raw_](const std::vector<mx::array>& ins, std::vector<mx::array>& outs) {
      ProfScope prof_(P_DELTA);
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

 private:
  bool raw_;
};

// o [M,H,hd]: query m (position pos0+m) against cache rows 0..min(pos0+m, W-1)
void attend_body(const View& Q, const View& Kc, const View& Vc, int64_t M, int64_t H, int64_t hd, int64_t W,
                 int64_t pos0, float* O) {
  const float scale = std::sqrt(static_cast<float>(hd));
  std::vector<float> p(W), qb(hd), kb(hd), vb(hd), acc(hd);
  for (int64_t m = 0; m < M; m++) {
    int64_t n = pos0 + m + 1;                                          // visible keys
    if (n > W) n = W;
    for (int64_t h = 0; h < H; h++) {
      const float* qt = head_row(Q, m, h, hd, qb.data());
      float top = -INFINITY;
      for (int64_t w = 0; w < n; w++) {
        p[w] = dot(head_row(Kc, w, h, hd, kb.data()), qt, hd) * scale;
        if (p[w] > top) top = p[w];
      }
      float den = 0.0f;
      for (int64_t w = 0; w < n; w++) {
        p[w] = std::exp(p[w] - top);
        den += p[w];
      }
      for (int64_t j = 0; j < hd; j++) acc[j] = 0.0f;
      for (int64_t w = 0; w < n; w++) {
        const float* vr = head_row(Vc, w, h, hd, vb.data());
        const float pw = p[w];
        for (int64_t j = 0; j < hd; j++) acc[j] += pw * vr[j];
      }
      const float inv = 1.0f / den;
      for (int64_t j = 0; j < hd; j++) O[(m * H + h) * hd + j] = acc[j] * inv;
    }
  }
}

// --- causal attention ------------------------------------------------------
class SpelAttend : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  const char* name() const override { return "SpelAttend"; }

 protected:
  Task task() const override {
    return [](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
      ProfScope prof_(P_ATTEND);
      attend_body(View(in[0]), View(in[1]), View(in[2]), in[0].shape(0), in[0].shape(1), in[0].shape(2),
                  in[1].shape(0), in[3].data<int32_t>()[0], out[0].data<float>());
    };
  }
};


// --- row-wise elementwise: RMSNorm, SwiGLU gate --------------------------------
// 2^f on [0, 1) and the Cody-Waite split of ln 2: the constants of model.silu_mul
const float EXP2_FRACTION[7] = {0.00021683440718334168f, 0.0012437936384230852f, 0.009679987095296383f,
                                0.05548214912414551f, 0.24023030698299408f, 0.6931468844413757f, 1.0f};
const float LOG2E = 1.4426950408889634f, LN2_HI = 0.693145751953125f, LN2_LO = 1.428606765330187e-06f;

// silu(a) * b = a b / (1 + e^-a), e^-a = 2^n poly(f): the formula of model.silu_mul
inline float silu_mul1(float a, float b) {
  float t = a * -LOG2E;
  t = t < -126.0f ? -126.0f : (t > 126.0f ? 126.0f : t);
  const float n = std::floor(t);
  const float r = (-a - n * LN2_HI) - n * LN2_LO;
  float f = r * LOG2E;
  f = f < 0.0f ? 0.0f : (f > 1.0f ? 1.0f : f);
  float p = EXP2_FRACTION[0];
  for (int i = 1; i < 7; i++) p = p * f + EXP2_FRACTION[i];
  union { int32_t i; float f; } two_n;
  two_n.i = (static_cast<int32_t>(n) + 127) << 23;
  return (a * b) / (1.0f + p * two_n.f);
}

// y = silu(a) * b over n contiguous elements (silu_mul1 per element).
void silu_mul_ref(const float* a, const float* b, float* y, int64_t n) {
  for (int64_t c = 0; c < n; c++) y[c] = silu_mul1(a[c], b[c]);
}

#if SPEL_AVX2
// silu_mul1 eight at a time: the same operations (the clamps keep a NaN like the
// scalar conditionals: max/min return their second operand when unordered).
SPEL_TARGET_AVX2 void silu_mul_avx2(const float* a, const float* b, float* y, int64_t n) {
  const __m256 lo = _mm256_set1_ps(-126.0f), hi = _mm256_set1_ps(126.0f);
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  const __m256 nlog2e = _mm256_set1_ps(-LOG2E), log2e = _mm256_set1_ps(LOG2E);
  const __m256 ln2hi = _mm256_set1_ps(LN2_HI), ln2lo = _mm256_set1_ps(LN2_LO);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m256 x = _mm256_loadu_ps(a + c), w = _mm256_loadu_ps(b + c);
    __m256 t = _mm256_mul_ps(x, nlog2e);
    t = _mm256_min_ps(hi, _mm256_max_ps(lo, t));
    const __m256 nn = _mm256_floor_ps(t);
    const __m256 r = _mm256_sub_ps(_mm256_sub_ps(_mm256_xor_ps(x, sign), _mm256_mul_ps(nn, ln2hi)),
                                   _mm256_mul_ps(nn, ln2lo));
    __m256 f = _mm256_mul_ps(r, log2e);
    f = _mm256_min_ps(one, _mm256_max_ps(zero, f));
    __m256 p = _mm256_set1_ps(EXP2_FRACTION[0]);
    for (int i = 1; i < 7; i++) p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(EXP2_FRACTION[i]));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(nn), _mm256_set1_epi32(127)), 23);
    const __m256 den = _mm256_add_ps(one, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
    _mm256_storeu_ps(y + c, _mm256_div_ps(_mm256_mul_ps(x, w), den));
  }
  silu_mul_ref(a + c, b + c, y + c, n - c);
}
#endif

void silu_mul_row(const float* a, const float* b, float* y, int64_t n) {
#if SPEL_AVX2
  if (use_avx2()) {
    silu_mul_avx2(a, b, y, n);
    return;
  }
#endif
  silu_mul_ref(a, b, y, n);
}

// y = w * (x / sqrt(mean(x^2) + eps)) for one contiguous row (MLX's rms_norm order)
inline void rms_row(const float* xr, const float* wr, float* yr, int64_t d, float eps) {
  const float ms = dot(xr, xr, d) / static_cast<float>(d);
  const float inv = 1.0f / std::sqrt(ms + eps);
  for (int64_t c = 0; c < d; c++) yr[c] = wr[c] * (xr[c] * inv);
}

class SpelRowwise : public CpuPrimitive {
 public:
  enum Kind { RMS_NORM, SILU_MUL };
  SpelRowwise(mx::Stream s, Kind kind, float eps) : CpuPrimitive(s), kind_(kind), eps_(eps) {}
  const char* name() const override { return kind_ == RMS_NORM ? "SpelRMSNorm" : "SpelSiluMul"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const SpelRowwise&>(other);
    return kind_ == o.kind_ && eps_ == o.eps_;
  }

 protected:
  Task task() const override {
    return [kind = kind_, eps = eps_](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
      ProfScope prof_(P_ROWWISE);
      const mx::array &x = in[0], &w = in[1];
      const int64_t R = x.shape(0), d = x.shape(1);
      View X(x), Wv(w);
      float* Y = out[0].data<float>();
      std::vector<float> xb(d), wb(d);
      // row r of an array as a contiguous pointer (a copy into buf when strided)
      auto row = [d](const View& v, const mx::array& arr, int64_t r, std::vector<float>& buf) {
        const int64_t sc = arr.ndim() == 2 ? v.s[1] : v.s[0];
        const float* p = v.p + (arr.ndim() == 2 ? r * v.s[0] : 0);
        if (sc == 1) return p;
        for (int64_t c = 0; c < d; c++) buf[c] = p[c * sc];
        return static_cast<const float*>(buf.data());
      };
      for (int64_t r = 0; r < R; r++) {
        const float* xr = row(X, x, r, xb);
        float* yr = Y + r * d;
        if (kind == RMS_NORM) {
          rms_row(xr, row(Wv, w, 0, wb), yr, d, eps);
        } else {
          silu_mul_row(xr, row(Wv, w, r, wb), yr, d);
        }
      }
    };
  }

 private:
  Kind kind_;
  float eps_;
};

// The small-M product of the sub-blocks on AVX-512 machines: MR (<= 6) rows times
// 16*NC (<= 64) columns of one contiguous row block, every accumulator in a
// register, each weight read once in address order.  Each output element is one
// fused-multiply-add chain over k in order, so a row's result does not depend on
// M or on the tiling (fast K+1 rows equal single-token rows, bit for bit).  Against
// OpenBLAS's per-block sgemm over the shipped model's 29 MB of weights: 5 rows
// 0.74 vs 0.96 ms, one row 0.53 vs 0.55 ms (it re-packs the weights for M > 1).
#if SPEL_AVX2
template <int MR, int NC>
SPEL_TARGET_AVX512 void tile_avx512(const float* X, int64_t K, const float* W, int64_t rb, float* Y, int64_t ldy) {
  __m512 acc[MR][NC];
#pragma GCC unroll 8
  for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
    for (int c = 0; c < NC; c++) acc[m][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k++) {
    __m512 w[NC];
#pragma GCC unroll 4
    for (int c = 0; c < NC; c++) w[c] = _mm512_loadu_ps(W + k * rb + 16 * c);
#pragma GCC unroll 8
    for (int m = 0; m < MR; m++) {
      const __m512 xb = _mm512_set1_ps(X[m * K + k]);
#pragma GCC unroll 4
      for (int c = 0; c < NC; c++) acc[m][c] = _mm512_fmadd_ps(xb, w[c], acc[m][c]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; m++)
#pragma GCC unroll 4
    for (int c = 0; c < NC; c++) _mm512_storeu_ps(Y + m * ldy + 16 * c, acc[m][c]);
}

template <int MR>
SPEL_TARGET_AVX512 void tile_avx512_cols(int nc, const float* X, int64_t K, const float* W, int64_t rb, float* Y,
                                         int64_t ldy) {
  switch (nc) {
    case 4: tile_avx512<MR, 4>(X, K, W, rb, Y, ldy); break;
    case 3: tile_avx512<MR, 3>(X, K, W, rb, Y, ldy); break;
    case 2: tile_avx512<MR, 2>(X, K, W, rb, Y, ldy); break;
    default: tile_avx512<MR, 1>(X, K, W, rb, Y, ldy); break;
  }
}

SPEL_TARGET_AVX512 void linear_avx512(const float* X, int64_t M, int64_t K, const float* Wb, int64_t nb, int64_t rb,
                                      float* Y) {
  const int64_t ldy = nb * rb;
  for (int64_t b = 0; b < nb; b++) {
    const float* W = Wb + b * K * rb;
    for (int64_t c0 = 0; c0 < rb; c0 += 64) {
      const int nc = static_cast<int>(std::min<int64_t>(4, (rb - c0) / 16));
      for (int64_t r0 = 0; r0 < M; r0 += 6) {
        const float* x = X + r0 * K;
        float* y = Y + r0 * ldy + b * rb + c0;
        switch (std::min<int64_t>(6, M - r0)) {
          case 6: tile_avx512_cols<6>(nc, x, K, W + c0, rb, y, ldy); break;
          case 5: tile_avx512_cols<5>(nc, x, K, W + c0, rb, y, ldy); break;
          case 4: tile_avx512_cols<4>(nc, x, K, W + c0, rb, y, ldy); break;
          case 3: tile_avx512_cols<3>(nc, x, K, W + c0, rb, y, ldy); break;
          case 2: tile_avx512_cols<2>(nc, x, K, W + c0, rb, y, ldy); break;
          default: tile_avx512_cols<1>(nc, x, K, W + c0, rb, y, ldy); break;
        }
      }
    }
  }
}
#endif

// The same products as linear_avx512, one fmaf chain per element (its reference).
void linear_fma_ref(const float* X, int64_t M, int64_t K, const float* Wb, int64_t nb, int64_t rb, float* Y) {
  for (int64_t b = 0; b < nb; b++)
    for (int64_t m = 0; m < M; m++)
      for (int64_t c = 0; c < rb; c++) {
        float acc = 0.0f;
        for (int64_t k = 0; k < K; k++) acc = std::fma(X[m * K + k], Wb[(b * K + k) * rb + c], acc);
        Y[m * nb * rb + b * rb + c] = acc;
      }
}

std::atomic<int> linear_mode{0};   // 0 auto, 1 the fmaf reference (tests), 2 OpenBLAS

// Y [M, nb*rb] = X [M, d_in] (contiguous) times the row blocks Wb [nb, d_in, rb]:
// the AVX-512 tiles when the CPU has them (blocks of whole 16-column vectors), else
// one BLAS sgemm per block.
inline void linear_body(const float* X, int64_t M, int64_t d_in, const float* Wb, int64_t nb, int64_t rb,
                        float* Y) {
  const int mode = linear_mode.load(std::memory_order_relaxed);
  if (mode == 1) {
    linear_fma_ref(X, M, d_in, Wb, nb, rb, Y);
    return;
  }
#if SPEL_AVX2
  if (mode == 0 && use_avx512() && rb % 16 == 0) {
    linear_avx512(X, M, d_in, Wb, nb, rb, Y);
    return;
  }
#endif
  for (int64_t b = 0; b < nb; b++)
    cblas_sgemm(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_NO_TRANS, M, rb, d_in, 1.0f, X, d_in,
                Wb + b * d_in * rb, rb, 0.0f, Y + b * rb, nb * rb);
}

// a 2-D array's rows as one contiguous [R, C] block (a copy into buf when strided)
const float* contiguous_2d(const mx::array& a, std::vector<float>& buf) {
  const int64_t R = a.shape(0), C = a.shape(1);
  if (a.strides()[1] == 1 && (a.strides()[0] == C || R == 1)) return a.data<float>();
  View V(a);
  buf.resize(R * C);
  for (int64_t r = 0; r < R; r++)
    for (int64_t c = 0; c < C; c++) buf[r * C + c] = V.at(r, c);
  return buf.data();
}

// a 1-D array as a contiguous vector
const float* contiguous_1d(const mx::array& a, std::vector<float>& buf) {
  if (a.strides()[0] == 1) return a.data<float>();
  View V(a);
  buf.resize(a.shape(0));
  for (int64_t c = 0; c < a.shape(0); c++) buf[c] = V.at(c);
  return buf.data();
}

// --- linear: x @ W^T from the contiguous row blocks of model.Linear ------------
// One node (and one sgemm per block, as MLX's batched matmul makes) writing the
// [M, out] result in place: no broadcast of x, no reshape or transposed copy.
class SpelLinear : public CpuPrimitive {
 public:
  using CpuPrimitive::CpuPrimitive;
  const char* name() const override { return "SpelLinear"; }

 protected:
  Task task() const override {
    return [](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
      ProfScope prof_(P_LINEAR);
      std::vector<float> xc;
      const mx::array& wb = in[1];
      linear_body(contiguous_2d(in[0], xc), in[0].shape(0), in[0].shape(1), wb.data<float>(), wb.shape(0),
                  wb.shape(2), out[0].data<float>());
    };
  }
};


mx::Stream cpu_stream() { return mx::default_stream(mx::Device::cpu); }

// --- whole sub-blocks ----------------------------------------------------------
// x + SwiGLU(rmsnorm(x)) and x + GDN mixer(rmsnorm(x)): the kernels of the
// separate primitives above, in the same order (so the same bits), as one graph
// node each.  A pass of separate nodes has ~180 of them, and MLX's scheduling
// thread, which may run only a few tasks ahead of the worker, wakes for each.

void rms_rows(const float* X, const float* w, float* Y, int64_t R, int64_t d, float eps) {
  for (int64_t r = 0; r < R; r++) rms_row(X + r * d, w, Y + r * d, d, eps);
}

void linear_into(const float* X, int64_t M, const mx::array& blocks, float* Y) {
  linear_body(X, M, blocks.shape(1), blocks.data<float>(), blocks.shape(0), blocks.shape(2), Y);
}

class SpelBlock : public CpuPrimitive {
 public:
  enum Kind { FFN, GDN, ATTN_QKV, ATTN_OUT };
  SpelBlock(mx::Stream s, Kind kind, float eps, int window = 0)
      : CpuPrimitive(s), kind_(kind), eps_(eps), window_(window) {}
  const char* name() const override {
    return kind_ == FFN ? "SpelFFNBlock" : kind_ == GDN ? "SpelGDNBlock" : kind_ == ATTN_QKV ? "SpelAttnQKV" : "SpelAttnOut";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const SpelBlock&>(other);
    return kind_ == o.kind_ && eps_ == o.eps_ && window_ == o.window_;
  }

 protected:
  Task task() const override {
    return [kind = kind_, eps = eps_, window = window_](const std::vector<mx::array>& ins, std::vector<mx::array>& outs) {
      ProfScope prof_(P_BLOCK);
      if (kind == FFN)
        ffn(ins, outs, eps);
      else if (kind == GDN)
        gdn(ins, outs, eps);
      else if (kind == ATTN_QKV)
        attn_qkv(ins, outs, eps);
      else
        attn_out(ins, outs, window);
    };
  }

 private:
  // in: h [M,d], norm [d], w1, w3, w2 blocks; out: h + w2(silu(w1 xn) * w3 xn)
  static void ffn(const std::vector<mx::array>& in, std::vector<mx::array>& out, float eps) {
    const int64_t M = in[0].shape(0), d = in[0].shape(1), ff = in[2].shape(0) * in[2].shape(2);
    std::vector<float> hb, wb, xn(M * d), g1(M * ff), g3(M * ff), y(M * d);
    const float* h = contiguous_2d(in[0], hb);
    rms_rows(h, contiguous_1d(in[1], wb), xn.data(), M, d, eps);
    linear_into(xn.data(), M, in[2], g1.data());
    linear_into(xn.data(), M, in[3], g3.data());
    silu_mul_row(g1.data(), g3.data(), g1.data(), M * ff);
    linear_into(g1.data(), M, in[4], y.data());
    float* o = out[0].data<float>();
    for (int64_t i = 0; i < M * d; i++) o[i] = h[i] + y[i];
  }

  // in: x [M,d], norm [d], tail [2,d], conv [3,d], wqkv blocks, a [H], beta [H],
  // S0 [H,hd,hd], wo blocks; out: x + wo(o), S_all, tails, unit q, unit k
  static void gdn(const std::vector<mx::array>& in, std::vector<mx::array>& out, float eps) {
    const int64_t M = in[0].shape(0), d = in[0].shape(1), H = in[7].shape(0), hd = in[7].shape(1);
    const int64_t inner = H * hd;
    std::vector<float> xb, wb, xn(M * d), u(M * d), qkv(M * 3 * inner), o(M * inner), y(M * d);
    const float* x = contiguous_2d(in[0], xb);
    rms_rows(x, contiguous_1d(in[1], wb), xn.data(), M, d, eps);
    conv_body(View(xn.data(), d, 1), View(in[2]), View(in[3]), M, d, u.data(), out[2].data<float>());
    linear_into(u.data(), M, in[4], qkv.data());
    gdn_delta_body(View(qkv.data(), 3 * inner, 1), View(in[5]), View(in[6]), View(in[7]), M, H, hd, o.data(),
                   out[1].data<float>(), out[3].data<float>(), out[4].data<float>());
    linear_into(o.data(), M, in[8], y.data());
    float* xo = out[0].data<float>();
    for (int64_t i = 0; i < M * d; i++) xo[i] = x[i] + y[i];
  }

  // in: x [M,d], norm [d], wqkv blocks, pos0 int32, cos, sin [S, hd/2]; out: q, k, v
  // [M,H,hd]: q and k L2-normalized (x / sqrt(sum x^2 + 1e-6)), then the pairs
  // (2i, 2i+1) rotated by their position's table row (the cache writes stay MLX's
  // slice_update, which updates the caches in place).
  static void attn_qkv(const std::vector<mx::array>& in, std::vector<mx::array>& out, float eps) {
    const int64_t M = in[0].shape(0), d = in[0].shape(1), H = out[0].shape(1), hd = out[0].shape(2);
    const int64_t inner = H * hd, S = in[4].shape(0);
    const int64_t pos0 = in[3].data<int32_t>()[0];
    std::vector<float> xb, wb, xn(M * d), qkv(M * 3 * inner);
    const float* x = contiguous_2d(in[0], xb);
    rms_rows(x, contiguous_1d(in[1], wb), xn.data(), M, d, eps);
    linear_into(xn.data(), M, in[2], qkv.data());
    View C(in[4]), Sn(in[5]);
    float* Q = out[0].data<float>();
    float* K = out[1].data<float>();
    float* V = out[2].data<float>();
    for (int64_t t = 0; t < M; t++) {
      const int64_t pos = std::min(std::max(pos0 + t, int64_t(0)), S - 1);  // the caller checks room
      for (int64_t h = 0; h < H; h++) {
        for (int part = 0; part < 2; part++) {          // q, then k
          const float* src = qkv.data() + t * 3 * inner + part * inner + h * hd;
          float* dst = (part == 0 ? Q : K) + (t * H + h) * hd;
          const float inv = 1.0f / std::sqrt(dot(src, src, hd) + 1e-6f);
          for (int64_t i = 0; i < hd / 2; i++) {
            const float x0 = src[2 * i] * inv, x1 = src[2 * i + 1] * inv;
            const float c = C.at(pos, i), sn = Sn.at(pos, i);
            dst[2 * i] = x0 * c - x1 * sn;
            dst[2 * i + 1] = x1 * c + x0 * sn;
          }
        }
        const float* vsrc = qkv.data() + t * 3 * inner + 2 * inner + h * hd;
        for (int64_t j = 0; j < hd; j++) V[(t * H + h) * hd + j] = vsrc[j];
      }
    }
  }

  // in: x [M,d], q [M,H,hd], k_cache, v_cache [S,H,hd] (this batch written), pos0, wo
  // blocks; out: x + wo(attention over the first `window` cache rows)
  static void attn_out(const std::vector<mx::array>& in, std::vector<mx::array>& out, int window) {
    const int64_t M = in[0].shape(0), d = in[0].shape(1), H = in[1].shape(1), hd = in[1].shape(2);
    std::vector<float> xb, o(M * H * hd), y(M * d);
    const float* x = contiguous_2d(in[0], xb);
    attend_body(View(in[1]), View(in[2]), View(in[3]), M, H, hd, window, in[4].data<int32_t>()[0], o.data());
    linear_into(o.data(), M, in[5], y.data());
    float* xo = out[0].data<float>();
    for (int64_t i = 0; i < M * d; i++) xo[i] = x[i] + y[i];
  }

  Kind kind_;
  float eps_;
  int window_;
};

void check_blocks(const mx::array& b, const char* op, const char* what, int64_t d_in) {
  check_f32(b, op, what, 3);
  if (b.shape(1) != d_in)
    throw std::invalid_argument(std::string(op) + ": " + what + " blocks must be [nb, " + std::to_string(d_in) + ", rb]");
  if (!b.flags().row_contiguous)
    throw std::invalid_argument(std::string(op) + ": " + what + " blocks must be a contiguous (evaluated) array");
}

mx::array ffn_block(const mx::array& h, const mx::array& norm, const mx::array& w1, const mx::array& w3,
                    const mx::array& w2, float eps) {
  check_f32(h, "ffn_block", "h", 2);
  check_f32(norm, "ffn_block", "norm", 1);
  const int64_t d = h.shape(1);
  check_blocks(w1, "ffn_block", "w1", d);
  check_blocks(w3, "ffn_block", "w3", d);
  const int64_t ff = w1.shape(0) * w1.shape(2);
  check_blocks(w2, "ffn_block", "w2", ff);
  if (norm.shape(0) != d || w3.shape(0) * w3.shape(2) != ff || w2.shape(0) * w2.shape(2) != d)
    throw std::invalid_argument("ffn_block: expected norm [d], w1 and w3 [d -> ff], w2 [ff -> d] for h [M, d]");
  return mx::array(h.shape(), mx::float32, std::make_shared<SpelBlock>(cpu_stream(), SpelBlock::FFN, eps),
                   {h, norm, w1, w3, w2});
}

std::vector<mx::array> gdn_block(const mx::array& x, const mx::array& norm, const mx::array& tail,
                                 const mx::array& conv_w, const mx::array& wqkv, const mx::array& a,
                                 const mx::array& beta, const mx::array& S0, const mx::array& wo, float eps) {
  check_f32(x, "gdn_block", "x", 2);
  check_f32(norm, "gdn_block", "norm", 1);
  check_f32(tail, "gdn_block", "tail", 2);
  check_f32(conv_w, "gdn_block", "conv", 2);
  check_f32(a, "gdn_block", "a", 1);
  check_f32(beta, "gdn_block", "beta", 1);
  check_f32(S0, "gdn_block", "S0", 3);
  const int M = x.shape(0), d = x.shape(1), H = S0.shape(0), hd = S0.shape(1);
  check_blocks(wqkv, "gdn_block", "wqkv", d);
  check_blocks(wo, "gdn_block", "wo", static_cast<int64_t>(H) * hd);
  if (norm.shape(0) != d || tail.shape(0) != 2 || tail.shape(1) != d || conv_w.shape(0) != 3 ||
      conv_w.shape(1) != d || S0.shape(2) != hd || a.shape(0) != H || beta.shape(0) != H ||
      wqkv.shape(0) * wqkv.shape(2) != 3 * H * hd || wo.shape(0) * wo.shape(2) != d)
    throw std::invalid_argument("gdn_block: expected norm [d], tail [2, d], conv [3, d], wqkv [d -> 3*H*hd], "
                                "a and beta [H], S0 [H, hd, hd], wo [H*hd -> d] for x [M, d]");
  return mx::array::make_arrays({{M, d}, {M, H, hd, hd}, {M, 2, d}, {M, H, hd}, {M, H, hd}},
                                {mx::float32, mx::float32, mx::float32, mx::float32, mx::float32},
                                std::make_shared<SpelBlock>(cpu_stream(), SpelBlock::GDN, eps),
                                {x, norm, tail, conv_w, wqkv, a, beta, S0, wo});
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

mx::array attend(const mx::array& q, const mx::array& k_cache, const mx::array& v_cache,
                 const mx::array& pos0) {
  check_f32(q, "attend", "q", 3);
  check_f32(k_cache, "attend", "k_cache", 3);
  check_f32(v_cache, "attend", "v_cache", 3);
  if (pos0.dtype() != mx::int32 || pos0.size() != 1)
    throw std::invalid_argument("attend: pos0 must be one int32");
  if (k_cache.shape() != v_cache.shape() || k_cache.shape(1) != q.shape(1) || k_cache.shape(2) != q.shape(2))
    throw std::invalid_argument("attend: expected q [M, H, hd] and caches [W, H, hd]");
  return mx::array(q.shape(), mx::float32, std::make_shared<SpelAttend>(cpu_stream()),
                   {q, k_cache, v_cache, pos0});
}

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps) {
  check_f32(x, "rms_norm", "x", 2);
  check_f32(w, "rms_norm", "weight", 1);
  if (w.shape(0) != x.shape(1)) throw std::invalid_argument("rms_norm: weight [d] for x [R, d]");
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<SpelRowwise>(cpu_stream(), SpelRowwise::RMS_NORM, eps), {x, w});
}

mx::array silu_mul(const mx::array& a, const mx::array& b) {
  check_f32(a, "silu_mul", "a", 2);
  check_f32(b, "silu_mul", "b", 2);
  if (a.shape() != b.shape()) throw std::invalid_argument("silu_mul: a and b differ in shape");
  return mx::array(a.shape(), mx::float32,
                   std::make_shared<SpelRowwise>(cpu_stream(), SpelRowwise::SILU_MUL, 0.0f), {a, b});
}

mx::array linear(const mx::array& x, const mx::array& blocks) {
  check_f32(x, "linear", "x", 2);
  check_f32(blocks, "linear", "weight blocks", 3);
  if (blocks.shape(1) != x.shape(1))
    throw std::invalid_argument("linear: weight blocks [nb, in, rb] for x [M, in]");
  if (!blocks.flags().row_contiguous)
    throw std::invalid_argument("linear: the weight blocks must be a contiguous (evaluated) array");
  return mx::array({x.shape(0), blocks.shape(0) * blocks.shape(2)}, mx::float32,
                   std::make_shared<SpelLinear>(cpu_stream()), {x, blocks});
}

// Turn timing on/off; returns {kind: (calls, seconds)} accumulated so far and resets it.
std::map<std::string, std::pair<int64_t, double>> profile(bool enable) {
  std::map<std::string, std::pair<int64_t, double>> out;
  for (int k = 0; k < P_KINDS; k++) {
    out[PROF_NAMES[k]] = {prof_calls[k].exchange(0), prof_ns[k].exchange(0) * 1e-9};
  }
  prof_on = enable;
  return out;
}

// The SIMD variant in use ("avx512", "avx2" or "none"); set_simd(False) forces the scalar
// references (the variants must give the same bits: tests/test_cpu_ops.py).
std::string simd() { return use_avx512() ? "avx512" : (use_avx2() ? "avx2" : "none"); }

// Which product `linear` and the sub-blocks use: "auto" (AVX-512 tiles where the CPU
// has them, else BLAS), "reference" (fmaf chains, what the tiles equal) or "blas".
std::string set_linear(const std::string& mode) {
  static const char* names[3] = {"auto", "reference", "blas"};
  for (int i = 0; i < 3; i++)
    if (mode == names[i]) return names[linear_mode.exchange(i)];
  throw std::invalid_argument("set_linear: expected auto, reference or blas, not " + mode);
}
// True when linear_body computes every output element as one FMA chain over k in
// order (the AVX-512 tiles or their reference) for blocks of whole 16-column vectors:
// a row's product then does not depend on how many rows the call has.
bool fma_chain_linear() {
  const int mode = linear_mode.load();
  return mode == 1 || (mode == 0 && use_avx512());
}

bool set_simd(bool enable) {
  bool was = simd_allowed.exchange(enable);
  return was;
}

std::vector<mx::array> attn_qkv(const mx::array& x, const mx::array& norm, const mx::array& wqkv,
                                const mx::array& pos0, const mx::array& cos, const mx::array& sin, int n_heads,
                                float eps) {
  check_f32(x, "attn_qkv", "x", 2);
  check_f32(norm, "attn_qkv", "norm", 1);
  check_f32(cos, "attn_qkv", "cos", 2);
  check_f32(sin, "attn_qkv", "sin", 2);
  const int M = x.shape(0), d = x.shape(1), H = n_heads, hd = 2 * cos.shape(1);
  check_blocks(wqkv, "attn_qkv", "wqkv", d);
  if (pos0.dtype() != mx::int32 || pos0.size() != 1) throw std::invalid_argument("attn_qkv: pos0 must be one int32");
  if (H < 1 || norm.shape(0) != d || sin.shape() != cos.shape() || wqkv.shape(0) * wqkv.shape(2) != 3 * H * hd)
    throw std::invalid_argument("attn_qkv: expected norm [d], cos and sin [S, hd/2], wqkv [d -> 3*H*hd] for x [M, d]");
  return mx::array::make_arrays({{M, H, hd}, {M, H, hd}, {M, H, hd}}, {mx::float32, mx::float32, mx::float32},
                                std::make_shared<SpelBlock>(cpu_stream(), SpelBlock::ATTN_QKV, eps),
                                {x, norm, wqkv, pos0, cos, sin});
}

mx::array attn_out(const mx::array& x, const mx::array& q, const mx::array& k_cache, const mx::array& v_cache,
                   const mx::array& pos0, const mx::array& wo, int window) {
  check_f32(x, "attn_out", "x", 2);
  check_f32(q, "attn_out", "q", 3);
  check_f32(k_cache, "attn_out", "k_cache", 3);
  check_f32(v_cache, "attn_out", "v_cache", 3);
  const int64_t H = q.shape(1), hd = q.shape(2);
  check_blocks(wo, "attn_out", "wo", H * hd);
  if (pos0.dtype() != mx::int32 || pos0.size() != 1) throw std::invalid_argument("attn_out: pos0 must be one int32");
  if (k_cache.shape() != v_cache.shape() || k_cache.shape(1) != H || k_cache.shape(2) != hd ||
      q.shape(0) != x.shape(0) || wo.shape(0) * wo.shape(2) != x.shape(1))
    throw std::invalid_argument("attn_out: expected q [M, H, hd], caches [S, H, hd], wo [H*hd -> d] for x [M, d]");
  if (window < 1 || window > k_cache.shape(0)) throw std::invalid_argument("attn_out: window must be in [1, S]");
  return mx::array(x.shape(), mx::float32, std::make_shared<SpelBlock>(cpu_stream(), SpelBlock::ATTN_OUT, 0.0f, window),
                   {x, q, k_cache, v_cache, pos0, wo});
}

}  // namespace

NB_MODULE(_spel_cpu, m) {
  m.doc() = "Fused CPU primitives of spel_mlx (see spel_mlx/cpu_ops.py)";
  m.attr("mlx_version") = SPEL_MLX_VERSION;   // the MLX whose headers built this module
  m.def("conv", &conv, nb::arg("x"), nb::arg("tail"), nb::arg("conv"));
  m.def("delta", &delta, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("a"), nb::arg("beta"),
        nb::arg("S0"));
  m.def("linear", &linear, nb::arg("x"), nb::arg("blocks"));
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"));
  m.def("silu_mul", &silu_mul, nb::arg("a"), nb::arg("b"));
  m.def("gdn_delta", &gdn_delta, nb::arg("qkv"), nb::arg("a"), nb::arg("beta"), nb::arg("S0"));
  m.def("ffn_block", &ffn_block, nb::arg("h"), nb::arg("norm"), nb::arg("w1"), nb::arg("w3"), nb::arg("w2"),
        nb::arg("eps"));
  m.def("gdn_block", &gdn_block, nb::arg("x"), nb::arg("norm"), nb::arg("tail"), nb::arg("conv"),
        nb::arg("wqkv"), nb::arg("a"), nb::arg("beta"), nb::arg("S0"), nb::arg("wo"), nb::arg("eps"));
  m.def("attn_qkv", &attn_qkv, nb::arg("x"), nb::arg("norm"), nb::arg("wqkv"), nb::arg("pos0"), nb::arg("cos"),
        nb::arg("sin"), nb::arg("n_heads"), nb::arg("eps"));
  m.def("attn_out", &attn_out, nb::arg("x"), nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("pos0"),
        nb::arg("wo"), nb::arg("window"));
  m.def("fma_chain_linear", &fma_chain_linear,
        "True when linear products are per-element FMA chains (independent of the row count)");
  m.def("set_linear", &set_linear, nb::arg("mode"), "The linear product: auto, reference or blas; returns the old one");
  m.def("simd", &simd, "The SIMD variant the primitives use (\"avx512\", \"avx2\" or \"none\")");
  m.def("set_simd", &set_simd, nb::arg("enable"), "Allow (default) or forbid the SIMD variants; returns the old setting");
  m.def("profile", &profile, nb::arg("enable"),
        "Time the primitives' bodies (enable); returns and resets {kind: (calls, seconds)}");
  m.def("attend", &attend, nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("pos0"));
}
