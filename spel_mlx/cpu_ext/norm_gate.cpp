// The row-wise primitives: RMSNorm, and the SwiGLU gate silu(a) * b with the exp-free
// formula of model.silu_mul (scalar reference and AVX2 variant, the same bits).
#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>

#include "common.h"
#include "kernels.h"
#include "ops.h"

namespace spel {
namespace {

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

// y = w * (x / sqrt(mean(x^2) + eps)) for one contiguous row (MLX's rms_norm order)
inline void rms_row(const float* xr, const float* wr, float* yr, int64_t d, float eps) {
  const float ms = dot(xr, xr, d) / static_cast<float>(d);
  const float inv = 1.0f / std::sqrt(ms + eps);
  for (int64_t c = 0; c < d; c++) yr[c] = wr[c] * (xr[c] * inv);
}

class SpelRowwise : public ParamPrimitive {
 public:
  enum Kind { RMS_NORM, SILU_MUL };
  SpelRowwise(mx::Stream s, Kind kind, float eps) : ParamPrimitive(s, P_ROWWISE, kind, eps) {}
  const char* name() const override { return kind_ == RMS_NORM ? "SpelRMSNorm" : "SpelSiluMul"; }

 protected:
  Task task() const override {
    return [kind = kind_, eps = eps_](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
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
};

}  // namespace

void silu_mul_row(const float* a, const float* b, float* y, int64_t n) {
#if SPEL_AVX2
  if (use_avx2()) {
    silu_mul_avx2(a, b, y, n);
    return;
  }
#endif
  silu_mul_ref(a, b, y, n);
}

void rms_rows(const float* X, const float* w, float* Y, int64_t R, int64_t d, float eps) {
  for (int64_t r = 0; r < R; r++) rms_row(X + r * d, w, Y + r * d, d, eps);
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

}  // namespace spel
