"""The NEON kernels on this (x86) machine: the engine's C sources cross-compiled with
aarch64-linux-gnu-gcc and run under qemu-aarch64.  dotprod, addsub and scalar must
return identical int32 dots, the quantizers must match numpy bit for bit, and the
whole draft step must give identical logits with every kernel and thread count (and
agree with the x86 build).  CI sets SPEL_REQUIRE_CROSS=1 so none of this skips."""
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import require_or_skip
from spel_mlx import quant
from spel_mlx.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
NEON = ROOT / "neon"
# the engine's sources as neon/build_ffi.py lists them: every .c under neon/ but tests/
ENGINE = sorted(p for p in NEON.rglob("*.c") if "tests" not in p.relative_to(NEON).parts)
SOURCES = [NEON / "tests" / "selftest.c"] + ENGINE
CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
KERNEL_IDS = {"scalar": 0, "dotprod": 2, "addsub": 3}
CFG = ModelConfig(d_model=64, n_heads=1, head_dim=64, d_ff=128, max_seq=32)


def _tools():
    missing = [t for t in (CC, QEMU) if shutil.which(t) is None]
    require_or_skip(not missing, f"{' and '.join(missing)} not installed "
                                 "(Debian: gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)")


def _compile(out: Path, march: str):
    cmd = [CC, "-O2", "-std=gnu11", "-ffp-contract=off", f"-march={march}", "-static", "-pthread",
           f"-I{NEON}", *map(str, SOURCES), "-lm", "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def binaries(tmp_path_factory):
    _tools()
    d = tmp_path_factory.mktemp("neon_build")      # build artifacts stay out of the repo
    return {"dotprod": _compile(d / "selftest_dotprod", "armv8.2-a+dotprod"),
            "baseline": _compile(d / "selftest_v8a", "armv8-a")}


def _run(binary, *args, cpu="max", timeout=120):
    r = subprocess.run([QEMU, "-cpu", cpu, str(binary), *map(str, args)], capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, f"{binary.name} {args}: rc={r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def test_neon_kernels_identical(binaries):
    out = _run(binaries["dotprod"], "kernels")
    assert "available dotprod" in out and "available addsub" in out and "available scalar" in out
    assert "kernels 3 agree" in out


def test_runtime_dotprod_detection(binaries):
    # built for plain armv8-a: dotprod lives in a target-attribute function, chosen by HWCAP
    out = _run(binaries["baseline"], "kernels", cpu="max")
    assert "available dotprod" in out and "kernels 3 agree" in out
    out = _run(binaries["baseline"], "kernels", cpu="cortex-a53")     # ARMv8.0: no dotprod
    assert "available dotprod" not in out and "kernels 2 agree" in out


def test_quantizers_bit_exact_on_arm64(binaries, tmp_path):
    rng = np.random.default_rng(12)
    R, C = 12, 150
    w = rng.standard_normal((R, C)).astype(np.float32)
    w[1] = 0
    w[2] = 0.125
    w[3, ::2] = 0.5
    w[4] = np.tile(np.float32([-1.5, -0.5, 0.5, 1.5, 2.5]), C // 5)
    w[5] *= 1e-4
    src, dst = tmp_path / "w.bin", tmp_path / "q.bin"
    src.write_bytes(struct.pack("<II", R, C) + w.tobytes())
    _run(binaries["dotprod"], "quant", src, dst)
    raw = dst.read_bytes()
    rb = quant.packed_row_bytes(C)
    sizes = [("q", R * C, np.int8), ("sq", R * 4, np.float32), ("t", R * C, np.int8),
             ("st", R * 4, np.float32), ("packed", R * rb, np.uint8), ("xq", C, np.int8), ("sx", 4, np.float32)]
    got, off = {}, 0
    for name, n, dt in sizes:
        got[name] = np.frombuffer(raw[off:off + n], dtype=dt)
        off += n
    assert off == len(raw)
    q, sq = quant.quantize_q8(w)
    t, st = quant.quantize_ternary(w)
    xq, sx = quant.quantize_activation(w[0])
    assert np.array_equal(got["q"].reshape(R, C), q) and np.array_equal(got["sq"].view(np.uint32), sq.view(np.uint32))
    assert np.array_equal(got["t"].reshape(R, C), t) and np.array_equal(got["st"].view(np.uint32), st.view(np.uint32))
    assert np.array_equal(got["packed"].reshape(R, rb), quant.pack_ternary(t))
    assert np.array_equal(got["xq"], xq) and got["sx"].view(np.uint32)[0] == np.float32(sx).view(np.uint32)


def _write_draft_file(path: Path, cfg, weights, tokens, ring=5):
    kinds = [0 if cfg.layer_kind(i) == "gdn" else 1 for i in cfg.draft_map]
    head = struct.pack("<8i", cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff, cfg.vocab, cfg.max_seq,
                       cfg.n_draft, ring)
    parts = [head, struct.pack(f"<{len(kinds)}i", *kinds), struct.pack("<2f", cfg.rope_theta, cfg.norm_eps)]
    names = ["tok_emb.weight", "final_norm.weight", "lm_head.weight"]
    for j, k in enumerate(kinds):
        p = f"draft.layers.{j}."
        names += [p + "attn_norm.weight"] + ([p + "mixer.conv"] if k == 0 else [])
        names += [p + "mixer.wqkv.weight", p + "mixer.wo.weight"]
        names += [p + "mixer.decay_logit", p + "mixer.beta_logit"] if k == 0 else []
        names += [p + "ffn_norm.weight", p + "mlp.w1.weight", p + "mlp.w3.weight", p + "mlp.w2.weight"]
    parts += [np.ascontiguousarray(weights[n], np.float32).tobytes() for n in names]
    parts.append(struct.pack(f"<i{len(tokens)}i", len(tokens), *[int(t) for t in tokens]))
    path.write_bytes(b"".join(parts))


def test_draft_step_on_arm64(binaries, tmp_path):
    from test_cdraft import random_weights
    weights = random_weights(CFG, 21)
    tokens = np.random.default_rng(3).integers(0, CFG.vocab, 16)
    src = tmp_path / "draft.bin"
    _write_draft_file(src, CFG, weights, tokens)
    outs = {}
    for kernel in ("dotprod", "addsub", "scalar"):
        for threads in (1, 3):
            dst = tmp_path / f"logits_{kernel}_{threads}.bin"
            text = _run(binaries["dotprod"], "draft", src, dst, KERNEL_IDS[kernel], threads)
            assert f"kernel={kernel} threads={threads} tokens=16" in text
            outs[kernel, threads] = np.frombuffer(dst.read_bytes(), np.float32).reshape(16, CFG.vocab)
    base = outs["scalar", 1]
    for key, v in outs.items():
        assert np.array_equal(v.view(np.uint32), base.view(np.uint32)), key
    # the arm64 build agrees with the x86 build (libm may differ in the last bits)
    from spel_mlx.native.cdraft import CDraft
    with CDraft(CFG, weights, threads=1) as d:
        host = d.forward_logits(tokens)
    assert np.abs(host - base).max() < 1e-4
    assert np.array_equal(host.argmax(1), base.argmax(1))


def test_x86_avx2_float_clones_identical(tmp_path):
    """On x86-64 glibc the float code has AVX2 target_clones; with -ffp-contract=off the
    AVX2 and baseline clones must give bit-identical logits (machines with and without
    AVX2 agree).  Built natively both ways from the same sources."""
    import platform
    if platform.machine() != "x86_64" or shutil.which("gcc") is None:
        pytest.skip("x86-64 with gcc only")
    from test_cdraft import random_weights
    weights = random_weights(CFG, 22)
    src = tmp_path / "draft.bin"
    _write_draft_file(src, CFG, weights, np.arange(16) % CFG.vocab)
    outs = []
    for extra in ([], ["-DSPEL_NO_CLONES"]):
        exe = tmp_path / ("st" + "".join(extra))
        cmd = ["gcc", "-O2", "-std=gnu11", "-ffp-contract=off", "-pthread", *extra, f"-I{NEON}",
               *map(str, SOURCES), "-lm", "-o", str(exe)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        dst = tmp_path / (exe.name + ".out")
        r = subprocess.run([str(exe), "draft", str(src), str(dst), "0", "1"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        outs.append(dst.read_bytes())
    assert outs[0] == outs[1]
