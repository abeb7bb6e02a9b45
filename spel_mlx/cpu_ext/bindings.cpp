// spel_mlx._spel_cpu: the Python face of the module (nanobind, in MLX's domain so
// that mx.array objects pass both ways).  spel_mlx/model/cpu_ops.py is its caller.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "ops.h"

namespace nb = nanobind;
using namespace spel;

NB_MODULE(_spel_cpu, m) {
  m.doc() = "Fused CPU primitives of spel_mlx (see spel_mlx/model/cpu_ops.py)";
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
        nb::arg("wqkv"), nb::arg("a"), nb::arg("beta"), nb::arg("S0"), nb::arg("wo"), nb::arg("eps"),
        nb::arg("s_row") = -1, nb::arg("t_row") = -1, nb::arg("with_qk") = true);
  m.def("attn_qkv", &attn_qkv, nb::arg("x"), nb::arg("norm"), nb::arg("wqkv"), nb::arg("pos0"), nb::arg("cos"),
        nb::arg("sin"), nb::arg("n_heads"), nb::arg("eps"));
  m.def("attn_out", &attn_out, nb::arg("x"), nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("pos0"),
        nb::arg("wo"));
  m.def("fma_chain_linear", &fma_chain_linear,
        "True when linear products are per-element FMA chains (independent of the row count)");
  m.def("set_linear", &set_linear, nb::arg("mode"), "The linear product: auto, reference or blas; returns the old one");
  m.def("set_linear_share", &set_linear_share, nb::arg("enable"),
        "Share the tiles' row blocks with the helper thread (the same bits); returns the old setting");
  m.def("read_seconds", &read_seconds, nb::arg("a"),
        "(seconds one thread takes to read an evaluated float32 array, the sum it read)");
  m.def("simd", &simd, "The SIMD variant the primitives use (\"avx512\", \"avx2\" or \"none\")");
  m.def("set_simd", &set_simd, nb::arg("enable"), "Allow (default) or forbid the SIMD variants; returns the old setting");
  m.def("set_simd_level", &set_simd_level, nb::arg("level"),
        "The widest SIMD variant allowed (none, avx2, avx512; default avx512); returns the old level");
  m.def("set_helper", &set_helper, nb::arg("enable"),
        "Allow (default) or forbid the helper thread that shares attention over a long cache; returns the old setting");
  m.def("aligned_copy", &aligned_copy, nb::arg("a"),
        "A copy of an evaluated row-contiguous array whose data starts on a cache line");
  m.def("read_f32", &read_f32, nb::arg("path"), nb::arg("offset"), nb::arg("shape"), nb::arg("dev"),
        nb::arg("ino"), nb::arg("huge") = false, nb::call_guard<nb::gil_scoped_release>(),
        "(a float32 array of a file's bytes at offset, whether all are finite): pread, the file checked "
        "by st_dev and st_ino, starting on a cache line; huge: 2 MB pages advised before the read");
  m.def("exactly_half", &exactly_half, nb::arg("w"), nb::call_guard<nb::gil_scoped_release>(),
        "Whether every value of an evaluated row-contiguous float32 array is exactly a binary16 one "
        "(NaN never); stops at the first that is not");
  m.def("weight_blocks", &weight_blocks, nb::arg("w"), nb::arg("rb"), nb::arg("half") = false,
        nb::arg("huge") = false, nb::call_guard<nb::gil_scoped_release>(),
        "The [rows/rb, cols, rb] blocks of an evaluated float32 weight [rows, cols], in one pass "
        "(float16 where half), starting on a cache line; huge: 2 MB pages advised before the first write");
  m.def("helper_state", &helper_state, "Whether the attention helper thread is used: on, off, off (one usable CPU)");
  m.def("helper_items_run", &helper_items_run, "Items the helper thread has run so far");
  m.def("profile", &profile, nb::arg("enable"),
        "Time the primitives' bodies (enable); returns and resets {kind: (calls, seconds)}");
  nb::class_<PlanLayer>(m, "PlanLayer")
      .def(nb::init<bool, float, float, std::vector<mx::array>>(), nb::arg("gdn"), nb::arg("eps_mixer"),
           nb::arg("eps_ffn"), nb::arg("arrays"));
  nb::class_<PassPlan>(m, "PassPlan", "A stack's decoding pass, built node for node by one call")
      .def(nb::init<std::optional<mx::array>, std::vector<PlanLayer>, std::vector<mx::array>, float>(),
           nb::arg("embedding").none(), nb::arg("layers"), nb::arg("head"), nb::arg("head_eps"))
      .def(
          "__call__",
          [](const PassPlan& p, const mx::array& inputs, const mx::array& pos, const std::vector<mx::array>& gdn_in,
             const std::vector<int>& gdn_rows, const std::vector<mx::array>& kv_in, bool qk) {
            PassOutputs o = p.run(inputs, pos, gdn_in, gdn_rows, kv_in, qk);
            return std::make_tuple(o.logits, o.gdn, o.kv, o.qk);
          },
          nb::arg("inputs"), nb::arg("pos"), nb::arg("gdn_in"), nb::arg("gdn_rows"), nb::arg("kv_in"),
          nb::arg("qk") = true,
          "(logits or activations, [states, tails per GDN layer], [keys, values per attention layer], [q, k per "
          "GDN layer, or none when qk is False])");
  nb::class_<HostTokens>(m, "HostTokens", "int32 token ids a graph is built on before they are known")
      .def(nb::init<int>(), nb::arg("n"))
      .def_prop_ro("array", &HostTokens::array, "The int32 [n] array (evaluate it only after set)")
      .def("set", &HostTokens::set, nb::arg("ids"), "The ids, once, before the array is evaluated");
  m.def("delta_train", &delta_train, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("a"), nb::arg("beta"),
        nb::arg("chunk"), "The delta rule's training forward: (o, the state before each chunk)");
  m.def("delta_train_grad", &delta_train_grad, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("a"),
        nb::arg("beta"), nb::arg("checkpoints"), nb::arg("dO"), nb::arg("chunk"),
        "The delta rule's backward: (dq, dk, dv, da [N, H], dbeta [N, H])");
  m.def("softmax_rows", &softmax_rows, nb::arg("x"), nb::arg("causal") = false);
  m.def("logsumexp_rows", &logsumexp_rows, nb::arg("x"));
  m.def("xent_grad", &xent_grad, nb::arg("logits"), nb::arg("lse"), nb::arg("targets"), nb::arg("cotangent"));
  m.def("silu_mul_grad", &silu_mul_grad, nb::arg("a"), nb::arg("b"), nb::arg("dy"));
  m.def("attend", &attend, nb::arg("q"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("pos0"));
}
