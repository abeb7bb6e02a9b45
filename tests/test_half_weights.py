"""float16 weight blocks (SPEL_HALF_WEIGHTS): a matrix whose every weight is exactly a
binary16 value is read by the fused CPU products as binary16, widened exactly, so a pass
gives the bits of float32 blocks; a matrix with one weight that is not is kept float32."""
import os
import subprocess
import sys

import numpy as np
import pytest

import spel_mlx  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
from spel_mlx import model as model_mod
from spel_mlx.config import ModelConfig
from spel_mlx.model import SpelModel, cpu_ops, init_weights

if os.environ.get("SPEL_REQUIRE_CPU_EXT") != "1" and not cpu_ops.available():
    pytest.skip("spel_mlx._spel_cpu not built: " + cpu_ops.status()[1], allow_module_level=True)

E = cpu_ops._spel_cpu
CFG = ModelConfig(d_model=128, n_layers=4, n_heads=2, head_dim=64, d_ff=192, vocab=96,
                  max_seq=200, attn_period=2, draft_map=(0, 1), spec_k=4)


def _halves(shape, seed) -> np.ndarray:
    """float32 weights that are all binary16 values: normals, subnormals, +-0, the largest."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * 0.05).astype(np.float16)
    flat = w.reshape(-1)
    flat[:8] = np.float16([6e-8, -6e-8, 3e-5, -1e-6, 0.0, -0.0, 65504.0, -65504.0])
    return w.astype(np.float32)


def _lin(w: np.ndarray):
    lin = model_mod.Linear(w.shape[1], w.shape[0])
    lin.weight = mx.array(w)
    return lin


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint32)


def test_exactly_half_is_a_property_of_every_weight():
    w = _halves((128, 64), 1)
    assert _lin(w).exactly_half()
    for bad in (1.0 + 2.0 ** -12, 65520.0, np.nan, 1e-9):   # a rounded mantissa, overflow, NaN, underflow
        v = w.copy()
        v[3, 5] = bad
        assert not _lin(v).exactly_half(), bad
    assert not _lin(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)).exactly_half()


def test_the_fast_half_check_agrees_with_the_round_trip():
    """_spel_cpu.exactly_half answers what MLX's float16 round trip does, value by value:
    every binary16 value widened and its float32 neighbours, float32 subnormals, NaNs,
    infinities, overflow; and over a whole weight (negative control: one value off)."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    bits = halves.view(np.uint32)
    rng = np.random.default_rng(3)
    pick = rng.choice(bits.size, 6000, replace=False)
    extra = np.array([0x00000001, 0x80000001, 0x007fffff, 0x7f800001, 0xffc00000, 0x477ff000, 0x477fe001,
                      0x33800000, 0x33000000, 0x337fffff, 0x38800000, 0x387fe000, 0x387fc000], np.uint32)
    cand = np.concatenate([bits[pick], bits[pick] + 1, bits[pick] - 1, extra,
                           rng.integers(0, 1 << 32, 3000, dtype=np.uint64).astype(np.uint32)])
    vals = cand.view(np.float32)
    a = mx.array(vals)
    want = np.array(a.astype(mx.float16).astype(mx.float32) == a)
    got = np.array([E.exactly_half(mx.array(vals[i:i + 1])) for i in range(vals.size)])
    assert want.any() and not want.all()
    np.testing.assert_array_equal(got, want)
    w = _halves((128, 64), 1)
    assert E.exactly_half(mx.array(w)) and _lin(w).exactly_half(E.exactly_half)
    w[127, 63] = 1.0 + 2.0 ** -12
    assert not E.exactly_half(mx.array(w)) and not _lin(w).exactly_half(E.exactly_half)


@pytest.mark.parametrize("mode", ["auto", "reference", "blas"])
def test_half_blocks_give_the_bits_of_float32_blocks(mode):
    """linear over float16 blocks equals linear over the float32 blocks of the same
    values, bit for bit, in every product mode (tiles, their fmaf reference, the BLAS
    over a widened copy), for M = 1, 5, 13 (row groups of 6 and tails)."""
    w = _halves((192, 64), 2)
    b32 = mx.array(np.ascontiguousarray(w.reshape(3, 64, 64).transpose(0, 2, 1)))   # [nb, in, rb]
    b16 = b32.astype(mx.float16)
    mx.eval(b32, b16)
    old = E.set_linear(mode)
    try:
        for M in (1, 5, 13):
            x = mx.array(np.random.default_rng(M).standard_normal((M, 64)).astype(np.float32))
            y32, y16 = E.linear(x, b32), E.linear(x, b16)
            assert np.array_equal(_bits(y16), _bits(y32)), (mode, M)
            want = np.asarray(x, np.float64) @ w.astype(np.float64).T
            assert np.abs(np.asarray(y16) - want).max() < 1e-2 * np.abs(want).max()
    finally:
        E.set_linear(old)


def test_other_dtypes_are_a_clear_error():
    with pytest.raises(ValueError, match="float32 or float16"):
        E.linear(mx.zeros((1, 8)), mx.zeros((2, 8, 16), mx.bfloat16))


def _model(weights, half: bool):
    m = SpelModel.from_weights(CFG, weights)
    m.set_ops(cpu_ops.CPUFusedOps(half_weights=half))
    return m


def _passes(model):
    """Logits of M = 1, 5, 9, 17 passes after a 60-token prompt (nothing committed)."""
    st = model.new_state(ring=18)
    model.prefill(list(np.random.default_rng(4).integers(0, CFG.vocab, 60)), st)
    out = []
    for M in (1, 5, 9, 17):
        out.append(np.array(model.forward(list(range(3, 3 + M)), st)))
        st.discard()
    return out


def _block_dtypes(model) -> set:
    lins = [lin for blk in model.stack_layers("target") for lin in blk.linears()] + [model.lm_head]
    return {lin.blocks(model.ops.layout_rows(5)).dtype for lin in lins}


@pytest.fixture(params=["avx512", "avx2"])
def tiles(request):
    """The FMA-chain tiles of one SIMD level, where this CPU has them."""
    old = E.set_simd_level(request.param)
    try:
        if E.simd() != request.param or not E.fma_chain_linear():
            pytest.skip(f"this CPU has no {request.param} tiles: the products are the BLAS, "
                        "which reads float32 blocks")
        yield request.param
    finally:
        E.set_simd_level(old)


def test_a_float16_model_passes_equal_its_float32_blocks(tiles):
    exact = {k: v.astype(np.float16).astype(np.float32) for k, v in init_weights(CFG, seed=5).items()}
    half, full = _model(exact, True), _model(exact, False)
    got, want = _passes(half), _passes(full)
    assert _block_dtypes(half) == {mx.float16} and _block_dtypes(full) == {mx.float32}
    for g, w in zip(got, want):
        assert np.array_equal(g.view(np.uint32), w.view(np.uint32))


def _layouts(model) -> list:
    lins = [lin for blk in model.stack_layers("target") for lin in blk.linears()] + [model.lm_head]
    return [a for lin in lins for a in lin.layouts()]


def test_the_blocks_are_the_only_layout_kept():
    """After passes of 1-17 rows the fused products' blocks are every layout a Linear
    keeps: no contiguous float32 W^T beside them (a second copy of the weights that no
    product reads; the shipped model's was 27 MB of resident memory)."""
    w = init_weights(CFG, seed=7)
    for model in ([_model(w, False)] + ([_model({k: v.astype(np.float16).astype(np.float32) for k, v in w.items()},
                                                True)] if E.fma_chain_linear() else [])):
        _passes(model)
        kept = _layouts(model)
        assert kept and all(a.ndim == 3 for a in kept)
        assert {a.dtype for a in kept} == ({mx.float16} if model.ops.half_weights and E.fma_chain_linear()
                                           else {mx.float32})


def test_inexact_weights_keep_float32_blocks(tiles):
    """The check matters: the random float32 model keeps float32 blocks, and the same
    weights forced through float16 blocks would change its logits (negative control)."""
    w = init_weights(CFG, seed=6)
    model = _model(w, True)
    want = _passes(model)
    assert _block_dtypes(model) == {mx.float32}
    lin = model.layers[0].mlp.w1
    lin.exactly_half = lambda test=None: True   # lie about one matrix
    lin.__dict__.pop("_views", None)
    model._compiled.clear()
    got = _passes(model)
    assert lin.blocks(5).dtype == mx.float16
    assert not np.array_equal(got[0], want[0])


def test_the_shipped_model_reads_float16_blocks(tiles):
    from spel_mlx import load
    lm, _ = load()
    st = lm.model.new_state(ring=5)
    mx.eval(lm.model.forward([1, 2], st))
    assert _block_dtypes(lm.model) == {mx.float16}


def test_the_switch():
    code = "import spel_mlx; from spel_mlx.model import cpu_ops; print(cpu_ops.CPUFusedOps().half_weights)"
    for value, want in (("0", "False"), ("1", "True"), ("", "True")):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "SPEL_HALF_WEIGHTS": value}, timeout=120)
        assert r.stdout.strip() == want, r.stderr
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "SPEL_HALF_WEIGHTS": "yes"}, timeout=120)
    assert r.returncode != 0 and "SPEL_HALF_WEIGHTS='yes'" in r.stderr
