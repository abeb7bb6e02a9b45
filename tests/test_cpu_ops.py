"""The fused CPU primitives (spel_mlx._spel_cpu via spel_mlx.model.cpu_ops) against
MLXOps and the float64 numpy reference, alone and inside the model."""
import os

import numpy as np
import pytest

import spel_mlx  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
from spel_mlx import model as model_mod
from spel_mlx.config import ModelConfig
from spel_mlx.model import MLXOps, SpelModel, cpu_ops, init_weights, l2_normalize, silu_mul
from spel_mlx.model.delta_rule import delta_rule_recurrent
from spel_mlx.model.linear import row_block

from spel_mlx.reference import forward_reference

if os.environ.get("SPEL_REQUIRE_CPU_EXT") != "1" and not cpu_ops.available():
    pytest.skip("spel_mlx._spel_cpu not built: " + cpu_ops.status()[1], allow_module_level=True)

REF = MLXOps()


def _recurrence(q, k, v, a, beta, S0):
    """The delta rule token by token: o and the stacked states."""
    o, states = delta_rule_recurrent(q, k, v, a, beta, S0)
    return o, mx.stack(states)


def test_built_for_this_mlx():
    ok, why = cpu_ops.status()
    assert ok, why
    assert isinstance(model_mod.auto_ops(), cpu_ops.CPUFusedOps)


@pytest.fixture(scope="module")
def ops():
    return cpu_ops.CPUFusedOps()


def _rand(shape, seed, scale=1.0):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale)


def _diff(a, b):
    return float(mx.abs(a - b).max())


@pytest.mark.parametrize("M,H,hd", [(1, 4, 64), (5, 2, 32), (17, 3, 30)])
def test_delta_rule_matches_mlx_ops_and_float64(ops, M, H, hd):
    q, k = l2_normalize(_rand((M, H, hd), 1)), l2_normalize(_rand((M, H, hd), 2))
    v = _rand((M, H, hd), 3)
    a, beta = mx.sigmoid(_rand((H,), 4)), mx.sigmoid(_rand((H,), 5))
    S0 = _rand((H, hd, hd), 6, 0.3)
    o, S_all = ops.delta_rule(q, k, v, a, beta, S0)
    o_ref, S_ref = _recurrence(q, k, v, a, beta, S0)
    assert o.shape == (M, H, hd) and S_all.shape == (M, H, hd, hd)
    assert _diff(o, o_ref) < 1e-5 and _diff(S_all, S_ref) < 1e-5
    # float64 recurrence
    qn, kn, vn, an, bn, S = (np.asarray(t, np.float64) for t in (q, k, v, a, beta, S0))
    for t in range(M):
        for h in range(H):
            S[h] = an[h] * S[h] + bn[h] * np.outer(vn[t, h] - S[h] @ kn[t, h], kn[t, h])
            assert np.abs(np.asarray(o)[t, h] - S[h] @ qn[t, h] / np.sqrt(hd)).max() < 1e-5
        assert np.abs(np.asarray(S_all)[t] - S).max() < 1e-5


def test_gdn_delta_fuses_the_l2_norm(ops):
    """From the raw wqkv projection: unit q, k (model.l2_normalize) and the delta rule."""
    M, H, hd = 5, 4, 64
    qkv = _rand((M, 3 * H * hd), 7, 2.0)
    a, beta, S0 = mx.sigmoid(_rand((H,), 8)), mx.sigmoid(_rand((H,), 9)), _rand((H, hd, hd), 10, 0.3)
    o, S_all, q, k = ops.gdn_delta(qkv, a, beta, S0)
    parts = qkv.reshape(M, 3, H, hd)
    qn, kn = l2_normalize(parts[:, 0]), l2_normalize(parts[:, 1])
    assert _diff(q, qn) < 1e-6 and _diff(k, kn) < 1e-6
    o_ref, S_ref = _recurrence(qn, kn, parts[:, 2], a, beta, S0)
    assert _diff(o, o_ref) < 1e-5 and _diff(S_all, S_ref) < 1e-5


def test_delta_rule_reads_strided_inputs(ops):
    M, H, hd = 5, 2, 32
    qkv = _rand((M, 3, H, hd), 8)
    qk = l2_normalize(qkv[:, 0:2])
    q, k, v = qk[:, 0], qk[:, 1], qkv[:, 2]              # views with row strides 3*H*hd
    a, beta, S0 = mx.sigmoid(_rand((H,), 9)), mx.sigmoid(_rand((H,), 10)), _rand((H, hd, hd), 11, 0.3)
    got = ops.delta_rule(q, k, v, a, beta, S0)
    want = _recurrence(mx.contiguous(q), mx.contiguous(k), mx.contiguous(v), a, beta, S0)
    assert _diff(got[0], want[0]) < 1e-5 and _diff(got[1], want[1]) < 1e-5


@pytest.mark.parametrize("M", [1, 5])
def test_conv_matches_mlx_ops(ops, M):
    d = 100
    x, tail, conv = _rand((M, d), 1), _rand((2, d), 2), _rand((3, d), 3)
    u, tails = ops.conv_step(x, tail, conv)
    u_ref, tails_ref = REF.conv_step(x, tail, conv)
    assert _diff(u, u_ref) < 1e-6 and _diff(tails, tails_ref) == 0


@pytest.mark.parametrize("M,pos0,W", [(1, 0, 64), (5, 37, 64), (5, 123, 128), (17, 400, 512),
                                      (5, 1500, 2048), (1, 3999, 4096)])   # 3-8 chunks merged
def test_attend_matches_mlx_ops_and_masks_the_future(ops, M, pos0, W):
    H, hd = 3, 32
    q = l2_normalize(_rand((M, H, hd), 1))
    kc, vc = l2_normalize(_rand((W, H, hd), 2)), _rand((W, H, hd), 3)
    pos = mx.array(pos0, dtype=mx.int32)
    got = ops.attend(q, kc, vc, pos, M)
    assert _diff(got, REF.attend(q, kc, vc, pos, M)) < 1e-5
    assert _diff(ops.attend(q, kc, vc, pos0, M), got) == 0          # int position too
    if pos0 + M < W:                                                  # rows past the last query
        kc2 = mx.concatenate([kc[:pos0 + M], kc[pos0 + M:] + 5.0])
        assert _diff(ops.attend(q, kc2, vc, pos, M), got) == 0


@pytest.mark.parametrize("M,pos0", [(1, 900), (5, 700), (5, 252), (5, 1020)])
def test_attend_over_a_long_cache_keeps_its_bits(ops, scalar_and_simd, M, pos0):
    """Past 256 keys the walk first reads each key block in address order (attend_blocked.cpp,
    touch_block), past 512 keys chunks of 512 are merged (1020: rows on both sides of a chunk
    edge, 252: of 256): the SIMD variant still gives the scalar reference's bits, and every row
    of a batch the bits of that query alone."""
    H, hd, W = 4, 64, 1024
    q = l2_normalize(_rand((M, H, hd), 1))
    kc, vc = l2_normalize(_rand((W, H, hd), 2)), _rand((W, H, hd), 3)
    ref, got = scalar_and_simd(lambda: np.asarray(ops.attend(q, kc, vc, pos0, M)))
    assert np.array_equal(ref, got)
    for m in range(M):
        alone = np.asarray(ops.attend(q[m:m + 1], kc, vc, pos0 + m, 1))
        assert np.array_equal(alone[0], got[m])


@pytest.mark.parametrize("simd", [True, False])
@pytest.mark.parametrize("M,pos0", [(1, 3000), (5, 700), (1, 510)])   # 510: 511 keys, one chunk: not shared
def test_attention_shared_with_the_helper_thread_keeps_its_bits(ops, M, pos0, simd):
    """Past 512 keys attention's key chunks are shared with a helper thread (helper.cpp): the
    bits are those of the caller alone (SIMD variant or scalar reference), and the helper
    does take chunks (2+ cores)."""
    from spel_mlx import _spel_cpu as E
    from spel_mlx.decoding.ahead import usable_cpus
    H, hd, W = 4, 64, 4096
    q = l2_normalize(_rand((M, H, hd), 1))
    kc, vc = l2_normalize(_rand((W, H, hd), 2)), _rand((W, H, hd), 3)
    old = E.set_helper(False)
    try:
        E.set_simd(simd)
        alone = np.asarray(ops.attend(q, kc, vc, pos0, M))
        E.set_helper(True)
        before = E.helper_items_run()
        runs = []
        while len(runs) < 20 or (E.helper_items_run() == before and len(runs) < 2000):
            runs.append(np.asarray(ops.attend(q, kc, vc, pos0, M)))
        taken = E.helper_items_run() - before
    finally:
        E.set_helper(old)
        E.set_simd(True)
    for got in runs:
        assert np.array_equal(got, alone)
    if pos0 + M <= 512 or usable_cpus() < 2:
        assert taken == 0
    else:
        assert taken > 0    # calls of 2-6 chunks each until the helper wakes in time for one


def test_rms_norm_and_gate(ops):
    x, w = _rand((5, 256), 1, 3.0), _rand((256,), 2)
    assert _diff(ops.rms_norm(x, w, 1e-5), mx.fast.rms_norm(x, w, 1e-5)) < 2e-6
    a, b = _rand((5, 768), 3, 10.0), _rand((5, 768), 4)
    assert _diff(ops.silu_mul(a, b), silu_mul(a, b)) == 0             # the same formula, bit for bit
    a64 = np.asarray(a, np.float64)
    want = a64 / (1 + np.exp(-a64)) * np.asarray(b, np.float64)
    assert np.abs(np.asarray(ops.silu_mul(a, b)) - want).max() < 1e-5 * max(1.0, np.abs(want).max())


@pytest.fixture
def scalar_and_simd():
    """Run a function with the SIMD variants and with the scalar references."""
    from spel_mlx import _spel_cpu as E
    if E.simd() == "none":
        pytest.skip("this CPU has no SIMD variant of the primitives (AVX2)")

    def both(fn):
        try:
            E.set_simd(False)
            assert E.simd() == "none"
            ref = fn()
        finally:
            E.set_simd(True)
        return ref, fn()
    return both


@pytest.mark.parametrize("M,hd", [(1, 64), (5, 64), (3, 16)])
def test_simd_delta_rule_is_bit_identical_to_the_scalar_reference(ops, scalar_and_simd, M, hd):
    H = 3
    qkv = _rand((M, 3 * H * hd), 11, 2.0)
    a, beta, S0 = mx.sigmoid(_rand((H,), 12)), mx.sigmoid(_rand((H,), 13)), _rand((H, hd, hd), 14, 0.3)
    ref, got = scalar_and_simd(lambda: [np.asarray(t) for t in ops.gdn_delta(qkv, a, beta, S0)])
    assert all(np.array_equal(x, y) for x, y in zip(ref, got))
    assert np.abs(ref[0]).max() > 0


def test_simd_gate_is_bit_identical_to_the_scalar_reference(ops, scalar_and_simd):
    # every range of the formula: both clamps, large and tiny |a|, zeros, 19 columns (a tail)
    a = np.concatenate([np.random.default_rng(15).standard_normal(5 * 19 - 9).astype(np.float32) * 30,
                        np.float32([0.0, -0.0, 1e-30, -1e-30, 200.0, -200.0, 87.0, -87.5, 3e38])])
    a, b = mx.array(a.reshape(5, 19)), _rand((5, 19), 16)
    ref, got = scalar_and_simd(lambda: np.asarray(ops.silu_mul(a, b)))
    assert np.array_equal(ref, got) and not np.isnan(ref).any()
    assert np.array_equal(ref, np.asarray(silu_mul(a, b)))


@pytest.fixture(params=["avx512", "avx2"])
def tile_linear(request):
    """The FMA-chain tiles of one SIMD level (AVX-512, or AVX2 with FMA and F16C; an
    AVX-512 machine runs both), where this CPU has them."""
    from spel_mlx import _spel_cpu as E
    old = E.set_simd_level(request.param)
    try:
        if E.simd() != request.param or not E.fma_chain_linear():
            pytest.skip(f"this CPU has no {request.param} tiles: linear uses the BLAS")
        yield E
    finally:
        E.set_simd_level(old)


@pytest.mark.parametrize("rows,cols,rb", [(192, 64, 64), (256, 96, 32), (48, 40, None), (2048, 256, 64)])
def test_tile_linear_equals_its_fma_reference(ops, tile_linear, rows, cols, rb):
    """The tiles compute each element as one fmaf chain over k in order:
    bit-identical to the scalar reference, for any M (1..13: row groups of 6, tails);
    blocks that are not whole 16-column vectors go to the BLAS."""
    E = tile_linear
    lin = model_mod.Linear(cols, rows)
    for M in (1, 5, 13):
        ops.prepare_linear(lin, M)
        b3 = lin.blocks(ops.layout_rows(M))
        x = _rand((M, cols), M)
        got = np.asarray(ops.linear(x, lin))
        try:
            E.set_linear("reference")
            want = np.asarray(ops.linear(x, lin))
        finally:
            E.set_linear("auto")
        if b3.shape[2] % 16 == 0:      # whole 16-column vectors: the tiles
            assert np.array_equal(got, want), (M, rows, cols)
        else:                          # blocks of 24 columns (48 rows, 32-row blocks): the BLAS
            assert not np.array_equal(got, want) and np.abs(got - want).max() < 1e-5
        assert np.abs(got - np.asarray(x, np.float64) @ np.asarray(lin.weight, np.float64).T).max() < 1e-4


def test_tile_blocks_shared_with_the_helper_give_the_same_bits(ops, tile_linear):
    """set_linear_share: the row blocks of one product split between two threads; each
    block is one tile's columns whatever thread runs it, so the bits are the same (and the
    helper ran some of them: the shared path was taken)."""
    E = tile_linear
    lin = model_mod.Linear(384, 1152)
    for M in (1, 5, 13):
        ops.prepare_linear(lin, M)
        x = _rand((M, 384), M)
        want = np.asarray(ops.linear(x, lin))
        old, before, tries = E.set_linear_share(True), E.helper_items_run(), 0
        try:
            # until the helper has run a block (a loaded machine may not schedule it at once)
            while tries < 4 or (E.helper_state() == "on" and E.helper_items_run() == before and tries < 400):
                assert np.array_equal(np.asarray(ops.linear(x, lin)), want), M
                tries += 1
        finally:
            E.set_linear_share(old)
        assert E.helper_state() != "on" or E.helper_items_run() > before


def test_tile_fast_batches_equal_single_token_rows(models, tile_linear):
    """With the FMA-chain products every part of a pass is row-independent: a fast
    K+1 (or 9-row) pass gives exactly the bits of single-token passes."""
    _, fused, _ = models
    toks = np.random.default_rng(5).integers(0, CFG.vocab, 40)
    seq = _decode(fused, toks, True, 1)
    for batch in (2, 5, 9):
        assert np.array_equal(_decode(fused, toks, False, batch), seq), batch


@pytest.mark.parametrize("rows,rb,M", [(192, 64, 1), (192, 64, 5), (192, 32, 9), (48, None, 3)])
def test_linear_from_row_blocks(ops, rows, rb, M):
    lin = model_mod.Linear(64, rows)
    ops.prepare_linear(lin, M)
    x = _rand((M, 64), 5)
    W = np.asarray(lin.weight, np.float64)
    assert row_block(rows, 64, M) == rb
    rb = row_block(rows, 64, ops.layout_rows(M))      # the AVX-512 tiles read the 64-row blocks
    b3 = lin.blocks(ops.layout_rows(M))
    assert b3.shape == ((rows // rb, 64, rb) if rb else (1, 64, rows))
    got = ops.linear(x, lin)
    assert got.shape == (M, rows)
    assert np.abs(np.asarray(got) - np.asarray(x, np.float64) @ W.T).max() < 1e-5
    xs = _rand((M, 2, 64), 6)[:, 1]                                   # a strided x
    assert np.abs(np.asarray(ops.linear(xs, lin)) - np.asarray(xs, np.float64) @ W.T).max() < 1e-5


def test_inside_mx_compile(ops):
    M, H, hd = 5, 2, 32
    q, k, v = (l2_normalize(_rand((M, H, hd), s)) for s in (1, 2, 3))
    a, beta, S0 = mx.sigmoid(_rand((H,), 4)), mx.sigmoid(_rand((H,), 5)), _rand((H, hd, hd), 6, 0.3)
    f = mx.compile(lambda q, k, v, S0: ops.delta_rule(q, k, v, a, beta, S0))
    for x, y in zip(f(q, k, v, S0), ops.delta_rule(q, k, v, a, beta, S0)):
        assert _diff(x, y) == 0


def test_bad_input_is_a_clear_error(ops):
    from spel_mlx import _spel_cpu as E
    with pytest.raises(ValueError, match="float32"):
        E.delta(*(mx.zeros((2, 2, 4), mx.float16),) * 3, mx.zeros((2,)), mx.zeros((2,)), mx.zeros((2, 4, 4)))
    with pytest.raises(ValueError, match=r"S0 \[H, hd, hd\]"):
        E.delta(*(mx.zeros((2, 2, 4)),) * 3, mx.zeros((2,)), mx.zeros((2,)), mx.zeros((2, 4, 5)))
    with pytest.raises(ValueError, match="pos0"):
        E.attend(mx.zeros((1, 2, 4)), mx.zeros((8, 2, 4)), mx.zeros((8, 2, 4)), mx.array(1.0))
    with pytest.raises(ValueError, match="weight blocks"):
        E.linear(mx.zeros((1, 8)), mx.zeros((2, 4, 8)))


def test_wrong_mlx_version_falls_back(monkeypatch):
    monkeypatch.setattr(cpu_ops._spel_cpu, "mlx_version", "0.0.1")
    ok, why = cpu_ops.status()
    assert not ok and "built for MLX 0.0.1" in why
    assert type(model_mod.auto_ops()) is MLXOps
    with pytest.raises(RuntimeError, match="built for MLX 0.0.1"):
        cpu_ops.CPUFusedOps()


# ---- inside the model ---------------------------------------------------------------
CFG = ModelConfig(d_model=128, n_layers=4, n_heads=2, head_dim=64, d_ff=192, vocab=96,
                  max_seq=200, attn_period=2, draft_map=(0, 1), spec_k=4)


@pytest.fixture(scope="module")
def models():
    w = init_weights(CFG, seed=3)
    fused = SpelModel.from_weights(CFG, w)
    fused.set_ops(cpu_ops.CPUFusedOps())
    plain = SpelModel.from_weights(CFG, w)
    plain.set_ops(MLXOps())
    return w, fused, plain


def _decode(model, toks, strict, batch):
    st, out = model.new_state(ring=10), []
    for i in range(0, len(toks), batch):
        out.append(np.array(model.forward(toks[i:i + batch], st, strict=strict)))
        st.commit(len(toks[i:i + batch]))
    return np.concatenate(out)


@pytest.mark.parametrize("strict,batch", [(True, 1), (False, 5), (True, 5), (False, 9)])
def test_model_with_fused_ops_matches_reference(models, strict, batch):
    w, fused, plain = models
    toks = np.random.default_rng(1).integers(0, CFG.vocab, 90)
    ref = forward_reference(CFG, w, toks)
    got = _decode(fused, toks, strict, batch)
    assert np.abs(ref).max() > 1.0
    assert np.abs(got - ref).max() < 1e-4
    assert np.abs(got - _decode(plain, toks, strict, batch)).max() < 1e-4


def test_fused_strict_batches_are_bit_identical_and_rollback_is_exact(models):
    _, fused, _ = models
    toks = np.random.default_rng(2).integers(0, CFG.vocab, 40)
    seq = _decode(fused, toks, True, 1)
    assert np.array_equal(_decode(fused, toks, True, 5), seq)
    st = fused.new_state()
    fused.prefill(toks[:20].tolist(), st)
    fused.forward(toks[20:25], st)          # a verify batch, then keep 2 of it
    st.commit(2)
    got = np.array(fused.forward(toks[22:27], st, strict=True))
    assert np.array_equal(got, seq[22:27])


class _SeparateOps(cpu_ops.CPUFusedOps):
    """The fused CPU ops without the whole-sub-block primitives (one node per op)."""
    mixer_block = MLXOps.mixer_block
    ffn_block = MLXOps.ffn_block

    def rows_independent(self):
        return False


class _NoAttnBlockOps(cpu_ops.CPUFusedOps):
    def mixer_block(self, blk, x, cache):
        if blk.kind == "attn":
            return MLXOps.mixer_block(self, blk, x, cache)
        return super().mixer_block(blk, x, cache)

    def rows_independent(self):
        return False


def _states_after_a_verify(m, toks):
    st = m.new_state(ring=10)
    m.prefill(toks[:30].tolist(), st)
    m.forward(toks[30:35], st)
    st.commit(3)
    return [np.asarray(a) for i in st.gdn_layers for a in st.committed_gdn(i)] + \
        [np.asarray(st.k_cache[i][:33]) for i in st.attn_layers] + \
        [np.asarray(st.v_cache[i][:33]) for i in st.attn_layers]


@pytest.mark.parametrize("strict,batch,linear", [(True, 1, "auto"), (False, 5, "auto"), (False, 9, "auto"),
                                                (False, 5, "blas")])
def test_sub_block_primitives_agree_with_separate_ones(models, strict, batch, linear):
    """The FFN and GDN sub-blocks give the separate primitives' bits (the same kernels
    in the same order); the attention sub-block (its own L2 norm and RoPE) agrees
    closely.  Logits and the states left behind (S, conv tails, K and V rows)."""
    from spel_mlx import _spel_cpu as E
    old_mode = E.set_linear(linear)          # "blas": the products of CPUs without AVX-512
    try:
        _check_sub_blocks(models, strict, batch)
    finally:
        E.set_linear(old_mode)


def _check_sub_blocks(models, strict, batch):
    w, fused, _ = models
    sep, no_attn = (SpelModel.from_weights(CFG, w) for _ in range(2))
    sep.set_ops(_SeparateOps())
    no_attn.set_ops(_NoAttnBlockOps())
    toks = np.random.default_rng(3).integers(0, CFG.vocab, 45)
    ref = _decode(sep, toks, strict, batch)
    assert np.array_equal(_decode(no_attn, toks, strict, batch), ref)
    assert np.abs(_decode(fused, toks, strict, batch) - ref).max() < 1e-5
    ref_states = _states_after_a_verify(sep, toks)
    assert all(np.array_equal(a, b) for a, b in zip(_states_after_a_verify(no_attn, toks), ref_states))
    assert all(np.abs(a - b).max() < 1e-5 for a, b in zip(_states_after_a_verify(fused, toks), ref_states))


def test_attention_sub_block_updates_the_caches_in_place(models):
    """The attention sub-block writes its K/V rows into the cache buffers it was given
    (no copy of the [max_seq, H, hd] caches per pass) once MLX may donate them."""
    _, fused, _ = models
    st = fused.new_state(ring=10)
    fused.prefill(list(range(12)), st)
    li = st.attn_layers[0]
    mx.eval(st.k_cache[li])
    before = st.k_cache[li]
    ptr = np.asarray(before).__array_interface__["data"][0]
    del before
    fused.forward([3, 4, 5], st)
    mx.eval(st.k_cache[li])
    assert np.asarray(st.k_cache[li]).__array_interface__["data"][0] == ptr
    assert np.abs(np.asarray(st.k_cache[li][12:15])).max() > 0


def test_sub_block_shape_errors(ops):
    from spel_mlx import _spel_cpu as E
    h, norm = mx.zeros((2, 8)), mx.ones((8,))
    b_in, b_out = mx.zeros((1, 8, 16)), mx.zeros((1, 16, 8))
    assert E.ffn_block(h, norm, b_in, b_in, b_out, 1e-5).shape == (2, 8)
    with pytest.raises(ValueError, match="w2 blocks must be"):
        E.ffn_block(h, norm, b_in, b_in, b_in, 1e-5)
    strided = mx.arange(128, dtype=mx.float32).reshape(1, 16, 8).transpose(0, 2, 1)
    mx.eval(strided)                                   # an evaluated transposed view
    with pytest.raises(ValueError, match="contiguous"):
        E.ffn_block(h, norm, strided, b_in, b_out, 1e-5)
    with pytest.raises(ValueError, match=r"S0 \[H, hd, hd\]"):
        E.gdn_block(h, norm, mx.zeros((2, 8)), mx.zeros((3, 8)), mx.zeros((1, 8, 12)), mx.ones((1,)),
                    mx.ones((1,)), mx.zeros((1, 4, 5)), mx.zeros((1, 4, 8)), 1e-5)
    with pytest.raises(ValueError, match="pos0 must be one int32"):
        E.attn_qkv(h, norm, mx.zeros((1, 8, 24)), mx.array(1.0), mx.zeros((16, 2)), mx.zeros((16, 2)), 2, 1e-5)
    with pytest.raises(ValueError, match=r"wqkv \[d -> 3\*H\*hd\]"):
        E.attn_qkv(h, norm, mx.zeros((1, 8, 12)), mx.array(0, mx.int32), mx.zeros((16, 2)), mx.zeros((16, 2)), 2,
                   1e-5)
    with pytest.raises(ValueError, match=r"caches \[S, H, hd\]"):
        E.attn_out(h, mx.zeros((2, 2, 4)), mx.zeros((16, 2, 4)), mx.zeros((16, 3, 4)), mx.array(0, mx.int32),
                   mx.zeros((1, 8, 8)))


def test_portable_build_compiles():
    """The module without its x86 SIMD code (what CPUs other than x86-64 compile):
    a syntax-only compile with -DSPEL_NO_SIMD, warnings as errors."""
    import glob
    import shutil
    import subprocess
    import sysconfig
    required = os.environ.get("SPEL_REQUIRE_CPU_EXT") == "1"      # CI: never skip
    try:
        import nanobind
    except ImportError:
        if required:
            raise
        pytest.skip("nanobind (its headers) is not installed")
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        assert not required, "no C++ compiler"
        pytest.skip("no C++ compiler")
    mlx_inc = os.path.join(os.path.dirname(os.path.dirname(mx.__file__)), "mlx", "include")
    if not os.path.isdir(mlx_inc):
        mlx_inc = os.path.join(os.path.dirname(mx.__file__), "include")
    srcs = sorted(glob.glob(os.path.join(os.path.dirname(spel_mlx.__file__), "cpu_ext", "*.cpp")))
    cmd = [cxx, "-std=c++20", "-fsyntax-only", "-Wall", "-Werror", "-DSPEL_NO_SIMD", '-DSPEL_MLX_VERSION="x"',
           "-I" + mlx_inc, "-I" + os.path.join(os.path.dirname(nanobind.__file__), "include"),
           "-I" + sysconfig.get_paths()["include"], *srcs]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_tiles_read_one_weight_layout_for_every_batch(ops, tile_linear):
    """The AVX-512 tiles read 9 or 17 rows from the 64-row blocks of small batches (one
    copy of the weights); the BLAS keeps its 32-row blocks past 5 rows."""
    E = tile_linear
    assert [ops.layout_rows(M) for M in (1, 5, 9, 17)] == [1, 5, 5, 5]
    lin = model_mod.Linear(64, 192)
    ops.prepare_linear(lin, 9)
    assert lin.blocks(5).shape == (3, 64, 64) and lin.blocks(9) is None
    old = E.set_linear("blas")
    try:
        assert ops.layout_rows(9) == 9
        ops.prepare_linear(lin, 9)
        assert lin.blocks(9).shape == (6, 64, 32)
        x = _rand((9, 64), 7)
        W = np.asarray(lin.weight, np.float64)
        assert np.abs(np.asarray(ops.linear(x, lin)) - np.asarray(x, np.float64) @ W.T).max() < 1e-5
    finally:
        E.set_linear(old)


def _address(a) -> int:
    return np.asarray(a).ctypes.data     # numpy reads an evaluated MLX array in place


def test_aligned_copy_starts_on_a_cache_line_and_keeps_every_value():
    E = cpu_ops._spel_cpu
    for shape in [(3, 256, 64), (7,), (2, 3), (1, 1, 1)]:
        a = _rand(shape, 11)
        mx.eval(a)
        b = E.aligned_copy(a)
        assert _address(b) % 64 == 0 and b.shape == a.shape and b.dtype == a.dtype
        assert np.array_equal(np.asarray(b), np.asarray(a))
        assert np.array_equal(np.asarray(b * 2 + 1), np.asarray(a * 2 + 1))   # an ordinary input
    with pytest.raises(ValueError, match="row-contiguous"):
        E.aligned_copy(mx.transpose(_rand((4, 4), 1)))


@pytest.mark.parametrize("rows,cols,rb", [(256, 64, 64), (96, 40, 32), (48, 17, 48), (16, 24, 8), (1, 3, 1)])
def test_weight_blocks_equal_the_mlx_layout_bit_for_bit(rows, cols, rb):
    """The one-pass C++ layout: block b holds rows b*rb.. transposed, exactly the MLX
    copy of the strided view (float32), and its float16 where the weights are exactly
    binary16; on a cache line, huge-page advice or not."""
    E = cpu_ops._spel_cpu
    W = _rand((rows, cols), 5)
    mx.eval(W)
    want = np.asarray(mx.contiguous(W.reshape(rows // rb, rb, cols).transpose(0, 2, 1)))
    Wh = W.astype(mx.float16).astype(mx.float32)
    mx.eval(Wh)
    wanth = np.asarray(mx.contiguous(Wh.reshape(rows // rb, rb, cols).transpose(0, 2, 1)).astype(mx.float16))
    for simd in (True, False):           # the 8 x 8 register tiles and the scalar reference
        old = E.set_simd(simd)
        try:
            for huge in (False, True):
                b = E.weight_blocks(W, rb, False, huge)
                assert b.shape == want.shape and b.dtype == mx.float32 and _address(b) % 64 == 0
                assert np.array_equal(np.asarray(b).view(np.uint32), want.view(np.uint32))
            bh = E.weight_blocks(Wh, rb, True)
            assert bh.dtype == mx.float16 and np.array_equal(np.asarray(bh).view(np.uint16), wanth.view(np.uint16))
        finally:
            E.set_simd(old)
    assert np.array_equal(np.asarray(bh * 2), wanth.astype(np.float32) * 2)      # an ordinary input
    with pytest.raises(ValueError, match="must divide"):
        E.weight_blocks(W, rows + 1)
    with pytest.raises(ValueError, match="row-contiguous float32"):
        E.weight_blocks(mx.transpose(W), rb)
    with pytest.raises(ValueError, match="row-contiguous float32"):
        E.weight_blocks(Wh.astype(mx.float16), rb)


@pytest.mark.parametrize("rows,half", [(256, False), (256, True), (24, False)])
def test_a_warm_linear_reads_its_weight_back_from_the_blocks(rows, half):
    """Once the fused blocks exist the float32 weight is freed: `weight` becomes the
    blocks read back, bit for bit the weight it was (float16 blocks only for exactly
    binary16 weights), and nothing else holds the float32 copy; the blocks are unchanged."""
    from spel_mlx.model.linear import Linear
    lin = Linear(96, rows)
    lin.weight = _rand((rows, 96), 7).astype(mx.float16).astype(mx.float32) if half else _rand((rows, 96), 7)
    mx.eval(lin.weight)
    want = np.asarray(lin.weight).copy()
    old = lin.weight
    ops = cpu_ops.CPUFusedOps()
    ops.half_weights = True
    ops.prepare_linear(lin, 1)
    blocks = lin.layouts()
    assert len(blocks) == 1 and lin.weight is not old
    assert blocks[0].dtype == (mx.float16 if half and cpu_ops._spel_cpu.fma_chain_linear() else mx.float32)
    import sys
    assert sys.getrefcount(old) == 2          # only this test still holds the float32 copy
    del old
    assert np.array_equal(np.asarray(lin.weight).view(np.uint32), want.view(np.uint32))
    ops.prepare_linear(lin, 1)                                   # warm again: the same layout
    assert lin.layouts()[0] is blocks[0]


def test_pass_weight_blocks_start_on_cache_lines(models):
    """The products read 256-byte block rows: every layout the fused pass captured starts
    on a cache line, and its values are the weight's."""
    _, fused, _ = models
    st = fused.new_state(ring=10)
    mx.eval(fused.forward([1, 2, 3], st))
    lins = [lin for blk in fused.stack_layers("target") for lin in blk.linears()] + [fused.lm_head]
    blocks = [lin.blocks(cpu_ops.CPUFusedOps.layout_rows(3)) for lin in lins]
    assert blocks and all(b is not None and _address(b) % 64 == 0 for b in blocks)
    W = np.asarray(lins[0].weight)
    b = np.asarray(blocks[0])
    assert np.array_equal(b.transpose(0, 2, 1).reshape(W.shape), W)


def test_strict_batches_run_as_one_pass_only_when_rows_are_independent(models, tile_linear):
    """With the AVX-512 tiles strict mode runs a K+1 batch as one pass (the same bits
    as single-token passes); with the BLAS products it keeps running them one by one."""
    E = tile_linear
    w, fused, plain = models
    toks = np.random.default_rng(6).integers(0, CFG.vocab, 30)
    seq = _decode(fused, toks, True, 1)
    assert fused.rows_independent("target", 5) and fused.rows_independent("target", 9)
    assert not plain.rows_independent("target", 5)                  # MLXOps
    calls = []
    orig = fused._run
    fused._run = lambda toks_, st, *a: (calls.append(len(toks_)), orig(toks_, st, *a))[1]
    try:
        assert np.array_equal(_decode(fused, toks, True, 5), seq)
        assert calls and set(calls) == {5}                            # one 5-row pass per batch
        calls.clear()
        old = E.set_linear("blas")
        try:
            assert not fused.rows_independent("target", 5)
            got = _decode(fused, toks, True, 5)
            assert set(calls) == {1}                                  # row by row
        finally:
            E.set_linear(old)
        assert np.abs(got - seq).max() < 1e-4
    finally:
        del fused._run


def test_read_seconds_reads_every_element():
    """The bandwidth probe reads the whole array: its sum is exact for small integers
    (any element it skipped would show), and it refuses what it cannot read."""
    from spel_mlx import _spel_cpu as E
    a = mx.array((np.arange(100_003) % 7).astype(np.float32))
    mx.eval(a)
    seconds, total = E.read_seconds(a)
    assert seconds > 0 and total == float(np.sum(np.arange(100_003) % 7))
    with pytest.raises(ValueError, match="float32"):
        E.read_seconds(mx.zeros((4,), mx.int32))


def test_read_f32_into_populated_pages_bit_for_bit(tmp_path):
    """A read of several MB (its pages mapped in one call first, on 2 MB pages where
    `huge`) gives the file's bytes at the offset, huge or not, and a NaN is reported."""
    from spel_mlx import _spel_cpu as E
    vals = np.random.default_rng(5).standard_normal(3 * (1 << 20) + 77).astype(np.float32)
    path = tmp_path / "w.bin"
    path.write_bytes(b"\0" * 100 + vals.tobytes())
    st = os.stat(path)
    for huge in (False, True):
        a, finite = E.read_f32(str(path), 100, [vals.size], st.st_dev, st.st_ino, huge)
        assert finite and np.array_equal(np.array(a).view(np.uint32), vals.view(np.uint32))
    vals[-1] = np.nan
    path.write_bytes(b"\0" * 100 + vals.tobytes())
    st = os.stat(path)
    _, finite = E.read_f32(str(path), 100, [vals.size], st.st_dev, st.st_ino, True)
    assert not finite


def test_mapped_checkpoint_tensors_are_read_with_pread_bit_for_bit(tmp_path, monkeypatch):
    """A SPELW file's float32 tensors reach the model through read_f32 (no page faults on
    the mapping), every one bit for bit, and NaN or infinity in one is named as
    load_checkpoint names it; a file replaced under its mapping, a closed map or another
    dtype falls back to the mapped bytes, never to the new file's."""
    import dataclasses
    import warnings

    from spel_mlx.checkpoints import NonFiniteWeightsWarning, files
    from spel_mlx.checkpoints.spelw import read_spelw, write_spelw
    from spel_mlx.loading import CheckedReader, load_for_decoding
    E = cpu_ops._spel_cpu
    cfg = dataclasses.replace(CFG, vocab=128)           # the byte tokenizer's
    path = tmp_path / "m.spelw"
    weights = init_weights(cfg, seed=3)
    write_spelw(path, cfg, weights)
    calls, read_f32 = [], E.read_f32

    def counted(*a, **k):
        calls.append(a[1])
        return read_f32(*a, **k)
    monkeypatch.setattr(E, "read_f32", counted)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteWeightsWarning)
        _, _, _, model = load_for_decoding(str(path), device="cpu")
    monkeypatch.undo()
    got = model.weights_dict()
    assert all(np.array_equal(got[n], weights[n]) for n in weights)
    assert len(calls) == len(weights) and len(set(calls)) == len(weights)   # one read per tensor

    bad = dict(weights)
    bad["layers.2.mlp.w3.weight"] = weights["layers.2.mlp.w3.weight"].copy()
    bad["layers.2.mlp.w3.weight"][-1, -1] = np.nan        # the last value of the last 1 MB piece
    write_spelw(tmp_path / "nan.spelw", cfg, bad)
    with pytest.warns(NonFiniteWeightsWarning, match=r"non-finite weights \(NaN or inf\) in layers.2.mlp.w3.weight:"):
        load_for_decoding(str(tmp_path / "nan.spelw"), device="cpu")

    f = read_spelw(path)
    name = next(iter(f.tensors))
    view = f.tensors[name]
    region = files.mapped_region(view)
    assert region is not None and region[0] == str(path)
    read = CheckedReader.for_device("cpu")
    assert np.array_equal(np.array(read(name, view)), weights[name]) and not read.nonfinite
    assert files.mapped_region(view.copy()) is None and files.mapped_region(view.astype(np.float64)) is None
    write_spelw(tmp_path / "new.spelw", cfg, init_weights(cfg, seed=4))
    os.replace(tmp_path / "new.spelw", path)            # a new file (inode) at the path
    assert read(name, view) is view and np.array_equal(view, weights[name])
    assert CheckedReader.for_device("gpu") is None
