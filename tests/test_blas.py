import subprocess
import sys

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux-only BLAS fix")
def test_mlx_uses_optimized_blas_and_is_correct():
    code = r"""
import time, numpy as np, spel_mlx, mlx.core as mx
info = spel_mlx.blas_info()
a = np.random.default_rng(0).standard_normal((512, 384)).astype(np.float32)
b = np.random.default_rng(1).standard_normal((384, 256)).astype(np.float32)
c = np.array(mx.array(a) @ mx.array(b))
assert np.allclose(c, a.astype(np.float64) @ b, atol=1e-3), "wrong GEMM result"
print(info["kind"])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("numpy-openblas", "system-openblas")


def test_reference_choice_respected():
    code = "import spel_mlx; print(spel_mlx.blas_info()['kind'])"
    env = {"SPEL_BLAS": "reference", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.strip() == "reference", out.stderr
