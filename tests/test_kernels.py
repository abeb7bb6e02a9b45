"""Every kernel available on this CPU returns identical int32 dot products (and so
identical GEMV outputs), equal to the numpy reference.  The NEON kernels are run
under qemu by test_neon_qemu.py."""
import os
import platform

import numpy as np
import pytest

from spel_mlx import quant

draft = pytest.importorskip("spel_mlx.native.cdraft")
if draft.lib is None:
    pytest.skip("C draft engine not built", allow_module_level=True)

KERNELS = draft.available_kernels()
SHAPES = [(1, 64), (5, 100), (33, 384), (16, 1536), (9, 192), (7, 1), (4, 1000), (3, 130)]


def _activations(rng, cols):
    yield "random", rng.integers(-127, 128, cols).astype(np.int8)
    yield "+127", np.full(cols, 127, np.int8)
    yield "-127", np.full(cols, -127, np.int8)
    yield "zero", np.zeros(cols, np.int8)


def test_kernel_report():
    assert "scalar" in KERNELS and draft.auto_kernel() in KERNELS
    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        flags = open("/proc/cpuinfo").read().split()
    if platform.machine() == "x86_64" and "avx2" in flags and "fma" in flags:
        assert "avx2" in KERNELS
        vnni = "avx512_vnni" in flags and "avx512vl" in flags
        assert ("vnni" in KERNELS) == vnni
        assert draft.auto_kernel() == ("vnni" if vnni else "avx2")


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_ternary_dots_identical(rows, cols):
    rng = np.random.default_rng(rows * 1000 + cols)
    packed = rng.integers(0, 256, (rows, quant.packed_row_bytes(cols)), dtype=np.uint8)  # has code 2
    t = quant.unpack_ternary(packed, cols)
    canonical = quant.pack_ternary(t)           # padding weights are code 0 in canonical rows
    for name, xq in _activations(rng, cols):
        want = quant.dot_q8_int(t, xq)
        for k in KERNELS:
            got = draft.dot_ternary(k, canonical, cols, xq)
            assert np.array_equal(got, want), (k, name)
            if cols % 64 == 0:                  # raw random bytes (code 2 everywhere) as well
                assert np.array_equal(draft.dot_ternary(k, packed, cols, xq), want), (k, name, "raw")


@pytest.mark.parametrize("rows,cols", SHAPES)
def test_q8_dots_identical(rows, cols):
    rng = np.random.default_rng(rows * 7 + cols)
    q = rng.integers(-127, 128, (rows, cols)).astype(np.int8)
    q[0, :] = 127
    for name, xq in _activations(rng, cols):
        want = quant.dot_q8_int(q, xq)
        for k in KERNELS:
            assert np.array_equal(draft.dot_q8(k, q, xq), want), (k, name)


def test_extreme_sums_exact():
    cols = 4096
    q = np.full((2, cols), 127, np.int8)
    q[1] = -127
    xq = np.full(cols, 127, np.int8)
    packed = quant.pack_ternary(np.sign(q).astype(np.int8))
    for k in KERNELS:
        assert list(draft.dot_q8(k, q, xq)) == [127 * 127 * cols, -127 * 127 * cols]
        assert list(draft.dot_ternary(k, packed, cols, xq)) == [127 * cols, -127 * cols]


@pytest.mark.parametrize("ternary", [True, False])
def test_gemv_outputs_identical_and_match_reference(ternary):
    rng = np.random.default_rng(11)
    w = (rng.standard_normal((300, 448)) * 0.05).astype(np.float32)
    x = rng.standard_normal(448).astype(np.float32)
    if ternary:
        t, s = quant.quantize_ternary(w)
        ref = quant.gemv_ternary_ref(t, s, x)
    else:
        q, s = quant.quantize_q8(w)
        ref = quant.gemv_q8_ref(q, s, x)
    m = draft.QMatrix(w, ternary=ternary)
    for threads in (1, 3):
        with draft.Pool(threads) as pool:
            for k in KERNELS:
                y = m.gemv(x, pool, k)
                assert np.array_equal(y.view(np.uint32), ref.view(np.uint32)), (k, threads)
    m.close()


def test_unknown_kernel_rejected():
    with pytest.raises(ValueError, match="kernel"):
        draft.kernel_id("sse9")
    missing = [k for k in draft.KERNELS if k not in KERNELS]
    for k in missing:
        with pytest.raises(ValueError, match="not available"):
            draft.dot_q8(k, np.zeros((1, 4), np.int8), np.zeros(4, np.int8))
