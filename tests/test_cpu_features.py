"""SPEL_SIMD caps the kernels' SIMD level and SPEL_ATTENTION_HELPER switches the attention
helper thread; decoding gives the same tokens on every path."""
import json
import platform
import subprocess
import sys

import pytest

import spel_mlx  # noqa: F401
from spel_mlx.platform.cpu_features import simd_cap

PROBE = r"""
import json, spel_mlx
from spel_mlx.model import cpu_ops
from spel_mlx.native import cdraft
from spel_mlx.api import load, generate
m, tok = load()
text = generate(m, tok, "And God said unto Moses,", max_tokens=40, temperature=0)
print(json.dumps({"simd": cpu_ops._spel_cpu.simd(), "fma": bool(cpu_ops._spel_cpu.fma_chain_linear()),
                  "draft_kernel": cdraft.kernel_name(cdraft._resolve("auto")), "text": text}))
"""


def probe(level: str, code: str = PROBE, var: str = "SPEL_SIMD") -> dict:
    """The JSON that `code` prints in a fresh process with `var`=`level`."""
    env = {var: level, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
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
    # capped at AVX2 the products are the AVX2 tiles (FMA chains) where the CPU has FMA and F16C
    flags = set(open("/proc/cpuinfo").read().split()) if platform.system() == "Linux" else set()
    assert avx2["simd"] == "avx2" and avx2["fma"] == ({"fma", "f16c"} <= flags) and avx2["draft_kernel"] == "avx2"
    assert not scalar["fma"]
    assert scalar["simd"] == "none" and scalar["draft_kernel"] == "scalar"
    assert best["text"] == avx2["text"] == scalar["text"] and len(best["text"]) > 40


HELPER_PROBE = r"""
import json, spel_mlx
from spel_mlx.model import cpu_ops
from spel_mlx.api import load, generate
m, tok = load()
prompt = "And God said unto Moses, I AM THAT I AM: and he said, Thus shalt thou say. " * 40
text = generate(m, tok, prompt, max_tokens=24, temperature=0)
print(json.dumps({"state": cpu_ops._spel_cpu.helper_state(), "items": cpu_ops._spel_cpu.helper_items_run(),
                  "text": text}))
"""


def test_attention_helper_switch(monkeypatch):
    """SPEL_ATTENTION_HELPER=0 keeps attention on one thread; a long prompt decodes to the
    same text either way, and by default the helper thread did take key chunks (2+ CPUs)."""
    from spel_mlx.platform.cpu_features import attention_helper
    from spel_mlx.model import cpu_ops
    monkeypatch.setenv("SPEL_ATTENTION_HELPER", "maybe")
    with pytest.raises(ValueError, match="SPEL_ATTENTION_HELPER='maybe'"):
        attention_helper()
    if not cpu_ops.available():
        pytest.skip(cpu_ops.status()[1])
    runs = {value: probe(value, HELPER_PROBE, "SPEL_ATTENTION_HELPER") for value in ("0", "1")}
    assert runs["0"]["state"] == "off" and runs["0"]["items"] == 0
    assert runs["0"]["text"] == runs["1"]["text"] and len(runs["1"]["text"]) > 20
    if runs["1"]["state"] == "on":
        assert runs["1"]["items"] > 0
    else:
        assert runs["1"]["state"] == "off (one usable CPU)"
