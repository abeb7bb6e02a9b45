"""The Metal kernels (metal/*.metal), compiled unchanged as C++ against
metal/emu/metal_emu.h and run over their real grids, against float64 numpy
references, the model's MLX-ops path, and the SPEC 3 quantization reference.
Every kernel library is built once per session (one compiler run, cached on disk)."""
import os
import shutil

import numpy as np
import pytest

import spel_mlx  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
from spel_mlx import quant
from spel_mlx.metal import executors, formats, kernel_body, kernel_header
from spel_mlx.metal.emu import build
from spel_mlx.metal.launch import KERNELS, rope_inv_freq
from spel_mlx.model import backends
from spel_mlx.model.metal_ops import EmulatedOps, MetalOps

from conftest import require_or_skip

HAVE_CXX = bool(os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++"))

# (M, H, hd): edge shapes M = 1 and M = 17, several head counts; H >= 8 moves the
# per-head gates from the constant to the device address space in the signature.
DELTA_CASES = [(1, 2, 32), (5, 3, 64), (17, 1, 32), (2, 8, 32), (2, 1, 128)]
# (M, H, hd, pos0): a long cache (1100), M = 17 (three query tiles), M = 9 crossing a
# tile, partial key blocks, hd 128 (blocks of 16 keys)
ATTN_CASES = [(1, 2, 32, 0), (5, 3, 64, 20), (17, 2, 32, 3), (3, 1, 64, 1100), (2, 1, 128, 6), (9, 2, 128, 40)]
CONV_CASES = [(1, 64), (5, 100), (17, 48)]
# (N vectors, rows, cols): odd rows (RPS tail), N = 5 (NV = 4 tail), cols padded to 64
TERN_CASES = [(1, 37, 100), (5, 64, 192), (1, 8, 64)]


def _rng(seed):
    return np.random.default_rng(seed)


def _unit(a):
    a = a.astype(np.float64)
    return (a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6)).astype(np.float32)


def delta_inputs(M, H, hd, seed=0):
    r = _rng(seed)
    q, k = (_unit(r.standard_normal((M, H, hd))) for _ in range(2))
    v = r.standard_normal((M, H, hd)).astype(np.float32)
    a = r.uniform(0.7, 1.0, H).astype(np.float32)
    b = r.uniform(0.05, 1.0, H).astype(np.float32)
    S0 = (0.2 * r.standard_normal((H, hd, hd))).astype(np.float32)
    return q, k, v, a, b, S0


def attn_inputs(M, H, hd, pos0, seed=0):
    r = _rng(seed)
    n = pos0 + M
    q = _unit(r.standard_normal((M, H, hd)))
    kc = np.full((n + 3, H, hd), np.nan, np.float32)   # rows past pos0+M are never read
    vc = np.full((n + 3, H, hd), np.nan, np.float32)
    kc[:n] = _unit(r.standard_normal((n, H, hd)))
    vc[:n] = r.standard_normal((n, H, hd))
    return q, kc, vc


def tern_inputs(N, R, C, seed=0):
    r = _rng(seed)
    t = r.integers(-1, 2, size=(R, C)).astype(np.int8)
    s = r.uniform(0.01, 0.1, R).astype(np.float32)
    x = r.standard_normal((N, C)).astype(np.float32)
    return quant.pack_ternary(t), t, s, x


# ---- float64 references -----------------------------------------------------------------
def ref_conv(x, tail, conv):
    xs = np.concatenate([tail, x]).astype(np.float64)
    z = conv[0] * xs[:-2] + conv[1] * xs[1:-1] + conv[2] * xs[2:]
    return z / (1 + np.exp(-z)), np.stack([xs[1:-1], xs[2:]], axis=1)


def ref_delta(q, k, v, a, b, S0):
    S = S0.astype(np.float64)
    hd = q.shape[-1]
    outs, states = [], []
    for j in range(q.shape[0]):
        pred = np.einsum("hij,hj->hi", S, k[j])
        S = a[:, None, None] * S + np.einsum("hi,hj->hij", b[:, None] * (v[j] - pred), k[j])
        outs.append(np.einsum("hij,hj->hi", S, q[j]) / np.sqrt(hd))
        states.append(S)
    return np.array(outs), np.array(states)


def ref_attend(q, kc, vc, pos0):
    M, H, hd = q.shape
    out = []
    for j in range(M):
        n = pos0 + j + 1
        lg = np.sqrt(hd) * np.einsum("hd,thd->ht", q[j].astype(np.float64), kc[:n])
        p = np.exp(lg - lg.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out.append(np.einsum("ht,thd->hd", p, vc[:n]))
    return np.array(out)


def ref_rope(x, pos0, inv_freq):
    """x [M,H,hd] unit -> rotated on pairs (2i, 2i+1) by (pos0+j)*inv_freq[i] (float32 angle)."""
    y = np.empty_like(x, dtype=np.float64)
    for j in range(x.shape[0]):
        ang = (np.float32(pos0 + j) * inv_freq).astype(np.float64)
        c, s = np.cos(ang), np.sin(ang)
        x0, x1 = x[j, :, 0::2].astype(np.float64), x[j, :, 1::2].astype(np.float64)
        y[j, :, 0::2] = x0 * c - x1 * s
        y[j, :, 1::2] = x0 * s + x1 * c
    return y.astype(np.float32)


def _sigmoid(x):
    return (1 / (1 + np.exp(-x.astype(np.float64)))).astype(np.float32)


# ---- session fixture: one compiler run for every instantiation used below --------------------
@pytest.fixture(scope="module")
def ops():
    require_or_skip(HAVE_CXX, "g++/clang++ not found: the Metal emulation compiles kernels as C++")
    o = EmulatedOps(numpy_out=True)
    with o.collecting():
        for M, d in CONV_CASES:
            o.conv_step(np.zeros((M, d), np.float32), np.zeros((2, d), np.float32), np.zeros((3, d), np.float32))
        for case in DELTA_CASES:
            args = delta_inputs(*case)
            o.delta_rule(*args)
            o.delta_rule_fused(*args)
        for case in ATTN_CASES:
            q, kc, vc = attn_inputs(*case)
            o.attend(q, kc, vc, case[3], case[0])
            o.attend_rope(q, kc, vc, case[3], case[0], rope_inv_freq(case[2], 1e4))
        for N, R, C in TERN_CASES:
            packed, t, s, x = tern_inputs(N, R, C)
            o.ternary_matmul(x, packed, s)
            o.q8_matmul(x, t, s)
    return o


@pytest.fixture(scope="module")
def fib(ops):
    """The same compiled kernels with fiber lanes: for the tests that make many dispatches."""
    return EmulatedOps(numpy_out=True, lanes="fibers")


# ---- the generated signature is MLX's ------------------------------------------------------
def test_generated_signature_has_mlx_form():
    body = kernel_body("gdn_delta")
    k = build.EmuKernel("gdn_delta", KERNELS["gdn_delta"].inputs,
                        KERNELS["gdn_delta"].outputs, body, kernel_header())
    q, kk, v, a, b, S0 = delta_inputs(2, 3, 32)
    inst = build.instance_for(k, [q, kk, v, a, b, S0], [np.float32, np.float32], [("HD", 32), ("FUSED", 0)])
    src = k.function_source("custom_kernel_x", inst.in_specs, inst.out_dtypes, inst.template)
    assert src.startswith("template <int HD, int FUSED>\n[[kernel]] void custom_kernel_x(\n")
    for line in ("  const device float* q [[buffer(0)]],",
                 "  const constant int* q_shape [[buffer(1)]],",
                 "  const device float* k [[buffer(2)]],",
                 "  const constant float* decay [[buffer(4)]],",   # H = 3 < 8 elements: constant
                 "  const device float* s0 [[buffer(6)]],",
                 "  device float* o [[buffer(7)]],",
                 "  device float* s_all [[buffer(8)]],",
                 "  uint3 thread_position_in_grid [[thread_position_in_grid]]) {"):
        assert line + "\n" in src, line
    assert body in src            # the body, unchanged
    assert k.threaded             # simd_sum: one std::thread per lane
    conv = build.EmuKernel("gdn_conv", ("x", "tail", "conv"), ("u", "tails"),
                           kernel_body("gdn_conv"), kernel_header())
    assert not conv.threaded      # no barrier / SIMD function: threads run in turn
    attn = build.EmuKernel("attn_verify", KERNELS["attn_verify"].inputs, ("o",),
                           kernel_body("attn_verify"))
    inst = build.instance_for(attn, list(attn_inputs(1, 1, 32, 0)) + [np.int32(0), np.ones(16, np.float32)],
                              [np.float32], [("HD", 32), ("ROPE_Q", 0)])
    src = attn.function_source("f", inst.in_specs, inst.out_dtypes, inst.template)
    assert "  const constant int32_t& pos0 [[buffer(4)]],\n" in src   # 0-d input: by reference
    names = [ln.split("[[")[-1].rstrip("]) {,\n") for ln in src.splitlines() if ln.startswith("  uint")]
    assert names == ["simdgroup_index_in_threadgroup", "thread_index_in_simdgroup",
                     "thread_index_in_threadgroup", "threadgroup_position_in_grid"]  # MLX's order


# ---- GDN ----------------------------------------------------------------------------------
@pytest.mark.parametrize("M,d", CONV_CASES)
def test_conv_step(ops, M, d):
    r = _rng(M + d)
    x, tail, conv = (r.standard_normal(s).astype(np.float32) for s in ((M, d), (2, d), (3, d)))
    u, tails = ops.conv_step(x, tail, conv)
    ru, rt = ref_conv(x, tail, conv)
    assert u.shape == (M, d) and tails.shape == (M, 2, d)
    assert np.abs(u - ru).max() < 2e-6
    assert np.array_equal(tails, rt.astype(np.float32))     # a copy: exact


@pytest.mark.parametrize("M,H,hd", DELTA_CASES)
def test_delta_rule(ops, M, H, hd):
    q, k, v, a, b, S0 = delta_inputs(M, H, hd, seed=M * H)
    o, S_all = ops.delta_rule(q, k, v, a, b, S0)
    ro, rS = ref_delta(q, k, v, a, b, S0)
    assert o.shape == (M, H, hd) and S_all.shape == (M, H, hd, hd)
    assert np.abs(ro).max() > 0.05 and np.isfinite(S_all).all()
    assert np.abs(o - ro).max() < 1e-5
    assert np.abs(S_all - rS).max() < 1e-5


@pytest.mark.parametrize("M,H,hd", DELTA_CASES)
def test_delta_rule_fused_norm_and_gates(ops, M, H, hd):
    r = _rng(100 + M)
    q_raw = (3 * r.standard_normal((M, H, hd))).astype(np.float32)
    k_raw = (0.5 * r.standard_normal((M, H, hd))).astype(np.float32)
    _, _, v, _, _, S0 = delta_inputs(M, H, hd, seed=7)
    dl, bl = r.standard_normal(H).astype(np.float32), r.standard_normal(H).astype(np.float32)
    o, S_all = ops.delta_rule_fused(q_raw, k_raw, v, dl, bl, S0)
    ro, rS = ref_delta(_unit(q_raw), _unit(k_raw), v, _sigmoid(dl), _sigmoid(bl), S0)
    assert np.abs(o - ro).max() < 1e-5
    assert np.abs(S_all - rS).max() < 1e-5


def test_gdn_batch_equals_token_by_token(fib):
    """The strict-mode property at kernel level: M tokens at once == M calls of one token."""
    M, H, hd = 5, 3, 64
    q, k, v, a, b, S0 = delta_inputs(M, H, hd, seed=3)
    o, S_all = fib.delta_rule(q, k, v, a, b, S0)
    S = S0
    for j in range(M):
        oj, Sj = fib.delta_rule(q[j:j + 1], k[j:j + 1], v[j:j + 1], a, b, S)
        assert np.array_equal(oj[0], o[j]) and np.array_equal(Sj[0], S_all[j])
        S = Sj[0]
    r = _rng(4)
    x, tail, conv = (r.standard_normal(s).astype(np.float32) for s in ((M, 100), (2, 100), (3, 100)))
    u, tails = fib.conv_step(x, tail, conv)
    t = tail
    for j in range(M):
        uj, tj = fib.conv_step(x[j:j + 1], t, conv)
        assert np.array_equal(uj[0], u[j]) and np.array_equal(tj[0], tails[j])
        t = tj[0]


# ---- attention ----------------------------------------------------------------------------
@pytest.mark.parametrize("M,H,hd,pos0", ATTN_CASES)
def test_attend(ops, M, H, hd, pos0):
    q, kc, vc = attn_inputs(M, H, hd, pos0, seed=pos0 + M)
    o = ops.attend(q, kc, vc, pos0, M)
    ref = ref_attend(q, kc, vc, pos0)
    assert o.shape == (M, H, hd) and np.isfinite(o).all()
    assert np.abs(o - ref).max() < 2e-5


@pytest.mark.parametrize("M,H,hd,pos0", ATTN_CASES)
def test_attend_rope_fused(ops, M, H, hd, pos0):
    r = _rng(200 + M)
    q_raw = (2 * r.standard_normal((M, H, hd))).astype(np.float32)
    _, kc, vc = attn_inputs(M, H, hd, pos0, seed=9)
    inv_freq = rope_inv_freq(hd, 10000.0)
    o = ops.attend_rope(q_raw, kc, vc, pos0, M, inv_freq)
    ref = ref_attend(ref_rope(_unit(q_raw), pos0, inv_freq), kc, vc, pos0)
    # the angle rounds alike here and in the kernel; cos/sin of a ~1e3 rad float32 angle differ by ulps
    assert np.abs(o - ref).max() < 5e-5


@pytest.mark.parametrize("M,H,hd,pos0", [(17, 2, 32, 3), (9, 1, 128, 40)])
def test_attend_batch_equals_query_by_query(fib, M, H, hd, pos0):
    """Whatever tile and SIMD group a query lands in, it gets the bits of a lone query
    (plain and with the fused q norm + RoPE)."""
    q, kc, vc = attn_inputs(M, H, hd, pos0, seed=5)
    inv_freq = rope_inv_freq(hd, 10000.0)
    o, orope = fib.attend(q, kc, vc, pos0, M), fib.attend_rope(2 * q, kc, vc, pos0, M, inv_freq)
    for j in range(M):
        assert np.array_equal(fib.attend(q[j:j + 1], kc, vc, pos0 + j, 1)[0], o[j])
        assert np.array_equal(fib.attend_rope(2 * q[j:j + 1], kc, vc, pos0 + j, 1, inv_freq)[0], orope[j])


# ---- against the model's MLX-ops path ------------------------------------------------------
def test_matches_model_mlx_ops(fib):
    from spel_mlx.model import MLXOps
    ref = MLXOps()
    M, H, hd = 5, 3, 64
    q, k, v, a, b, S0 = delta_inputs(M, H, hd, seed=11)
    o, S_all = fib.delta_rule(q, k, v, a, b, S0)
    mo, mS = ref.delta_rule(*(mx.array(t) for t in (q, k, v, a, b, S0)))
    mS = mx.stack(mS)                           # MLXOps: the M states as separate arrays
    assert np.abs(o - np.array(mo)).max() < 1e-5 and np.abs(S_all - np.array(mS)).max() < 1e-5
    r = _rng(12)
    x, tail, conv = (r.standard_normal(s).astype(np.float32) for s in ((17, 48), (2, 48), (3, 48)))
    u, tails = fib.conv_step(x, tail, conv)
    mu, mt = ref.conv_step(*(mx.array(t) for t in (x, tail, conv)))
    assert np.abs(u - np.array(mu)).max() < 2e-6 and np.array_equal(tails, np.array(mt))
    for M, H, hd, pos0 in ATTN_CASES:
        q, kc, vc = attn_inputs(M, H, hd, pos0, seed=13)
        n = pos0 + M
        mo = ref.attend(mx.array(q), mx.array(kc[:n]), mx.array(vc[:n]), pos0, M)
        assert np.abs(fib.attend(q, kc, vc, pos0, M) - np.array(mo)).max() < 2e-5


# ---- ternary ------------------------------------------------------------------------------
@pytest.mark.parametrize("N,R,C", TERN_CASES)
def test_ternary_matmul_bit_exact(ops, N, R, C):
    packed, t, s, x = tern_inputs(N, R, C, seed=N * R)
    x[0, :] = 0.0 if N > 1 else x[0, :]          # an all-zero vector gives zeros
    y = ops.ternary_matmul(x, packed, s)
    assert y.shape == (N, R)
    for n in range(N):
        ref = quant.gemv_ternary_ref(packed, s, x[n], cols=C)
        assert np.array_equal(y[n], ref), n       # integer dot products: bit-exact
    xq, sx = ops.quantize_activations(x)
    cp = quant.packed_row_bytes(C) * 4
    rq, rs = quant.quantize_activation(x)
    assert xq.shape == (N, cp) and np.array_equal(xq[:, :C], rq) and not xq[:, C:].any()
    assert np.array_equal(sx, rs)
    y1 = ops.ternary_matmul(x[-1], packed.view(np.uint32), s)     # 1-D x, uint32 view
    assert np.array_equal(y1, y[-1])


@pytest.mark.parametrize("N,R,C", TERN_CASES)
def test_q8_matmul_bit_exact(ops, N, R, C):
    r = _rng(60 + N)
    wf = r.standard_normal((R, C)).astype(np.float32)
    q, s = quant.quantize_q8(wf)
    x = r.standard_normal((N, C)).astype(np.float32)
    y = ops.q8_matmul(x, q, s)
    assert y.shape == (N, R)
    for n in range(N):
        assert np.array_equal(y[n], quant.gemv_q8_ref(q, s, x[n])), n
    assert np.array_equal(ops.q8_matmul(x[0], formats.pad_q8_rows(q), s), y[0])


def test_mlx_affine_2bit_represents_ternary_exactly():
    packed, t, s, x = tern_inputs(3, 24, 130, seed=21)
    w, scales, biases = formats.ternary_to_mlx_affine(packed, s)
    cp = packed.shape[1] * 4
    assert w.dtype == np.uint32 and w.shape == (24, cp // 16) and scales.shape == (24, cp // 64)
    deq = np.array(mx.dequantize(mx.array(w), mx.array(scales), mx.array(biases), group_size=64, bits=2))
    want = np.zeros((24, cp), np.float32)
    want[:, :130] = t.astype(np.float32) * s[:, None]
    assert np.array_equal(deq, want)              # codes {0,1,2} x s - s: exact
    xp = np.zeros((3, cp), np.float32)
    xp[:, :130] = x
    y = np.array(formats.mlx_affine_ternary_matmul(mx.array(xp), mx.array(w), mx.array(scales),
                                                   mx.array(biases)))
    assert np.abs(y - xp @ want.T).max() < 1e-4


# ---- the harness itself ------------------------------------------------------------------------
def test_os_threads_and_fibers_agree_bit_for_bit(ops):
    fib = EmulatedOps(numpy_out=True, lanes="fibers")
    args = delta_inputs(17, 1, 32, seed=40)
    for a, b in zip(ops.delta_rule(*args), fib.delta_rule(*args)):
        assert np.array_equal(a, b)
    q, kc, vc = attn_inputs(5, 3, 64, 20, seed=41)
    assert np.array_equal(ops.attend(q, kc, vc, 20, 5), fib.attend(q, kc, vc, 20, 5))
    packed, _, s, x = tern_inputs(5, 64, 192, seed=42)
    assert np.array_equal(ops.ternary_matmul(x, packed, s), fib.ternary_matmul(x, packed, s))


@pytest.mark.parametrize("lanes", ["threads", "fibers"])
def test_emulator_reports_divergent_simd_call(monkeypatch, lanes):
    require_or_skip(HAVE_CXX, "g++/clang++ not found")
    body = ("if (thread_index_in_simdgroup < 3) { return; }\n"
            "y[thread_position_in_grid.x] = metal::simd_sum(x[thread_position_in_grid.x]);")
    k = build.EmuKernel("divergent", ("x",), ("y",), body)
    monkeypatch.setenv("METAL_EMU_TIMEOUT_S", "1")
    with pytest.raises(build.EmulationError, match="not reached by every thread"):
        build.launch(build.EmuLibrary(), {"divergent": k}, k, [np.ones(64, np.float32)], [],
                     (64, 1, 1), (64, 1, 1), [(64,)], [np.float32], lanes=lanes)


@pytest.mark.parametrize("lanes", ["threads", "fibers"])
def test_emulator_barrier_and_simd_semantics(lanes):
    """threadgroup memory is shared within a group, barriers order it, SIMD ops see 32 lanes,
    partial edge groups run with their real size, and unwritten outputs stay NaN."""
    require_or_skip(HAVE_CXX, "g++/clang++ not found")
    body = """
  threadgroup float sh[96];
  const uint t = thread_index_in_threadgroup;
  sh[t] = x[thread_position_in_grid.x];
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  const float mirrored = sh[threads_per_threadgroup.x - 1 - t];
  const float lane0 = metal::simd_broadcast(mirrored, 0);
  const float total = metal::simd_sum(1.0f);
  const uint idx = thread_position_in_grid.x;
  if (idx % 7 != 6) {
    y[idx] = mirrored + 1000.0f * lane0 + 1e6f * total;
  }
"""
    k = build.EmuKernel("semantics", ("x",), ("y",), body)
    x = np.arange(160, dtype=np.float32)
    (y,) = build.launch(build.EmuLibrary(), {"semantics": k}, k, [x], [], (160, 1, 1), (96, 1, 1),
                        [(160,)], [np.float32], lanes=lanes)
    want = np.empty(160)
    for g0, n in ((0, 96), (96, 64)):                    # second group is partial: 64 threads
        for t in range(n):
            lane0_t = t - t % 32
            want[g0 + t] = (x[g0 + n - 1 - t] + 1000 * x[g0 + n - 1 - lane0_t] + 1e6 * 32)
    written = np.arange(160) % 7 != 6
    assert np.array_equal(y[written], want[written].astype(np.float32))
    assert np.isnan(y[~written]).all()


# ---- selection ----------------------------------------------------------------------------------
def test_select_and_describe(monkeypatch):
    monkeypatch.delenv("SPEL_KERNELS", raising=False)
    monkeypatch.setattr(backends, "_selected", None)
    auto = backends.resolve()
    from spel_mlx.model import cpu_ops
    assert auto == ("metal" if executors.metal_available() else "cpu" if cpu_ops.available() else "mlx")
    assert backends.describe().startswith(auto)
    with pytest.raises(ValueError, match="SPEL_KERNELS"):
        backends.resolve("cuda")
    monkeypatch.setenv("SPEL_KERNELS", "emulated")
    assert backends.resolve() == "emulated"
    from spel_mlx.model import MLXOps
    assert type(backends.select("mlx")) is MLXOps
    assert backends.describe().startswith("mlx (selected)")
    if not executors.metal_available():
        with pytest.raises(RuntimeError, match="Metal is not available"):
            MetalOps()
    if HAVE_CXX:
        assert isinstance(backends.select("emulated"), EmulatedOps)
        assert backends.describe().startswith("emulated (selected)")


# ---- the model's fidelity properties with the kernels' code path ----------------------------
def test_model_strict_fast_and_rollback_with_emulated_kernels(ops):
    from spel_mlx.config import ModelConfig
    from spel_mlx.model import SpelModel, init_weights
    cfg = ModelConfig(d_model=48, n_layers=3, n_heads=2, head_dim=32, d_ff=64, vocab=32,
                      max_seq=96, attn_period=3, draft_map=(0, 2), spec_k=4)
    w = init_weights(cfg, seed=3)
    ref_model = SpelModel.from_weights(cfg, w)
    model = SpelModel.from_weights(cfg, w)
    model.set_ops(EmulatedOps(lanes="fibers"))   # ~100 dispatches: fibers keep it fast
    assert model.compile is False              # requires_eager: the emulation reads host arrays
    r = _rng(30)
    prompt, batch, after = (r.integers(0, cfg.vocab, n) for n in (9, 5, 4))

    def state_after(m, toks):
        st = m.new_state()
        m.prefill(toks, st)        # fast chunks: the same prefix state for every branch below
        return st

    a = state_after(model, prompt)
    strict = np.array(model.forward(batch, a, strict=True))
    b = state_after(model, prompt)
    singles = []
    for tok in batch:
        singles.append(np.array(model.forward([tok], b)))
        b.commit(1)
    singles = np.concatenate(singles)
    assert np.array_equal(strict.view(np.uint32), singles.view(np.uint32))   # bit-identical

    c = state_after(model, prompt)
    fast = np.array(model.forward(batch, c, strict=False))
    assert (fast.argmax(-1) == strict.argmax(-1)).all() and np.abs(fast - strict).max() < 1e-4

    ref = np.array(ref_model.forward(batch, state_after(ref_model, prompt), strict=True))
    assert np.abs(strict - ref).max() < 1e-4   # same function as the MLX-ops path

    for n in (1, 3):                           # rollback: commit n of 5, then continue
        s1 = state_after(model, prompt)
        model.forward(batch, s1, strict=True)
        s1.commit(n)
        got = np.array(model.forward(after, s1, strict=True))
        s2 = state_after(model, np.concatenate([prompt, batch[:n]]))
        want = np.array(model.forward(after, s2, strict=True))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


# ---- MetalOps' own plumbing, with mx.fast.metal_kernel stood in for by the emulation ----------
def test_metal_ops_calls_metal_kernel_correctly(ops, monkeypatch):
    """MetalOps is only exercised for real on Apple GPUs; here mx.fast.metal_kernel is replaced
    by a stand-in that checks what MetalOps passes (body, header, names, template, mx dtypes)
    and runs it on the emulation, so the mx-array path (0-d pos0, uint8 -> uint32 view,
    fallbacks) is tested end to end."""
    ex = executors.EmuExecutor(lanes="fibers")
    seen = []

    def fake_metal_kernel(name, input_names, output_names, source, header="",
                          ensure_row_contiguous=True, atomic_outputs=False, compile_options=None):
        k = ex.kernels[name[len("spel_"):]]
        assert (tuple(input_names), tuple(output_names), source, header) == \
            (k.input_names, k.output_names, k.source, k.header)
        assert ensure_row_contiguous and not atomic_outputs

        def call(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes, **kw):
            assert all(isinstance(a, mx.array) for a in inputs)
            seen.append((k.name, [(a.dtype, a.ndim) for a in inputs]))
            np_dt = [np.dtype({mx.float32: np.float32, mx.int8: np.int8}[d]) for d in output_dtypes]
            outs = build.launch(ex.library, ex.kernels, k, [np.array(a) for a in inputs], template,
                                grid, threadgroup, output_shapes, np_dt, lanes="fibers")
            return [mx.array(o) for o in outs]
        return call

    monkeypatch.setattr(executors, "metal_available", lambda: True)
    monkeypatch.setattr(mx.fast, "metal_kernel", fake_metal_kernel)
    metal = MetalOps()

    from spel_mlx.config import ModelConfig
    from spel_mlx.model import SpelModel, init_weights
    cfg = ModelConfig(d_model=48, n_layers=3, n_heads=2, head_dim=32, d_ff=64, vocab=32,
                      max_seq=96, attn_period=3, draft_map=(0, 2), spec_k=4)
    w = init_weights(cfg, seed=5)
    ref_model, model = SpelModel.from_weights(cfg, w), SpelModel.from_weights(cfg, w)
    metal.requires_eager = True                 # the stand-in reads arrays on the host
    model.set_ops(metal)
    assert model.compile is False
    toks = _rng(50).integers(0, cfg.vocab, 12)
    got = np.array(model.forward(toks[:5], model.new_state()))
    want = np.array(ref_model.forward(toks[:5], ref_model.new_state()))
    assert np.abs(got - want).max() < 1e-4
    assert ("attn_verify", [(mx.float32, 3), (mx.float32, 3), (mx.float32, 3), (mx.int32, 0),
                            (mx.float32, 1)]) in seen
    assert {name for name, _ in seen} == {"gdn_conv", "gdn_delta", "attn_verify"}

    packed, _, s, x = tern_inputs(5, 64, 192, seed=51)
    y = np.array(metal.ternary_matmul(mx.array(x), mx.array(packed), mx.array(s)))
    assert np.array_equal(y, ops.ternary_matmul(x, packed, s))
    assert seen[-1][1][0] == (mx.uint32, 2)     # the uint8 rows reach the kernel as uint32 words


def test_metal_ops_trace_inside_mx_compile(monkeypatch):
    """Inside the model's mx.compile'd step MetalOps must never read an array on the host
    (pos0 is traced).  A stand-in kernel returning zeros of the declared shapes is enough."""
    calls = []

    def fake_metal_kernel(name, input_names, output_names, source, header="", **kw):
        def call(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes, **kw2):
            calls.append(name)
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]
        return call

    monkeypatch.setattr(executors, "metal_available", lambda: True)
    monkeypatch.setattr(mx.fast, "metal_kernel", fake_metal_kernel)
    from spel_mlx.config import ModelConfig
    from spel_mlx.model import SpelModel, init_weights
    cfg = ModelConfig(d_model=48, n_layers=3, n_heads=2, head_dim=32, d_ff=64, vocab=32,
                      max_seq=96, attn_period=3, draft_map=(0, 2), spec_k=4)
    model = SpelModel.from_weights(cfg, init_weights(cfg, seed=1))
    model.set_ops(MetalOps())
    assert model.compile is True
    st = model.new_state()
    logits = model.forward([1, 2, 3], st)
    st.commit(3)
    logits = model.forward([4], st)            # pos0 = 3 arrives as a traced int32 scalar
    assert logits.shape == (1, cfg.vocab) and np.isfinite(np.array(logits)).all()
    assert {"spel_gdn_conv", "spel_gdn_delta", "spel_attn_verify"} <= set(calls)
