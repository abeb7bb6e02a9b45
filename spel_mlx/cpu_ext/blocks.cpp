// Whole residual sub-blocks as single graph nodes: x + SwiGLU(rmsnorm(x)) and
// x + GDN mixer(rmsnorm(x)).  They run the kernels of the separate primitives in the
// same order (so the same bits).  A pass of separate nodes wakes MLX's scheduling
// thread, which runs only a few tasks ahead of the worker, for every one of them.
#include <memory>
#include <stdexcept>
#include <string>

#include "common.h"
#include "kernels.h"
#include "ops.h"

namespace spel {
namespace {

// in: h [M,d], norm [d], w1, w3, w2 blocks; out: h + w2(silu(w1 xn) * w3 xn)
void ffn_body(const std::vector<mx::array>& in, std::vector<mx::array>& out, float eps) {
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

// A 2-D or 3-D array, or (row >= 0) row `row` of a stacked one with one axis more: the
// ring slot a pass's stacked states left, read in place (no slice node).
View slot_view(const mx::array& a, int row) {
  if (row < 0) return View(a);
  const auto& st = a.strides();
  return View(a.data<float>() + row * st[0], st[1], st.size() > 2 ? st[2] : 0, st.size() > 3 ? st[3] : 0);
}

// in: x [M,d], norm [d], tail [2,d], conv [3,d], wqkv blocks, a [H], beta [H],
// S0 [H,hd,hd], wo blocks (tail and S0: or rows of stacked arrays); out: x + wo(o),
// S_all, tails, and (5 outputs) unit q, unit k
void gdn_body(const std::vector<mx::array>& in, std::vector<mx::array>& out, float eps, int s_row, int t_row) {
  const int64_t M = in[0].shape(0), d = in[0].shape(1), H = in[5].shape(0), hd = in[7].shape(in[7].ndim() - 1);
  const int64_t inner = H * hd;
  std::vector<float> xb, wb, xn(M * d), u(M * d), qkv(M * 3 * inner), o(M * inner), y(M * d), qk;
  const bool with_qk = out.size() == 5;
  if (!with_qk) qk.resize(2 * M * inner);   // the delta rule's unit q, k, which nothing reads
  const float* x = contiguous_2d(in[0], xb);
  rms_rows(x, contiguous_1d(in[1], wb), xn.data(), M, d, eps);
  conv_body(View(xn.data(), d, 1), slot_view(in[2], t_row), View(in[3]), M, d, u.data(), out[2].data<float>());
  linear_into(u.data(), M, in[4], qkv.data());
  {
    ProfScope prof(P_IN_DELTA);
    gdn_delta_body(View(qkv.data(), 3 * inner, 1), View(in[5]), View(in[6]), slot_view(in[7], s_row), M, H, hd, o.data(),
                   out[1].data<float>(), with_qk ? out[3].data<float>() : qk.data(),
                   with_qk ? out[4].data<float>() : qk.data() + M * inner);
  }
  linear_into(o.data(), M, in[8], y.data());
  float* xo = out[0].data<float>();
  for (int64_t i = 0; i < M * d; i++) xo[i] = x[i] + y[i];
}

class SpelBlock : public ParamPrimitive {
 public:
  enum Kind { FFN, GDN };
  // s_row, t_row (GDN): the rows of stacked S0 / tail inputs the pass starts from (-1: unstacked)
  SpelBlock(mx::Stream s, Kind kind, float eps, int s_row = -1, int t_row = -1)
      : ParamPrimitive(s, P_BLOCK, kind, eps), s_row_(s_row), t_row_(t_row) {}
  const char* name() const override { return kind_ == FFN ? "SpelFFNBlock" : "SpelGDNBlock"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const SpelBlock&>(other);
    return ParamPrimitive::is_equivalent(other) && s_row_ == o.s_row_ && t_row_ == o.t_row_;
  }

 protected:
  Task task() const override {
    return [kind = kind_, eps = eps_, s_row = s_row_, t_row = t_row_](const std::vector<mx::array>& ins,
                                                                      std::vector<mx::array>& outs) {
      if (kind == FFN)
        ffn_body(ins, outs, eps);
      else
        gdn_body(ins, outs, eps, s_row, t_row);
    };
  }

 private:
  const int s_row_, t_row_;
};

}  // namespace

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
                                 const mx::array& beta, const mx::array& S0, const mx::array& wo, float eps,
                                 int s_row, int t_row, bool with_qk) {
  check_f32(x, "gdn_block", "x", 2);
  check_f32(norm, "gdn_block", "norm", 1);
  check_f32(tail, "gdn_block", "tail", t_row < 0 ? 2 : 3);
  check_f32(conv_w, "gdn_block", "conv", 2);
  check_f32(a, "gdn_block", "a", 1);
  check_f32(beta, "gdn_block", "beta", 1);
  check_f32(S0, "gdn_block", "S0", s_row < 0 ? 3 : 4);
  if ((s_row >= 0 && s_row >= S0.shape(0)) || (t_row >= 0 && t_row >= tail.shape(0)))
    throw std::invalid_argument("gdn_block: the state or tail row is past its stacked array");
  const int o = s_row < 0 ? 0 : 1, ot = t_row < 0 ? 0 : 1;
  const int M = x.shape(0), d = x.shape(1), H = S0.shape(o), hd = S0.shape(o + 1);
  check_blocks(wqkv, "gdn_block", "wqkv", d);
  check_blocks(wo, "gdn_block", "wo", static_cast<int64_t>(H) * hd);
  if (norm.shape(0) != d || tail.shape(ot) != 2 || tail.shape(ot + 1) != d || conv_w.shape(0) != 3 ||
      conv_w.shape(1) != d || S0.shape(o + 2) != hd || a.shape(0) != H || beta.shape(0) != H ||
      wqkv.shape(0) * wqkv.shape(2) != 3 * H * hd || wo.shape(0) * wo.shape(2) != d)
    throw std::invalid_argument("gdn_block: expected norm [d], tail [2, d], conv [3, d], wqkv [d -> 3*H*hd], "
                                "a and beta [H], S0 [H, hd, hd], wo [H*hd -> d] for x [M, d]");
  std::vector<mx::Shape> shapes = {{M, d}, {M, H, hd, hd}, {M, 2, d}};
  if (with_qk) shapes.insert(shapes.end(), {{M, H, hd}, {M, H, hd}});
  return mx::array::make_arrays(shapes, std::vector<mx::Dtype>(shapes.size(), mx::float32),
                                std::make_shared<SpelBlock>(cpu_stream(), SpelBlock::GDN, eps, s_row, t_row),
                                {x, norm, tail, conv_w, wqkv, a, beta, S0, wo});
}

}  // namespace spel
