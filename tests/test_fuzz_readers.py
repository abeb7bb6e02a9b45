"""A bounded fuzz test of both checkpoint readers (issue 16).

Structured mutations of a small SPELW001 file and of a safetensors folder (header
bytes and fields, footer, truncation, the safetensors JSON header: dtypes, shapes,
offsets, metadata, nesting; config.json: every field set to hostile values), each
loaded with ``load_checkpoint``.  Every case must end in a named error
(CheckpointError, one line, naming the file) or a successful load whose tensors can
all be read.  The cases run in a subprocess under an address-space limit and a
timeout, so a runaway allocation or a hang fails the test instead of the machine.
Fixed seed and a fixed number of cases (the same cases on every machine, however slow),
the timeout far above what they take.

Run by hand: ``python tests/test_fuzz_readers.py DIR SEED CASES``.
"""
import json
import os
import random
import resource
import struct
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

SEED, CASES, TIMEOUT_S, LIMIT = 20261201, 3000, 1800, 2 * 2 ** 30
INTS = [0, 1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 63, 64, 65, 127, 128, 255, 256, 4095, 4096, 4097, 1 << 16,
        1 << 17, (1 << 17) + 1, 1 << 20, 1 << 22, 1 << 24, (1 << 24) + 1, 1 << 31, (1 << 32) - 1]
FLOATS = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-45, 1e-50, 3.4e38, 3.5e38, 1e300, -1.0, 10000.0]


def hostile_value(rng):
    """A JSON value chosen to break a reader."""
    return rng.choice([
        lambda: rng.choice(INTS), lambda: rng.choice(FLOATS), lambda: -rng.choice(INTS),
        lambda: 2 ** 63, lambda: 10 ** 400, lambda: "8", lambda: None, lambda: True, lambda: [], lambda: {},
        lambda: [rng.choice(INTS)] * rng.randint(0, 12), lambda: [[0]], lambda: [0.5, 1],
        lambda: nested(rng.randint(10, 200000)),
    ])()


def nested(depth):
    return json.loads("[" * depth + "]" * depth) if depth < 900 else RawDeep(depth)


class RawDeep:
    """Nesting deeper than json.dumps can write: spliced in as text."""

    def __init__(self, depth):
        self.depth = depth


def dumps(obj) -> str:
    deep = []

    def enc(o):
        if isinstance(o, RawDeep):
            deep.append(o.depth)
            return f"@@DEEP{len(deep) - 1}@@"
        raise TypeError
    s = json.dumps(obj, default=enc)
    for i, d in enumerate(deep):
        s = s.replace(f'"@@DEEP{i}@@"', "[" * d + "]" * d)
    return s


# --------------------------------------------------------------------------- mutations

def mutate_spelw(rng, base: bytes, footer_at: int) -> bytes:
    b = bytearray(base)
    kind = rng.randrange(7)
    if kind == 0:                                   # bit flips, mostly in the header
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(64) if rng.random() < 0.7 else rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
    elif kind == 1:                                 # a u32 header field
        struct.pack_into("<I", b, 8 + 4 * rng.randrange(9), rng.choice(INTS + [rng.getrandbits(32)]))
    elif kind == 2:                                 # rope_theta / norm_eps
        off = rng.choice((52, 56))
        if rng.random() < 0.8:
            struct.pack_into("<f", b, off, rng.choice(FLOATS[:8]) if rng.random() < 0.9 else 3.4e38)
        else:
            struct.pack_into("<I", b, off, rng.getrandbits(32))
    elif kind == 3:                                 # truncation / trailing bytes
        if rng.random() < 0.6:
            del b[rng.randrange(len(b) + 1):]
        else:
            b += bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 100)))
    elif kind == 4:                                 # footer n, flags, footer magic
        end = footer_at
        which = rng.randrange(3)
        if which == 0:
            struct.pack_into("<I", b, end + 8, rng.choice(INTS))
        elif which == 1:
            struct.pack_into("<I", b, 60, rng.choice([0, 2, 3, rng.getrandbits(32)]))
        else:
            b[end + rng.randrange(8)] ^= 1 << rng.randrange(8)
    elif kind == 5:                                 # draft_map bytes
        for _ in range(rng.randint(1, 3)):
            b[44 + rng.randrange(8)] = rng.choice([0, 1, 2, 3, 4, 254, 255, rng.getrandbits(8)])
    else:                                           # random splice anywhere
        i = rng.randrange(len(b))
        b[i:i + rng.randint(1, 16)] = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 16)))
    return bytes(b)


def mutate_folder(rng, model: bytes, config: str):
    """(model.safetensors bytes, config.json bytes or None to delete it)."""
    n = int.from_bytes(model[:8], "little")
    hdr, data = json.loads(model[8:8 + n]), model[8 + n:]
    cfg = json.loads(config)
    kind = rng.randrange(6)
    cfg_bytes = config.encode()
    if kind == 0:                                   # a tensor entry
        name = rng.choice([k for k in hdr if k != "__metadata__"])
        e = hdr[name]
        field = rng.choice(["dtype", "shape", "data_offsets", "drop", "extra", "whole"])
        if field == "dtype":
            e["dtype"] = rng.choice(["F16", "BF16", "I8", "U32", "F64", "BOOL", "Q4", "", 5])
        elif field == "shape":
            e["shape"] = rng.choice([[], [-1], [1 << 40, 1 << 40], [0], [2.5], ["4"], hostile_value(rng)])
        elif field == "data_offsets":
            a, z = e["data_offsets"]
            e["data_offsets"] = rng.choice([[z, a], [a, a], [a, z + 4], [a, 1 << 62], [-4, z], [a], hostile_value(rng)])
        elif field == "drop":
            del hdr[name]
        elif field == "extra":
            hdr["junk." + name] = dict(e)
        else:
            hdr[name] = hostile_value(rng)
    elif kind == 1:                                 # the metadata config
        meta = hdr.setdefault("__metadata__", {})
        mc = json.loads(meta.get("spel.config", "{}"))
        mc[rng.choice(list(mc) or ["d_model"])] = hostile_value(rng)
        meta["spel.config"] = dumps(mc) if rng.random() < 0.9 else rng.choice(["{", "[]", "null", "1e999"])
        if rng.random() < 0.2:
            meta[rng.choice(["spel.flags", "format"])] = rng.choice(["2", "x", 1, None])
    elif kind == 2:                                 # config.json fields (metadata config removed)
        hdr.get("__metadata__", {}).pop("spel.config", None)
        for _ in range(rng.randint(1, 3)):
            key = rng.choice(list(cfg) + ["n_draft", "spec_k"])
            if rng.random() < 0.15:
                cfg.pop(key, None)
            else:
                cfg[key] = hostile_value(rng)
        cfg_bytes = dumps(cfg).encode()
    elif kind == 3:                                 # config.json bytes themselves
        hdr.get("__metadata__", {}).pop("spel.config", None)
        cfg_bytes = rng.choice([b"\xff\xfe{}", b"", b"[" * 100000, b" " * (2 << 20), b'{"d_model": 1e999}',
                                config.encode()[:rng.randrange(len(config))], None])
    elif kind == 4:                                 # deep nesting in the header
        hdr[rng.choice(list(hdr))] = nested(rng.randint(100, 200000))
    else:                                           # truncated data / wrong header length
        data = data[:rng.randrange(len(data) + 1)]
    raw = dumps(hdr).encode()
    raw += b" " * (-len(raw) % 8)
    length = len(raw) if rng.random() < 0.9 else rng.choice([0, 7, len(raw) + 8, 1 << 40, rng.getrandbits(64)])
    return length.to_bytes(8, "little") + raw + data, cfg_bytes


# --------------------------------------------------------------------------- driver

def run(workdir: Path, seed: int, cases: int) -> dict:
    import numpy as np

    import spel_mlx  # noqa: F401
    from spel_mlx.checkpoints import CheckpointError, Golden, write_spelw
    from spel_mlx.reader import load_checkpoint
    from spel_mlx.checkpoints.footer import footer_nbytes
    from spel_mlx.config import ModelConfig
    from spel_mlx.converters import CONFIG_FILE, MODEL_FILE, spelw_to_safetensors
    from spel_mlx.layout import tensor_specs

    cfg = ModelConfig(d_model=8, n_layers=2, n_heads=1, head_dim=8, d_ff=16, vocab=16, max_seq=32,
                      attn_period=2, draft_map=(0, 1))
    r = np.random.default_rng(seed)
    base_path = workdir / "base.spelw"
    g = Golden(r.integers(0, 16, 4).astype(np.uint32), r.standard_normal((4, 16)).astype(np.float32),
               r.standard_normal((4, 16)).astype(np.float32))
    write_spelw(base_path, cfg, {s.name: r.standard_normal(s.shape).astype(np.float32) for s in tensor_specs(cfg)}, g)
    spelw_to_safetensors(base_path, workdir / "base")
    base = base_path.read_bytes()
    footer_at = len(base) - footer_nbytes(g.n, cfg.vocab)
    model, config = (workdir / "base" / MODEL_FILE).read_bytes(), (workdir / "base" / CONFIG_FILE).read_text()
    rng = random.Random(seed)
    outcomes, failures = Counter(), []
    case_file, case_dir = workdir / "case.spelw", workdir / "case"
    case_dir.mkdir()
    for i in range(cases):
        kind = "spelw" if i % 2 == 0 else "folder"
        if kind == "spelw":
            case_file.write_bytes(mutate_spelw(rng, base, footer_at))
            path = case_file
        else:
            m, c = mutate_folder(rng, model, config)
            (case_dir / MODEL_FILE).write_bytes(m)
            if c is None:
                (case_dir / CONFIG_FILE).unlink(missing_ok=True)
            else:
                (case_dir / CONFIG_FILE).write_bytes(c)
            path = case_dir
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ck = load_checkpoint(str(path))
            for a in ck.weights.values():             # every tensor readable
                float(np.asarray(a, np.float64).sum())
            if ck.golden is not None:
                float(np.asarray(ck.golden.target_logits).sum() + np.asarray(ck.golden.tokens).sum())
            outcomes[kind + " loaded"] += 1
        except CheckpointError as e:
            msg = str(e)
            if "\n" in msg or not msg.startswith(e.path) or str(path) not in e.path:
                failures.append(f"{kind} case {i}: error not one line naming the file: {msg[:200]}")
            outcomes[kind + " named error"] += 1
        except Exception as e:  # noqa: BLE001 - the finding
            failures.append(f"{kind} case {i}: {type(e).__name__}: {str(e)[:200]}")
    return {"cases": cases, "outcomes": dict(outcomes), "failures": failures[:20], "n_failures": len(failures)}


def test_both_readers_survive_fuzzing(tmp_path):
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPEL_")}
    env["OPENBLAS_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, __file__, str(tmp_path), str(SEED), str(CASES)], capture_output=True,
                       text=True, timeout=TIMEOUT_S, preexec_fn=cap, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["n_failures"] == 0, res["failures"]
    for outcome in ("spelw loaded", "spelw named error", "folder loaded", "folder named error"):
        assert res["outcomes"].get(outcome, 0) >= 20, res     # both outcomes really happen
    assert res["cases"] == CASES and sum(res["outcomes"].values()) == CASES, res


if __name__ == "__main__":
    sys.setrecursionlimit(1000)
    print(json.dumps(run(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))))
