// A decoding pass built in C++: the graph CPUFusedOps builds from Python (the embedding
// gather, per layer gdn_block, or attn_qkv + the caches' slice_update + attn_out, then
// ffn_block; the final rms_norm and linear), node for node, so the same bits.  Built by
// one call instead of replaying the compiled trace and slicing the GDN slots, which
// cost the main thread more a pass (measured in docs/model.md, "The pass built in C++").
#include <stdexcept>
#include <string>

#include "common.h"
#include "mlx/ops.h"
#include "ops.h"

namespace spel {

PassPlan::PassPlan(std::optional<mx::array> emb, std::vector<PlanLayer> layers, std::vector<mx::array> head,
                   float head_eps)
    : emb_(std::move(emb)), layers_(std::move(layers)), head_(std::move(head)), head_eps_(head_eps) {
  if (!head_.empty() && head_.size() != 2)
    throw std::invalid_argument("PassPlan: the head is [final norm, lm_head blocks] or empty");
  for (const PlanLayer& L : layers_) {
    const size_t want = L.gdn ? 10 : 9;
    if (L.w.size() != want)
      throw std::invalid_argument(std::string("PassPlan: a ") + (L.gdn ? "GDN" : "attention") + " layer takes " +
                                  std::to_string(want) + " arrays, not " + std::to_string(L.w.size()));
  }
}

PassOutputs PassPlan::run(const mx::array& inputs, const mx::array& pos, const std::vector<mx::array>& gdn_in,
                          const std::vector<int>& gdn_rows, const std::vector<mx::array>& kv_in, bool qk) const {
  size_t n_gdn = 0;
  for (const PlanLayer& L : layers_) n_gdn += L.gdn;
  if (gdn_in.size() != 2 * n_gdn || gdn_rows.size() != gdn_in.size() || kv_in.size() != 2 * (layers_.size() - n_gdn))
    throw std::invalid_argument("PassPlan.run: expected (S, tail) per GDN layer and (keys, values) per attention layer");
  const mx::Stream s = cpu_stream();
  PassOutputs out;
  mx::array x = emb_ ? mx::take(*emb_, inputs, 0, s) : inputs;
  size_t gi = 0, ki = 0;
  for (const PlanLayer& L : layers_) {
    const std::vector<mx::array>& w = L.w;
    mx::array h = x;
    if (L.gdn) {   // w: attn_norm, conv, wqkv, a, beta, wo, ffn_norm, w1, w3, w2
      std::vector<mx::array> g = gdn_block(x, w[0], gdn_in[gi + 1], w[1], w[2], w[3], w[4], gdn_in[gi], w[5],
                                           L.eps_mixer, gdn_rows[gi], gdn_rows[gi + 1], qk);
      gi += 2;
      h = g[0];
      out.gdn.insert(out.gdn.end(), {g[1], g[2]});
      if (qk) out.qk.insert(out.qk.end(), {g[3], g[4]});
    } else {       // w: attn_norm, wqkv, cos, sin, wo, ffn_norm, w1, w3, w2
      mx::array keys = kv_in[ki], values = kv_in[ki + 1];
      ki += 2;
      std::vector<mx::array> qkv = attn_qkv(x, w[0], w[1], pos, w[2], w[3], keys.shape(1), L.eps_mixer);
      mx::array k = qkv[1], v = qkv[2];
      if (keys.dtype() != k.dtype()) {   // a half-precision cache: rounded to nearest even
        k = mx::astype(k, keys.dtype(), s);
        v = mx::astype(v, values.dtype(), s);
      }
      keys = mx::slice_update(keys, k, pos, {0}, s);
      values = mx::slice_update(values, v, pos, {0}, s);
      h = attn_out(x, qkv[0], keys, values, pos, w[4]);
      out.kv.insert(out.kv.end(), {keys, values});
    }
    const size_t f = L.gdn ? 6 : 5;
    x = ffn_block(h, w[f], w[f + 1], w[f + 2], w[f + 3], L.eps_ffn);
  }
  out.logits = head_.empty() ? x : linear(rms_norm(x, head_[0], head_eps_), head_[1]);
  return out;
}

}  // namespace spel
