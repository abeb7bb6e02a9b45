"""SPEC 3 quantizers: numpy reference properties, and the C quantizers bit-exact
against it on random and edge inputs."""
import numpy as np
import pytest

from spel_mlx import quant

draft = pytest.importorskip("spel_mlx.native.cdraft")
if draft.lib is None:
    pytest.skip("C draft engine not built", allow_module_level=True)


def _bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def edge_matrices():
    rng = np.random.default_rng(7)
    yield "random", rng.standard_normal((37, 200)).astype(np.float32)
    yield "small-scale", (rng.standard_normal((9, 64)) * 1e-3).astype(np.float32)
    z = rng.standard_normal((6, 130)).astype(np.float32)
    z[1] = 0.0                     # zero row
    z[3] = 0.25                    # constant row
    z[4] = -3.0
    z[5, :] = 0.0
    z[5, 7] = 5.0                  # a single spike
    yield "zero-and-constant-rows", z
    h = np.tile(np.arange(-4, 5, dtype=np.float32) * 0.5, (3, 8))   # exact halves: ties
    yield "ties", h
    yield "one-column", rng.standard_normal((5, 1)).astype(np.float32)
    yield "wide", rng.standard_normal((3, 1537)).astype(np.float32)
    yield "heavy-tails", (rng.standard_cauchy((8, 96))).astype(np.float32)


@pytest.mark.parametrize("name,w", list(edge_matrices()), ids=[n for n, _ in edge_matrices()])
def test_c_quantizers_bit_exact(name, w):
    q, s = quant.quantize_q8(w)
    qc, sc = draft.c_quantize_q8(w)
    assert np.array_equal(q, qc) and np.array_equal(_bits(s), _bits(sc))
    t, st = quant.quantize_ternary(w)
    tc, stc = draft.c_quantize_ternary(w)
    assert np.array_equal(t, tc) and np.array_equal(_bits(st), _bits(stc))
    assert np.array_equal(quant.pack_ternary(t), draft.c_pack_ternary(tc))
    for row in w:
        xq, sx = quant.quantize_activation(row)
        xqc, sxc = draft.c_quantize_activation(row)
        assert np.array_equal(xq, xqc) and _bits(sx) == _bits(sxc)


def test_c_ternary_four_rows_at_a_time_equal_one_at_a_time():
    """spel_quantize_ternary takes four rows at once (vectorized codes, four sum chains):
    every row's codes and scale are those of the row quantized alone, the scalar
    reference, bit for bit, also for rows the numpy reference does not define (a NaN,
    values whose quotient overflows) and for the rows left over after the groups of four."""
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((11, 203)) * 0.05).astype(np.float32)
    w[1, 4] = np.nan
    w[2, :] = 0.0
    w[3, 0] = 3e38                       # a huge value: the others' quotients underflow, its own is large
    w[6, :] *= 1e-38                     # float32 subnormals
    w[9, 7] = -np.inf
    tc, sc = draft.c_quantize_ternary(w)
    for r in range(w.shape[0]):
        t1, s1 = draft.c_quantize_ternary(w[r:r + 1])
        assert np.array_equal(tc[r:r + 1], t1) and np.array_equal(_bits(sc[r:r + 1]), _bits(s1)), r


def test_q8_properties():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((20, 77)).astype(np.float32)
    q, s = quant.quantize_q8(w)
    assert q.dtype == np.int8 and np.abs(q).max() == 127
    assert np.array_equal(np.abs(q).max(axis=1), np.full(20, 127))
    assert np.allclose(s, np.abs(w).max(axis=1) / 127, rtol=1e-7)
    assert np.abs(quant.dequantize(q, s) - w).max() <= s.max() / 2 * 1.0001


def test_ternary_refinement_is_least_squares():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((16, 256)).astype(np.float32)
    t, s = quant.quantize_ternary(w)
    assert set(np.unique(t)) <= {-1, 0, 1}
    # one more refinement step from the final s keeps t (three steps converge here)
    t2 = np.clip(np.rint(w / s[:, None]), -1, 1)
    assert np.array_equal(t2, t)
    # the error is no worse than the plain mean|w| scale
    s0 = np.abs(w).mean(axis=1)
    t0 = np.clip(np.rint(w / s0[:, None]), -1, 1)
    err0 = ((w - t0 * s0[:, None]) ** 2).sum(axis=1)
    err = ((w - t * s[:, None]) ** 2).sum(axis=1)
    assert (err <= err0 * (1 + 1e-6)).all()


def test_ternary_zero_and_constant_rows():
    w = np.zeros((3, 70), np.float32)
    w[1] = 0.5
    w[2, :3] = [1.0, -1.0, 0.0]
    t, s = quant.quantize_ternary(w)
    assert s[0] == 0 and not t[0].any()
    assert s[1] == np.float32(0.5) and (t[1] == 1).all()
    assert np.array_equal(t[2, :3], [1, -1, 0]) and s[2] == 1.0


def test_pack_layout_low_bits_first_and_padding():
    t = np.array([[1, -1, 0, 1, -1]], np.int8)
    p = quant.pack_ternary(t)
    assert p.shape == (1, 16)                       # padded to 64 weights
    assert p[0, 0] == (1 | 3 << 2 | 0 << 4 | 1 << 6)
    assert p[0, 1] == 3 and not p[0, 2:].any()
    assert quant.packed_row_bytes(64) == 16 and quant.packed_row_bytes(65) == 32


def test_code_two_decodes_as_zero_and_roundtrip():
    rng = np.random.default_rng(3)
    packed = rng.integers(0, 256, (5, 32), dtype=np.uint8)
    packed[0, 0] = 0b10101010                      # four code-2 weights
    u = quant.unpack_ternary(packed, 128)
    assert not u[0, :4].any()
    codes = np.stack([(packed >> (2 * k)) & 3 for k in range(4)], -1).reshape(5, -1)
    assert np.array_equal(u, np.select([codes == 1, codes == 3], [1, -1], 0))
    t = rng.integers(-1, 2, (4, 100)).astype(np.int8)
    assert np.array_equal(quant.unpack_ternary(quant.pack_ternary(t), 100), t)


def test_activation_edges():
    xq, sx = quant.quantize_activation(np.zeros(50, np.float32))
    assert sx == 0 and not xq.any()
    x = np.array([3.0, -3.0, 1.5, 0.0], np.float32)
    xq, sx = quant.quantize_activation(x)
    assert list(xq) == [127, -127, 64, 0] and sx == np.float32(3.0) / np.float32(127)
    # round half to even is the pinned rounding
    assert np.rint(np.float32(63.5)) == 64 and np.rint(np.float32(62.5)) == 62


def test_reference_gemvs_match_dequantized_math():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((33, 150)).astype(np.float32)
    x = rng.standard_normal(150).astype(np.float32)
    xq, sx = quant.quantize_activation(x)
    q, s = quant.quantize_q8(w)
    want = (q.astype(np.float64) * s[:, None].astype(np.float64)) @ (xq.astype(np.float64) * np.float64(sx))
    assert np.allclose(quant.gemv_q8_ref(q, s, x), want, rtol=1e-5, atol=1e-6)
    t, st = quant.quantize_ternary(w)
    y1 = quant.gemv_ternary_ref(t, st, x)
    y2 = quant.gemv_ternary_ref(quant.pack_ternary(t), st, x, cols=150)
    assert np.array_equal(y1, y2)


@pytest.mark.parametrize("scheme", ["q8", "ternary"])
def test_snap_reaches_a_fixed_point_that_packs_without_loss(scheme):
    """snap: float32 values whose quantization is exactly the codes and scales they were
    made from (so a draft stored as codes and scales loads to the same bits), near the
    original weights' quantization; raw weights are not on the grid (negative control)."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((96, 200)) * rng.uniform(0.01, 3, (96, 1))).astype(np.float32)
    w[5] = 0.0                                               # an all-zero row stays zero
    v, q, s = quant.snap(w, scheme)
    assert v.dtype == np.float32 and quant.on_grid(v, scheme) and not quant.on_grid(w, scheme)
    q2, s2 = quant.QUANTIZERS[scheme](v)
    assert np.array_equal(q2, q) and np.array_equal(s2.view(np.uint32), s.view(np.uint32))
    assert np.array_equal(quant.dequantize(q2, s2).view(np.uint32), v.view(np.uint32))
    q0, s0 = quant.QUANTIZERS[scheme](w)
    assert np.abs(q.astype(int) - q0).max() <= 1 and np.allclose(s, s0, rtol=1e-6)
    assert not v[5].any()
