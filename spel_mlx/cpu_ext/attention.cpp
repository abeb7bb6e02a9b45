// Causal softmax attention of M queries over the KV cache, and the attention layer
// as two sub-block nodes around MLX's own in-place slice_update of the caches:
// attn_qkv (RMSNorm, projection, q/k L2 norm, RoPE) and attn_out (attention, wo,
// residual).  A node with the caches as outputs could not update them in place.
#include <algorithm>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>

#include "common.h"
#include "kernels.h"
#include "ops.h"

namespace spel {
namespace {

// A cache [R, H, hd] (float32 or float16) read in place: elements contiguous per (row,
// head).  Else its first `rows` rows widened to float32, contiguous, into buf.
inline bool in_place(const mx::array& a, int64_t hd) { return a.strides()[2] == 1 || hd == 1; }

inline const void* widened_rows(const mx::array& a, int64_t rows, int64_t H, int64_t hd, std::vector<float>& buf) {
  const auto& st = a.strides();
  const bool half = a.dtype() == mx::float16;
  buf.resize(rows * H * hd);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t j = 0; j < hd; j++) {
        const int64_t at = r * st[0] + h * st[1] + j * st[2];
        buf[(r * H + h) * hd + j] = half ? half_to_float(a.data<uint16_t>()[at]) : a.data<float>()[at];
      }
  return buf.data();
}

// o [M,H,hd]: query m (position pos0+m) against cache rows 0..min(pos0+m, W-1)
// (attend_blocked.cpp); W is the cache's row count, whatever its capacity.  K and V
// share a dtype (the ops check).
void attend_body(const View& Q, const mx::array& Kc, const mx::array& Vc, int64_t M, int64_t H, int64_t hd,
                 int64_t W, int64_t pos0, float* O) {
  std::vector<float> qb(M * H * hd), kb, vb;
  for (int64_t m = 0; m < M; m++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t j = 0; j < hd; j++) qb[(m * H + h) * hd + j] = Q.at(m, h, j);
  AttendArgs A{qb.data(), nullptr, nullptr, 0, 0, 0, 0, M, H, hd, pos0, W,
               static_cast<float>(std::sqrt(static_cast<double>(hd)) * 1.4426950408889634)};
  if (in_place(Kc, hd) && in_place(Vc, hd)) {
    A.half = Kc.dtype() == mx::float16;
    A.K = A.half ? static_cast<const void*>(Kc.data<uint16_t>()) : Kc.data<float>();
    A.V = A.half ? static_cast<const void*>(Vc.data<uint16_t>()) : Vc.data<float>();
    A.k_row = Kc.strides()[0], A.k_head = Kc.strides()[1];
    A.v_row = Vc.strides()[0], A.v_head = Vc.strides()[1];
  } else {
    const int64_t rows = A.visible(M - 1);
    A.K = widened_rows(Kc, rows, H, hd, kb);
    A.V = widened_rows(Vc, rows, H, hd, vb);
    A.k_row = A.v_row = H * hd;
    A.k_head = A.v_head = hd;
  }
  attend_rows(A, O);
}

class SpelAttend : public CpuPrimitive {
 public:
  explicit SpelAttend(mx::Stream s) : CpuPrimitive(s, P_ATTEND) {}
  const char* name() const override { return "SpelAttend"; }

 protected:
  Task task() const override {
    return [](const std::vector<mx::array>& in, std::vector<mx::array>& out) {
      attend_body(View(in[0]), in[1], in[2], in[0].shape(0), in[0].shape(1), in[0].shape(2),
                  in[1].shape(0), in[3].data<int32_t>()[0], out[0].data<float>());
    };
  }
};

// in: x [M,d], norm [d], wqkv blocks, pos0 int32, cos, sin [S, hd/2]; out: q, k, v
// [M,H,hd]: q and k L2-normalized (x / sqrt(sum x^2 + 1e-6)), then the pairs
// (2i, 2i+1) rotated by their position's table row.
void attn_qkv_body(const std::vector<mx::array>& in, std::vector<mx::array>& out, float eps) {
  const int64_t M = in[0].shape(0), d = in[0].shape(1), H = out[0].shape(1), hd = out[0].shape(2);
  const int64_t inner = H * hd, S = in[4].shape(0);
  const int64_t pos0 = in[3].data<int32_t>()[0];
  attend_coming(pos0 + M);
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
// blocks; out: x + wo(attention over the cache rows 0 .. pos0+m of each query m)
void attn_out_body(const std::vector<mx::array>& in, std::vector<mx::array>& out) {
  const int64_t M = in[0].shape(0), d = in[0].shape(1), H = in[1].shape(1), hd = in[1].shape(2);
  std::vector<float> xb, o(M * H * hd), y(M * d);
  const float* x = contiguous_2d(in[0], xb);
  {
    ProfScope prof(P_IN_ATTEND);
    attend_body(View(in[1]), in[2], in[3], M, H, hd, in[2].shape(0), in[4].data<int32_t>()[0],
                o.data());
  }
  linear_into(o.data(), M, in[5], y.data());
  float* xo = out[0].data<float>();
  for (int64_t i = 0; i < M * d; i++) xo[i] = x[i] + y[i];
}

class SpelAttnBlock : public ParamPrimitive {
 public:
  enum Kind { QKV, OUT };
  SpelAttnBlock(mx::Stream s, Kind kind, float eps) : ParamPrimitive(s, P_BLOCK, kind, eps) {}
  const char* name() const override { return kind_ == QKV ? "SpelAttnQKV" : "SpelAttnOut"; }

 protected:
  Task task() const override {
    return [kind = kind_, eps = eps_](const std::vector<mx::array>& ins, std::vector<mx::array>& outs) {
      if (kind == QKV)
        attn_qkv_body(ins, outs, eps);
      else
        attn_out_body(ins, outs);
    };
  }
};

// K/V caches [S, H, hd]: float32, or float16 (a half-precision cache), both the same
void check_caches(const mx::array& k, const mx::array& v, const char* op) {
  for (const mx::array* a : {&k, &v}) {
    const char* what = a == &k ? "k_cache" : "v_cache";
    if (a->dtype() != mx::float32 && a->dtype() != mx::float16)
      throw std::invalid_argument(std::string(op) + ": " + what + " must be float32 or float16");
    if (a->ndim() != 3) throw std::invalid_argument(std::string(op) + ": " + what + " must have 3 dimensions");
  }
  if (k.dtype() != v.dtype()) throw std::invalid_argument(std::string(op) + ": k_cache and v_cache dtypes differ");
}

void check_pos0(const mx::array& pos0, const char* op) {
  if (pos0.dtype() != mx::int32 || pos0.size() != 1)
    throw std::invalid_argument(std::string(op) + ": pos0 must be one int32");
}

}  // namespace

mx::array attend(const mx::array& q, const mx::array& k_cache, const mx::array& v_cache,
                 const mx::array& pos0) {
  check_f32(q, "attend", "q", 3);
  check_caches(k_cache, v_cache, "attend");
  check_pos0(pos0, "attend");
  if (k_cache.shape() != v_cache.shape() || k_cache.shape(1) != q.shape(1) || k_cache.shape(2) != q.shape(2))
    throw std::invalid_argument("attend: expected q [M, H, hd] and caches [W, H, hd]");
  return mx::array(q.shape(), mx::float32, std::make_shared<SpelAttend>(cpu_stream()),
                   {q, k_cache, v_cache, pos0});
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
  check_pos0(pos0, "attn_qkv");
  if (H < 1 || norm.shape(0) != d || sin.shape() != cos.shape() || wqkv.shape(0) * wqkv.shape(2) != 3 * H * hd)
    throw std::invalid_argument("attn_qkv: expected norm [d], cos and sin [S, hd/2], wqkv [d -> 3*H*hd] for x [M, d]");
  return mx::array::make_arrays({{M, H, hd}, {M, H, hd}, {M, H, hd}}, {mx::float32, mx::float32, mx::float32},
                                std::make_shared<SpelAttnBlock>(cpu_stream(), SpelAttnBlock::QKV, eps),
                                {x, norm, wqkv, pos0, cos, sin});
}

mx::array attn_out(const mx::array& x, const mx::array& q, const mx::array& k_cache, const mx::array& v_cache,
                   const mx::array& pos0, const mx::array& wo) {
  check_f32(x, "attn_out", "x", 2);
  check_f32(q, "attn_out", "q", 3);
  check_caches(k_cache, v_cache, "attn_out");
  const int64_t H = q.shape(1), hd = q.shape(2);
  check_blocks(wo, "attn_out", "wo", H * hd);
  check_pos0(pos0, "attn_out");
  if (k_cache.shape() != v_cache.shape() || k_cache.shape(1) != H || k_cache.shape(2) != hd ||
      q.shape(0) != x.shape(0) || wo.shape(0) * wo.shape(2) != x.shape(1))
    throw std::invalid_argument("attn_out: expected q [M, H, hd], caches [S, H, hd], wo [H*hd -> d] for x [M, d]");
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<SpelAttnBlock>(cpu_stream(), SpelAttnBlock::OUT, 0.0f),
                   {x, q, k_cache, v_cache, pos0, wo});
}

}  // namespace spel
