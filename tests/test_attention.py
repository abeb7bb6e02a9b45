"""The blocked online-softmax attention of the fused CPU module (cpu_ext/attend_blocked.cpp):
its SIMD variants against the scalar reference bit for bit, a query's result independent
of the batch it is in, the mask inside the block, and the float64 softmax."""
import os

import numpy as np
import pytest

import spel_mlx  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
from spel_mlx.model import MLXOps, cpu_ops, l2_normalize

if os.environ.get("SPEL_REQUIRE_CPU_EXT") != "1" and not cpu_ops.available():
    pytest.skip("spel_mlx._spel_cpu not built: " + cpu_ops.status()[1], allow_module_level=True)

from spel_mlx import _spel_cpu as E  # noqa: E402

SHAPES = [  # M, pos0, cache rows, H, hd: partial blocks, hd past and below 16, a long cache
    (1, 0, 64, 3, 32), (5, 37, 64, 3, 32), (17, 400, 512, 3, 64), (5, 1000, 1100, 4, 64),
    (3, 20, 40, 2, 30), (2, 5, 16, 2, 8), (9, 3000, 4096, 6, 64), (2, 50, 60, 2, 128), (4, 60, 64, 1, 64)]


def _case(M, pos0, W, H, hd, seed=0):
    rng = np.random.default_rng(seed)
    q = l2_normalize(mx.array(rng.standard_normal((M, H, hd)).astype(np.float32)))
    kc = l2_normalize(mx.array(rng.standard_normal((W, H, hd)).astype(np.float32)))
    vc = mx.array(rng.standard_normal((W, H, hd)).astype(np.float32))
    return q, kc, vc, mx.array(pos0, dtype=mx.int32)


def _attend(q, kc, vc, pos, level="avx512"):
    old = E.set_simd_level(level)
    try:
        return np.asarray(E.attend(q, kc, vc, pos))
    finally:
        E.set_simd_level(old)


def _float64_attention(q, kc, vc, pos0):
    q, kc, vc = (np.asarray(t, np.float64) for t in (q, kc, vc))
    M, H, hd = q.shape
    out = np.zeros((M, H, hd))
    for m in range(M):
        n = pos0 + m + 1
        s = np.einsum("hd,whd->hw", q[m], kc[:n]) * np.sqrt(hd)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[m] = np.einsum("hw,whd->hd", p / p.sum(axis=1, keepdims=True), vc[:n])
    return out


@pytest.mark.parametrize("M,pos0,W,H,hd", SHAPES)
def test_simd_variants_equal_the_scalar_reference(M, pos0, W, H, hd):
    if E.simd() == "none":
        pytest.skip("this CPU has no SIMD variant (AVX2)")
    q, kc, vc, pos = _case(M, pos0, W, H, hd)
    ref = _attend(q, kc, vc, pos, "none")
    assert np.abs(ref - _float64_attention(q, kc, vc, pos0)).max() < 2e-6
    levels = ["avx2", "avx512"] if E.simd() == "avx512" else ["avx2"]
    for level in levels:                    # avx2 runs hd in multiples of 16, else the reference
        assert np.array_equal(_attend(q, kc, vc, pos, level), ref), level


@pytest.mark.parametrize("level", ["none", "avx2", "avx512"])
def test_a_query_gets_the_same_bits_in_any_batch(level):
    """Row m of an M-row call equals a one-row call at position pos0+m, bit for bit:
    every query walks the same key blocks with its own running state."""
    if level not in {"none": ["none"], "avx2": ["none", "avx2"], "avx512": ["none", "avx2", "avx512"]}[E.simd()]:
        pytest.skip(f"this CPU has no {level}")
    q, kc, vc, pos = _case(17, 203, 256, 3, 64, seed=1)
    batch = _attend(q, kc, vc, pos, level)
    for m in range(17):
        one = _attend(q[m:m + 1], kc, vc, mx.array(203 + m, dtype=mx.int32), level)
        assert np.array_equal(one[0], batch[m]), m


def test_rows_past_a_query_are_never_read():
    """NaN in every cache row past the last query's position changes nothing, and the
    cache's capacity does not matter (a longer cache gives the same bits)."""
    q, kc, vc, pos = _case(5, 45, 64, 2, 64, seed=2)
    want = _attend(q, kc, vc, pos)
    nan = mx.full((14, 2, 64), np.nan)
    kn, vn = (mx.concatenate([c[:50], nan]) for c in (kc, vc))
    assert np.array_equal(_attend(q, kn, vn, pos), want)
    longer = [mx.concatenate([c, mx.zeros((960, 2, 64))]) for c in (kc, vc)]
    assert np.array_equal(_attend(q, *longer, pos), want)


def test_matches_mlx_ops_over_a_long_cache():
    q, kc, vc, pos = _case(5, 3500, 4096, 4, 64, seed=3)
    want = np.asarray(MLXOps().attend(q, kc, vc, pos, 5))
    assert np.abs(_attend(q, kc, vc, pos) - want).max() < 1e-5


def test_keys_far_below_the_max_contribute_nothing():
    """Scores more than 64 (log2 units) below the running max are flushed to an exact 0
    (no denormals); with unnormalized logits that large the float64 softmax agrees."""
    rng = np.random.default_rng(4)
    q = mx.array(rng.standard_normal((3, 2, 64)).astype(np.float32) * 4)    # logits up to ~±250
    kc, vc = (mx.array(rng.standard_normal((100, 2, 64)).astype(np.float32)) for _ in range(2))
    pos = mx.array(90, dtype=mx.int32)
    got = _attend(q, kc, vc, pos)
    assert np.abs(got - _float64_attention(q, kc, vc, 90)).max() < 1e-5
    assert np.array_equal(_attend(q, kc, vc, pos, "none"), got)


# --- a half-precision (float16) cache -------------------------------------------------

def _levels():
    return {"none": ["none"], "avx2": ["none", "avx2"], "avx512": ["none", "avx2", "avx512"]}[E.simd()]


@pytest.mark.parametrize("M,pos0,W,H,hd", [(1, 0, 64, 3, 32), (5, 37, 64, 3, 32), (17, 400, 512, 3, 64),
                                           (9, 3000, 4096, 6, 64), (3, 20, 40, 2, 30), (2, 50, 60, 2, 128)])
def test_a_float16_cache_gives_the_bits_of_its_values_widened(M, pos0, W, H, hd):
    """Every variant reads a float16 cache as the float32 cache of the same values: the
    same bits as the widened cache through the scalar reference (hd 30: the SIMD variants
    read binary16 in whole 16-element chunks only, so the reference runs there)."""
    q, kc, vc, pos = _case(M, pos0, W, H, hd, seed=5)
    kh, vh = kc.astype(mx.float16), vc.astype(mx.float16)
    want = _attend(q, kh.astype(mx.float32), vh.astype(mx.float32), pos, "none")
    for level in _levels():
        assert np.array_equal(_attend(q, kh, vh, pos, level), want), level
    # the cache's rounding moves the result a little, not more
    assert np.abs(want - _attend(q, kc, vc, pos, "none")).max() < 5e-3


@pytest.mark.parametrize("level", ["none", "avx2", "avx512"])
def test_every_binary16_value_is_widened_exactly(level):
    """One visible key: the output is that key's value row itself (weight exactly 1), so a
    cache holding all 65,536 binary16 bit patterns as values returns each one widened
    (NaNs stay NaN, -0 comes back as +0 from the sum)."""
    if level not in _levels():
        pytest.skip(f"this CPU has no {level}")
    bits = np.arange(65536, dtype=np.uint16).reshape(1, 512, 128)
    values = mx.array(bits.view(np.float16))
    vc = mx.concatenate([values, mx.zeros((15, 512, 128), mx.float16)])
    kc = mx.zeros((16, 512, 128), mx.float16)
    q = mx.zeros((1, 512, 128))
    got = _attend(q, kc, vc, mx.array(0, dtype=mx.int32), level)
    np.testing.assert_array_equal(got[0], bits[0].view(np.float16).astype(np.float32))


def test_float16_cache_matches_mlx_ops_and_checks_its_arguments():
    q, kc, vc, pos = _case(5, 3500, 4096, 4, 64, seed=6)
    kh, vh = kc.astype(mx.float16), vc.astype(mx.float16)
    want = np.asarray(MLXOps().attend(q, kh, vh, pos, 5))
    assert np.abs(_attend(q, kh, vh, pos) - want).max() < 1e-5
    with pytest.raises(ValueError, match="dtypes differ"):
        E.attend(q, kh, vc, pos)
    with pytest.raises(ValueError, match="float32 or float16"):
        E.attend(q, kc.astype(mx.bfloat16), vc.astype(mx.bfloat16), pos)


def test_a_strided_float16_cache_is_widened_first():
    """A cache whose head elements are not contiguous (a transposed view) is copied
    widened: the same bits as the contiguous float16 cache."""
    q, kc, vc, pos = _case(5, 90, 128, 4, 32, seed=7)
    kh, vh = kc.astype(mx.float16), vc.astype(mx.float16)
    kt, vt = (mx.swapaxes(mx.array(np.ascontiguousarray(np.swapaxes(np.asarray(a), 1, 2))), 1, 2) for a in (kh, vh))
    mx.eval(kt, vt)
    assert kt.dtype == mx.float16 and np.array_equal(np.asarray(kt), np.asarray(kh))
    assert np.array_equal(_attend(q, kt, vt, pos), _attend(q, kh, vh, pos))
