"""SPEL_SIMD caps the kernels' SIMD level; decoding gives the same tokens on every path."""
import json
import platform
import subprocess
import sys

import pytest

import spel_mlx  # noqa: F401
from spel_mlx.cpu_features import simd_cap

PROBE = r"""
import json, spel_mlx
from spel_mlx.model import cpu_ops
from spel_mlx.native import cdraft
from spel_mlx.api import load, generate
m, tok = load()
text = generate(m, tok, "And God said unto Moses,", 40, temperature=0)
print(json.dumps({"simd": cpu_ops._spel_cpu.simd(), "fma": bool(cpu_ops._spel_cpu.fma_chain_linear()),
                  "draft_kernel": cdraft.kernel_name(cdraft._resolve("auto")), "text": text}))
"""


def probe(level: str) -> dict:
    env = {"SPEL_SIMD": level, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_bad_level_is_named(monkeypatch):
    monkeypatch.setenv("SPEL_SIMD", "sse9")
    with pytest.raises(ValueError, match="SPEL_SIMD='sse9'"):
        simd_cap()
    monkeypatch.setenv("SPEL_SIMD", "AVX2")
    assert simd_cap() == "avx2"


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 SIMD levels")
def test_capped_paths_decode_the_same_tokens():
    from spel_mlx.model import cpu_ops
    if not cpu_ops.available():
        pytest.skip(cpu_ops.status()[1])
    best, avx2, scalar = probe("auto"), probe("avx2"), probe("none")
    assert avx2["simd"] == "avx2" and not avx2["fma"] and avx2["draft_kernel"] == "avx2"
    assert scalar["simd"] == "none" and scalar["draft_kernel"] == "scalar"
    assert best["text"] == avx2["text"] == scalar["text"] and len(best["text"]) > 40
