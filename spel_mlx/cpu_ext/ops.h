// The module's functions (bindings.cpp exposes them to Python as spel_mlx._spel_cpu):
// each checks its arguments and returns the outputs of one new graph node.
// Shapes and meaning are those of MLXOps (spel_mlx/model/ops.py).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mlx/array.h"

namespace mx = mlx::core;

namespace spel {

// linear.cpp: x [M, in] @ W^T from the contiguous row blocks [nb, in, rb] of model.Linear
mx::array linear(const mx::array& x, const mx::array& blocks);
std::string set_linear(const std::string& mode);
bool set_linear_share(bool enable);
bool fma_chain_linear();

// norm_gate.cpp: RMSNorm of each row; the SwiGLU gate silu(a) * b
mx::array rms_norm(const mx::array& x, const mx::array& w, float eps);
mx::array silu_mul(const mx::array& a, const mx::array& b);

// conv_delta.cpp: u = silu(causal 3-tap conv), tails; the gated delta rule over M tokens
std::vector<mx::array> conv(const mx::array& x, const mx::array& tail, const mx::array& conv_w);
std::vector<mx::array> delta(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& a,
                             const mx::array& beta, const mx::array& S0);
std::vector<mx::array> gdn_delta(const mx::array& qkv, const mx::array& a, const mx::array& beta,
                                 const mx::array& S0);

// attention.cpp: causal softmax attention, and the attention layer as two sub-block nodes
mx::array attend(const mx::array& q, const mx::array& k_cache, const mx::array& v_cache, const mx::array& pos0);
std::vector<mx::array> attn_qkv(const mx::array& x, const mx::array& norm, const mx::array& wqkv,
                                const mx::array& pos0, const mx::array& cos, const mx::array& sin, int n_heads,
                                float eps);
mx::array attn_out(const mx::array& x, const mx::array& q, const mx::array& k_cache, const mx::array& v_cache,
                   const mx::array& pos0, const mx::array& wo);

// blocks.cpp: the FFN and GDN residual sub-blocks as single nodes
mx::array ffn_block(const mx::array& h, const mx::array& norm, const mx::array& w1, const mx::array& w3,
                    const mx::array& w2, float eps);
std::vector<mx::array> gdn_block(const mx::array& x, const mx::array& norm, const mx::array& tail,
                                 const mx::array& conv_w, const mx::array& wqkv, const mx::array& a,
                                 const mx::array& beta, const mx::array& S0, const mx::array& wo, float eps,
                                 int s_row = -1, int t_row = -1, bool with_qk = true);

// training.cpp: the training forward's hot spots and their backward (float32,
// row-contiguous).  The delta rule over q, k, v [N, T, H, hd] (unit q, k) with a, beta
// [H]: o and the state before each chunk of `chunk` tokens [N, H, ceil(T/chunk), hd, hd];
// its backward gives dq, dk, dv and the per-(sequence, head) sums da, dbeta [N, H].
std::vector<mx::array> delta_train(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& a,
                                   const mx::array& beta, int chunk);
std::vector<mx::array> delta_train_grad(const mx::array& q, const mx::array& k, const mx::array& v,
                                        const mx::array& a, const mx::array& beta, const mx::array& ck,
                                        const mx::array& dO, int chunk);
// softmax over the last axis (causal: [..., T, T], row i sees columns 0..i, the rest 0);
// log-sum-exp of each row of [R, C]; cot * (softmax - onehot(y)) of logits [R, C];
// the SwiGLU gate's backward (da, db) of y = silu(a) * b
mx::array softmax_rows(const mx::array& x, bool causal);
mx::array logsumexp_rows(const mx::array& x);
mx::array xent_grad(const mx::array& x, const mx::array& lse, const mx::array& y, const mx::array& cot);
std::vector<mx::array> silu_mul_grad(const mx::array& a, const mx::array& b, const mx::array& dy);

// pass_plan.cpp: a stack's whole decoding pass, the nodes above built by one call.
// A layer's arrays: GDN attn_norm, conv, wqkv, a, beta, wo, ffn_norm, w1, w3, w2 (weight
// blocks as the fused ops read them); attention attn_norm, wqkv, cos, sin, wo, ffn_norm,
// w1, w3, w2.  No embedding: the inputs are activations [M, d]; no head: the output is.
struct PlanLayer {
  bool gdn;
  float eps_mixer, eps_ffn;
  std::vector<mx::array> w;
};
struct PassOutputs {
  mx::array logits = mx::array(0.0f);
  std::vector<mx::array> gdn, kv, qk;   // (states, tails) / (keys, values) / (q, k) per layer
};
class PassPlan {
 public:
  PassPlan(std::optional<mx::array> emb, std::vector<PlanLayer> layers, std::vector<mx::array> head,
           float head_eps);
  // inputs: int32 token ids [M] (activations [M, d] without an embedding); pos: int32 [1]
  // or a scalar, the position of row 0; gdn_in: (S, tail) per GDN layer, each unstacked
  // (its row -1 in gdn_rows) or a row of a stacked array; kv_in: (keys, values) per
  // attention layer; qk: also the GDN layers' unit q and k (what a capture reads)
  PassOutputs run(const mx::array& inputs, const mx::array& pos, const std::vector<mx::array>& gdn_in,
                  const std::vector<int>& gdn_rows, const std::vector<mx::array>& kv_in, bool qk = true) const;

 private:
  std::optional<mx::array> emb_;
  std::vector<PlanLayer> layers_;
  std::vector<mx::array> head_;
  float head_eps_;
};

// host_tokens.cpp: an int32 [n] graph input whose ids are set from the host after the
// graph is built and before it is evaluated (set once; evaluating it unset is an error)
class HostTokens {
 public:
  struct Slot;
  explicit HostTokens(int n);
  mx::array array() const { return array_; }
  void set(const std::vector<int32_t>& ids);

 private:
  std::shared_ptr<Slot> slot_;
  mx::array array_;
};

// probe.cpp: (seconds one thread takes to read every element of an evaluated float32
// array, their sum) -- the read bandwidth bench/ reports beside the AR step
std::pair<double, float> read_seconds(const mx::array& a);

// common.cpp: timing of the bodies ({kind: (calls, seconds)} so far, then reset), the
// SIMD variant in use ("avx512", "avx2" or "none") and the switch to the scalar references
std::map<std::string, std::pair<int64_t, double>> profile(bool enable);
std::string simd();
bool set_simd(bool enable);
std::string set_simd_level(const std::string& level);
// a copy of an evaluated row-contiguous array whose data starts on a cache line
mx::array aligned_copy(const mx::array& a);
// A float32 array read from bytes [offset, ...) of the file at path with pread (no
// mapping, so no page faults on the source); the file must still be the one (st_dev,
// st_ino) that was mapped.  Also: whether every value is finite (checked piece by piece
// as it arrives).  `huge`: its 2 MB pages advised huge before the read.
std::pair<mx::array, bool> read_f32(const std::string& path, int64_t offset, const std::vector<int64_t>& shape,
                                    int64_t dev, int64_t ino, bool huge);
// whether every value of an evaluated row-contiguous float32 array is exactly a binary16 one
// (a float16 checkpoint's are); stops at the first that is not
bool exactly_half(const mx::array& w);
// the [rows/rb, cols, rb] blocks the products read, made from an evaluated float32 weight
// [rows, cols] in one pass (float16 where `half`), starting on a cache line; `huge`: its
// 2 MB pages advised huge before the first write
mx::array weight_blocks(const mx::array& w, int64_t rb, bool half, bool huge);

// helper.cpp: allow (default) or forbid the helper thread that shares attention over a
// long cache; returns the old setting.  The items it has run so far (tests).
bool set_helper(bool enable);
int64_t helper_items_run();
std::string helper_state();   // "on", "off" or "off (one usable CPU)"

}  // namespace spel
