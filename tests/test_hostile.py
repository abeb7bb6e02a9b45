"""Hostile and broken inputs (issue 16): one test per numbered finding.

Each test says the finding it pins.  CLIs run in-process (``main()``) unless the test
needs an address-space limit, which only a subprocess may take."""
import json
import os
import resource
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

import spel_mlx  # noqa: F401  (the BLAS first)
from spel_mlx.cli import convert, verify_weights
from spel_mlx.checkpoints import CheckpointError, NonFiniteWeightsWarning, read_spelw, write_spelw
from spel_mlx.reader import load_checkpoint
from spel_mlx.checkpoints.files import AtomicFile
from spel_mlx.checkpoints.rules import config_from_fields
from spel_mlx.checkpoints.spelw import HEADER_SIZE, header_bytes, parse_header
from spel_mlx.config import LIMITS, ConfigError, ModelConfig
from spel_mlx.converters import CONFIG_FILE, MODEL_FILE, spelw_to_safetensors
from spel_mlx.converters.spelw_safetensors import config_json
from spel_mlx.model.state import DecodeState
from spel_mlx.synth import write_synth

TINY = ModelConfig(d_model=64, n_layers=4, n_heads=2, head_dim=16, d_ff=128, max_seq=64, draft_map=(0, 3))
GIB = 2 ** 30
OFF_MAX_SEQ = 32


def synth(path, cfg=TINY, seed=5):
    write_synth(path, cfg, seed, progress=False, target="numpy", draft="numpy")
    return path


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("hostile") / "m.spelw")


@pytest.fixture
def folder(tmp_path, model_file):
    d = tmp_path / "folder"
    spelw_to_safetensors(model_file, d)
    return d


def main(module, *args, capsys=None):
    rc = module.main([str(a) for a in args])
    err = capsys.readouterr().err if capsys else ""
    return rc, err


def limited_run(args, limit=3 * GIB, timeout=240):
    """A CLI in a subprocess under an address-space limit (and a timeout: no hang)."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPEL_")}
    env["OPENBLAS_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=cap, env=env)


def patch_u32(src, dst, offset, value):
    data = bytearray(src.read_bytes())
    data[offset:offset + 4] = int(value).to_bytes(4, "little")
    dst.write_bytes(bytes(data))
    return dst


def rewrite_config(folder, **fields):
    """Rewrite config.json and the spel.config metadata of a folder with ``fields``."""
    cj = folder / CONFIG_FILE
    d = json.loads(cj.read_text())
    d.update(fields)
    cj.write_text(json.dumps(d))
    raw = (folder / MODEL_FILE).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    hdr = json.loads(raw[8:8 + n])
    meta = json.loads(hdr["__metadata__"]["spel.config"])
    meta.update(fields)
    hdr["__metadata__"]["spel.config"] = json.dumps(meta)
    new = json.dumps(hdr).encode()
    new += b" " * (-len(new) % 8)
    (folder / MODEL_FILE).write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])


def vm_size() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


# 1 ------------------------------------------------------------------------------------

def test_1_max_seq_claim_allocates_nothing_up_front(tmp_path):
    """Finding 1: one header field (max_seq) decided memory.  The KV caches now grow with
    the positions used, in MLX and in C; a checkpoint whose implied memory exceeds what
    the process can allocate is refused (exit 2) before allocating."""
    huge = TINY.replace(max_seq=LIMITS["max_seq"])
    st = DecodeState(huge, "target")
    assert st.kv_capacity == 64 and st.k_cache[st.attn_layers[0]].shape[0] == 64
    from spel_mlx.native.cdraft import CDraft
    w = {k: np.asarray(v) for k, v in read_spelw(synth(tmp_path / "w.spelw")).tensors.items()}
    before = vm_size()
    d = CDraft(huge, w)
    for t in range(100):
        d.step(t % TINY.vocab)
    # up front this was 2 x 2^24 x H*hd floats (256 MiB) per attention layer
    assert vm_size() - before < 64 * 2 ** 20
    d.close()

    small_hd = ModelConfig(d_model=64, n_layers=4, n_heads=2, head_dim=2, d_ff=64, max_seq=64, draft_map=(0, 3))
    ok = patch_u32(synth(tmp_path / "s.spelw", small_hd), tmp_path / "s2.spelw", OFF_MAX_SEQ, 1 << 24)
    r = limited_run(["spel_mlx.verify_weights", ok])
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
    big = patch_u32(synth(tmp_path / "b.spelw", TINY.replace(head_dim=64, n_heads=1)), tmp_path / "b2.spelw",
                    OFF_MAX_SEQ, 1 << 24)        # its RoPE table follows the positions used (was ~20 GiB)
    r = limited_run(["spel_mlx.verify_weights", big])
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
    from test_spelw import tiny_tensors
    wide = TINY.replace(n_heads=1, head_dim=8192)    # GDN state rings of 8192^2 floats a slot: ~8 GiB
    write_spelw(tmp_path / "w.spelw", wide, tiny_tensors(wide))
    r = limited_run(["spel_mlx.verify_weights", tmp_path / "w.spelw"])
    assert r.returncode == 2 and "loading it needs about" in r.stderr and "[memory]" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1


# 2 ------------------------------------------------------------------------------------

def test_2_layer_count_from_config_json_is_capped(folder, tmp_path):
    """Finding 2: n_layers 2^31 or 2^63 in config.json spun building tensor specs until
    MemoryError; every field is now bounded by config.LIMITS in both readers."""
    script = ("import sys; from spel_mlx.reader import load_checkpoint; from spel_mlx.checkpoints import CheckpointError\n"
              "try:\n    load_checkpoint(sys.argv[1])\nexcept CheckpointError as e:\n    print(e)\n")
    for n in (2 ** 31, 2 ** 63):
        rewrite_config(folder, n_layers=n)
        r = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True,
                           timeout=60, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (2 * GIB, 2 * GIB)))
        assert r.returncode == 0 and f"n_layers={n} out of range 1..{LIMITS['n_layers']}" in r.stdout, r


# 3 ------------------------------------------------------------------------------------

def test_3_deep_json_nesting_is_a_named_error(folder, capsys):
    """Finding 3: deeply nested JSON (config.json, the safetensors header) raised
    RecursionError, reported as an internal error (exit 3); now exit 2, named."""
    cj = folder / CONFIG_FILE
    good = cj.read_text()
    cj.write_text('{"d_model": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(CheckpointError, match="config.json.*nested too deeply"):
        load_checkpoint(folder)
    rc, err = main(verify_weights, folder, capsys=capsys)
    assert rc == 2 and "nested too deeply" in err and err.count("\n") == 1
    cj.write_text(good)
    deep = b'{"a":' + b"[" * 100000 + b"]" * 100000 + b"}"
    deep += b" " * (-len(deep) % 8)
    (folder / MODEL_FILE).write_bytes(len(deep).to_bytes(8, "little") + deep)
    rc, err = main(verify_weights, folder, capsys=capsys)
    assert rc == 2 and "bad JSON header: nested too deeply [header at byte 8]" in err, err


# 4 ------------------------------------------------------------------------------------

def test_4_max_seq_below_golden_count_is_refused(model_file, folder, tmp_path, capsys):
    """Finding 4: max_seq smaller than the golden token count was accepted, and verify
    then failed with an internal ValueError (exit 3).  Both readers and the writer
    refuse it now (the golden tokens are fed one per position)."""
    bad = patch_u32(model_file, tmp_path / "short.spelw", OFF_MAX_SEQ, 8)
    with pytest.raises(CheckpointError, match=r"golden token count n=16 out of range 1\.\.8 \(max_seq=8\)"):
        read_spelw(bad)
    rc, err = main(verify_weights, bad, capsys=capsys)
    assert rc == 2 and "max_seq=8" in err and "footer n at byte" in err
    rewrite_config(folder, max_seq=8)
    with pytest.raises(CheckpointError, match=r"n=16 out of range 1\.\.8.*golden\.tokens at byte"):
        load_checkpoint(folder)
    f = read_spelw(model_file)
    with pytest.raises(CheckpointError, match="max_seq=8"):
        write_spelw(tmp_path / "never.spelw", TINY.replace(max_seq=8), f.tensors, f.golden)
    assert not (tmp_path / "never.spelw").exists()


# 5 ------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("rope_theta", float("inf")), ("rope_theta", 1e300),
                                         ("rope_theta", float("nan")), ("norm_eps", 1e-50),
                                         ("rope_theta", 10 ** 400)])
def test_5_non_finite_or_unrepresentable_floats_are_refused(folder, tmp_path, capsys, field, value):
    """Finding 5: rope_theta Infinity loaded and convert wrote a SPELW001 file the
    project's own reader rejected; 1e300 crashed convert (exit 3).  Floats must now be
    finite and positive as float32 in both readers, so convert refuses (exit 2)."""
    rewrite_config(folder, **{field: value})
    with pytest.raises(CheckpointError, match=field):
        load_checkpoint(folder)
    out = tmp_path / "out.spelw"
    rc, err = main(convert, folder, out, "--quiet", capsys=capsys)
    assert rc == 2 and field in err and err.count("\n") == 1, err
    assert not out.exists()


def test_5_nothing_written_that_the_readers_refuse(tmp_path):
    """The writers and both readers apply one rule (ModelConfig.validate): over random
    configurations around every bound, a config is either refused by all of them or
    written and read back identically by both."""
    rng = np.random.default_rng(16)
    picks = {k: [1, 2, 3, cap - 1, cap, cap + 1, 0] for k, cap in LIMITS.items() if k != "spec_k"}
    floats = [1e-5, 10000.0, 3.4e38, 3.5e38, 1e-46, 1e-44, 0.0, -1.0, float("inf"), float("nan")]
    accepted = refused = 0
    for _ in range(400):
        kw = {k: int(rng.choice(v)) if rng.random() < 0.3 else getattr(TINY, k) for k, v in picks.items()}
        kw.update(rope_theta=float(rng.choice(floats)) if rng.random() < 0.3 else 10000.0,
                  norm_eps=float(rng.choice(floats)) if rng.random() < 0.3 else 1e-5,
                  draft_map=tuple(int(x) for x in rng.integers(0, 300, rng.integers(0, 10))) if rng.random() < 0.3
                  else (0,))
        cfg = ModelConfig(**kw)
        try:
            cfg.validate()
        except ConfigError:
            refused += 1
            with pytest.raises(ValueError):
                header_bytes(cfg, 0)
            fields = {k: (list(v) if k == "draft_map" else v) for k, v in kw.items()}
            with pytest.raises(CheckpointError):
                config_from_fields(fields, "cfg", "config.json")
            continue
        accepted += 1
        h = header_bytes(cfg, 0)
        back = parse_header(h).cfg
        assert header_bytes(back, 0) == h
        assert config_from_fields(json.loads(json.dumps(config_json(back))), "c", "config.json") == back
    assert accepted > 50 and refused > 50, (accepted, refused)


# 6 ------------------------------------------------------------------------------------

def test_6_convert_never_overwrites_its_source(folder, model_file, tmp_path, capsys):
    """Finding 6: ``convert FOLDER FOLDER/model.safetensors`` replaced the source with
    SPELW001 bytes (exit 0).  A destination that is, contains or lies inside the source
    is refused (real paths, symlinks, same inode); an existing one needs --force."""
    snapshot = {p.name: p.read_bytes() for p in folder.iterdir()}
    (tmp_path / "link").symlink_to(folder)
    (tmp_path / "link2").symlink_to(model_file.parent)
    other = tmp_path / "other"
    other.mkdir()
    os.link(folder / MODEL_FILE, other / "hard.spelw")
    (tmp_path / "hl").mkdir()
    os.link(model_file, tmp_path / "hl" / MODEL_FILE)
    cases = [(folder, folder / MODEL_FILE, "inside the source folder"),
             (folder, folder / "sub" / "x.spelw", "inside the source folder"),
             (folder, tmp_path / "link" / MODEL_FILE, "inside the source folder"),
             (folder / MODEL_FILE, tmp_path / "link" / MODEL_FILE, "is the source"),
             (folder, other / "hard.spelw", "is the source"),
             (folder / MODEL_FILE, folder / CONFIG_FILE, "is the source"),
             (model_file, tmp_path / "hl", "would replace the source file"),
             (model_file, model_file.parent, "contains the source"),
             (model_file, tmp_path / "link2", "contains the source")]
    for src, dst, why in cases:
        rc, err = main(convert, src, dst, "--quiet", "--force", capsys=capsys)
        assert rc == 2 and why in err and err.count("\n") == 1, (src, dst, err)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == snapshot
    out = tmp_path / "out.spelw"
    out.write_bytes(b"precious")
    rc, err = main(convert, folder, out, "--quiet", capsys=capsys)
    assert rc == 2 and "already exists: pass --force" in err and out.read_bytes() == b"precious"
    assert main(convert, folder, out, "--quiet", "--force", capsys=capsys)[0] == 0
    assert out.read_bytes() == model_file.read_bytes()
    rc, err = main(convert, model_file, folder, "--quiet", capsys=capsys)
    assert rc == 2 and "already exists" in err
    assert main(convert, model_file, folder, "--quiet", "--force", capsys=capsys)[0] == 0


# 7 ------------------------------------------------------------------------------------

def test_7_quantizers_are_defined_for_non_finite_values():
    """Finding 7: (int8_t) of NaN or inf was undefined behaviour in the q8 and ternary
    quantizers.  NaN now codes 0, +-inf saturate to +-127 (the sanitizer build,
    tests/test_neon_sanitize.py, checks there is no UB left)."""
    from spel_mlx.native.cdraft import c_quantize_activation, c_quantize_q8, c_quantize_ternary
    row = np.array([[np.nan, 1.0, -2.0, np.inf, -np.inf, 0.5]], np.float32)
    q, s = c_quantize_q8(row)
    assert q[0, 0] == 0 and q[0, 3] == 127 and q[0, 4] == -127 and np.isfinite(s).all()
    xq, sx = c_quantize_activation(row[0])
    assert list(xq[[0, 3, 4]]) == [0, 127, -127] and np.isfinite(sx)
    t, _ = c_quantize_ternary(np.vstack([row, np.full_like(row, np.nan)]))
    assert set(np.unique(t)) <= {-1, 0, 1} and (t[1] == 0).all()


# 8 ------------------------------------------------------------------------------------

def test_8_one_cdraft_from_two_threads_is_refused_not_corrupted(model_file):
    """Finding 8: one CDraft used from two Python threads corrupted memory.  A second
    thread entering a call now gets DraftBusyError; the engine stays consistent."""
    from spel_mlx.native.cdraft import CDraft, DraftBusyError
    w = read_spelw(model_file).tensors
    d, fresh = CDraft(TINY, w), CDraft(TINY, w)
    busy, errors = [0, 0], []

    def hammer(i):
        try:
            for n in range(20000):
                if busy[0] and busy[1] and n > 200:
                    return
                try:
                    if d.pos > TINY.max_seq - 6:
                        d.reset()
                    d.propose(n % TINY.vocab, 3)
                    d.commit(2)
                except DraftBusyError:
                    busy[i] += 1
                except ValueError as e:       # the other thread moved the state in between
                    if "commit" not in str(e) and "max_seq" not in str(e):
                        raise
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    th = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    [t.start() for t in th]
    [t.join() for t in th]
    assert not errors and sum(busy) > 0, (errors, busy)
    d.reset()
    toks = np.arange(20) % TINY.vocab
    assert d.forward_logits(toks).tobytes() == fresh.forward_logits(toks).tobytes()
    d.close()
    fresh.close()


# 9 ------------------------------------------------------------------------------------

def test_9_killed_conversion_temp_files_are_cleaned(folder, tmp_path):
    """Finding 9a: kill -9 during conversion left hidden .tmp files nothing removed.
    The next conversion to the same place removes them (a live writer's are kept)."""
    dst = tmp_path / "out.spelw"
    script = ("import sys, time; from spel_mlx.checkpoints import SpelwWriter; from spel_mlx.config import ModelConfig\n"
              "w = SpelwWriter(sys.argv[1], ModelConfig()); print(w.tmp_path, flush=True); time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", script, str(dst)], stdout=subprocess.PIPE, text=True)
    tmp = p.stdout.readline().strip()
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert os.path.exists(tmp) and tmp.endswith(".tmp")
    live = AtomicFile(dst)                       # a writer still at work: its file stays
    assert convert.convert(str(folder), str(dst), progress=False) == "safetensors -> SPELW001"
    assert not os.path.exists(tmp) and os.path.exists(live.tmp_path)
    live.abort()
    assert sorted(os.listdir(tmp_path)) == ["folder", "out.spelw"]


def test_9_non_finite_weights_warn_or_are_refused(model_file, tmp_path, capsys):
    """Finding 9b: NaN target weights generated garbage with exit 0 and no warning.
    Loading warns naming the tensor (verify then FAILs); non-finite draft weights are
    refused by the C draft naming the tensor (exit 2)."""
    f = read_spelw(model_file)
    t = {k: np.array(v) for k, v in f.tensors.items()}
    t["layers.1.mlp.w1.weight"][3, 5] = np.nan
    nan_target = tmp_path / "nt.spelw"
    write_spelw(nan_target, TINY, t, f.golden)
    with pytest.warns(NonFiniteWeightsWarning, match="layers.1.mlp.w1.weight"):
        load_checkpoint(nan_target)
    with pytest.warns(NonFiniteWeightsWarning):
        rc, _ = main(verify_weights, nan_target, capsys=capsys)
    assert rc == 1
    t = {k: np.array(v) for k, v in f.tensors.items()}
    t["draft.layers.1.mlp.w2.weight"][0, 0] = np.inf
    inf_draft = tmp_path / "id.spelw"
    write_spelw(inf_draft, TINY, t, f.golden)
    with pytest.warns(NonFiniteWeightsWarning):
        rc, err = main(verify_weights, inf_draft, "--target", "numpy", capsys=capsys)
    assert rc == 2 and "draft.layers.1.mlp.w2.weight holds a non-finite value" in err.splitlines()[-1], err
    assert HEADER_SIZE == 64
