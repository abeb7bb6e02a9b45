"""synth / verify_weights / convert CLIs: exit codes, one-line errors, PASS/FAIL."""
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import spel_mlx  # noqa: F401
from spel_mlx import golden
from spel_mlx.config import ModelConfig
from spel_mlx.checkpoints.spelw import HEADER_SIZE, read_spelw

CFG = "d_model=64,n_layers=4,n_heads=2,head_dim=16,d_ff=128,max_seq=64,draft_map=0:3"
TINY = ModelConfig(d_model=64, n_layers=4, n_heads=2, head_dim=16, d_ff=128, max_seq=64, draft_map=(0, 3))


def run(*args, env=None, cwd=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith("SPEL_")}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=e, cwd=cwd,
                          timeout=300)


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def call(capsys, monkeypatch):
    """Run a CLI's main() in-process (same code path as -m, without a new
    interpreter: the 2-core test machine is shared)."""
    from spel_mlx.cli import convert, synth, verify_weights
    mains = {"spel_mlx.synth": synth.main, "spel_mlx.verify_weights": verify_weights.main,
             "spel_mlx.convert": convert.main}

    def _call(module, *args, env=None):
        for k in [k for k in os.environ if k.startswith("SPEL_")]:
            monkeypatch.delenv(k)
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        capsys.readouterr()
        try:
            rc = mains[module](list(args))
        except SystemExit as e:
            rc = e.code
        out, err = capsys.readouterr()
        return Result(rc, out, err)
    return _call


def one_line_error(r, *fragments, code=2):
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])


@pytest.fixture(scope="module")
def synth_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    p = d / "tiny.spelw"
    r = run("spel_mlx.synth", "--config", CFG, "--seed", "7", "--out", str(p), "--quiet")
    assert r.returncode == 0, r.stderr
    return p


def test_synth_writes_valid_deterministic_file(synth_file, tmp_path):
    f = read_spelw(synth_file)
    assert f.cfg == TINY and f.golden is not None and f.golden.n == 16
    assert np.array_equal(f.golden.tokens, golden.golden_tokens(TINY, 7))
    again = tmp_path / "again.spelw"
    from spel_mlx.synth import write_synth
    write_synth(again, TINY, 7, progress=False)
    assert again.read_bytes() == synth_file.read_bytes()
    # decay logits give a = sigmoid in ~[0.9, 0.99]
    a = 1 / (1 + np.exp(-f.tensors["layers.0.mixer.decay_logit"]))
    assert a.min() > 0.89 and a.max() < 0.991


def test_synth_golden_matches_references(synth_file):
    """Footer target logits agree with the independent numpy forward; draft logits
    with the numpy fake-quant draft (or the C engine) on every argmax."""
    f = read_spelw(synth_file)
    tn = golden.target_logits_numpy(TINY, f.tensors, f.golden.tokens)
    assert np.abs(tn - f.golden.target_logits).max() < 1e-4
    assert (tn.argmax(1) == f.golden.target_logits.argmax(1)).all()
    dn = golden.draft_logits_numpy(TINY, f.tensors, f.golden.tokens)
    assert np.abs(dn - f.golden.draft_logits).max() < 1e-3


def test_verify_pass(synth_file, call):
    r = run("spel_mlx.verify_weights", str(synth_file))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert out.strip().splitlines()[-1] == "PASS"
    assert f"target params: {TINY.target_params():,}" in out and f"draft params:  {TINY.draft_params():,}" in out
    assert f"file size: {os.path.getsize(synth_file):,} bytes" in out
    assert "argmax 16/16" in out
    # an explicit config that agrees with the header is fine
    assert call("spel_mlx.verify_weights", str(synth_file), "--config", "d_model=64,spec_k=2").returncode == 0


def test_verify_fail_on_tampered_weight(synth_file, tmp_path):
    f = read_spelw(synth_file)
    start, _ = f.spans["lm_head.weight"]
    data = bytearray(synth_file.read_bytes())
    (v,) = struct.unpack_from("<f", data, start)
    struct.pack_into("<f", data, start, v + 0.5)   # one weight of the head row for token 0
    t = tmp_path / "tampered.spelw"
    t.write_bytes(bytes(data))
    r = run("spel_mlx.verify_weights", str(t))
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == "FAIL"


def test_verify_tolerance_env(synth_file, call):
    r = call("spel_mlx.verify_weights", str(synth_file), env={"SPEL_VERIFY_TOL": "abc"})
    one_line_error(r, "SPEL_VERIFY_TOL")


def test_verify_malformed_inputs(synth_file, tmp_path, call):
    data = synth_file.read_bytes()
    cut = tmp_path / "cut.spelw"
    cut.write_bytes(data[:HEADER_SIZE + 1000])
    one_line_error(run("spel_mlx.verify_weights", str(cut)), str(cut), "tok_emb.weight", "byte 64")
    bad = tmp_path / "magic.spelw"
    bad.write_bytes(b"XXXXXXXX" + data[8:])
    one_line_error(call("spel_mlx.verify_weights", str(bad)), "bad magic", "byte 0")
    dm = bytearray(data)
    dm[45] = 0xFF
    dmp = tmp_path / "dm.spelw"
    dmp.write_bytes(bytes(dm))
    one_line_error(call("spel_mlx.verify_weights", str(dmp)), "draft_map[1]", "byte 45")
    one_line_error(call("spel_mlx.verify_weights", str(tmp_path / "missing.spelw")), "missing.spelw")
    one_line_error(call("spel_mlx.verify_weights", str(synth_file), "--config", "d_model=128"),
                   "d_model=128 contradicts")
    one_line_error(call("spel_mlx.verify_weights", str(synth_file), env={"SPEL_N_LAYERS": "8"}), "n_layers=8")


def test_verify_without_footer_fails(tmp_path, call):
    p = tmp_path / "nf.spelw"
    from spel_mlx.synth import write_synth
    write_synth(p, TINY, 3, progress=False, golden=False)
    r = call("spel_mlx.verify_weights", str(p))
    assert r.returncode == 1 and "FAIL" in r.stdout


def test_convert_cli_round_trip_and_errors(synth_file, tmp_path, call):
    d = tmp_path / "folder"
    r = run("spel_mlx.convert", str(synth_file), str(d))
    assert r.returncode == 0, r.stderr
    assert "100%" in r.stderr                          # progress on stderr
    back = tmp_path / "back.spelw"
    assert call("spel_mlx.convert", str(d), str(back), "--quiet").returncode == 0
    assert back.read_bytes() == synth_file.read_bytes()
    assert call("spel_mlx.verify_weights", str(d)).returncode == 0
    cut = tmp_path / "cut.bin"
    cut.write_bytes(synth_file.read_bytes()[:5000])
    out = tmp_path / "never"
    one_line_error(run("spel_mlx.convert", str(cut), str(out)), str(cut), "truncated", "byte")
    assert not out.exists()
    one_line_error(call("spel_mlx.convert", str(tmp_path / "nope.spelw"), str(out)), "no such file")
    (tmp_path / "bad.safetensors").write_bytes(b"\x04\0\0\0\0\0\0\0{{{{")
    one_line_error(call("spel_mlx.convert", str(tmp_path / "bad.safetensors"), str(tmp_path / "o.spelw")),
                   "bad JSON header", "byte")
    assert not (tmp_path / "o.spelw").exists()
    assert sorted(os.listdir(tmp_path)) == ["back.spelw", "bad.safetensors", "cut.bin", "folder"]


def test_convert_f16_recomputes_golden_and_verifies(synth_file, tmp_path, call):
    d = tmp_path / "f16"
    r = run("spel_mlx.convert", str(synth_file), str(d), "--dtype", "f16")
    assert r.returncode == 0, r.stderr
    assert "100%" in r.stderr           # the bar counts the bytes written (half those read)
    v = call("spel_mlx.verify_weights", str(d))
    assert v.returncode == 0 and "safetensors (F16)" in v.stdout, v.stdout + v.stderr


def test_synth_bad_config_exit_2(tmp_path, call):
    one_line_error(run("spel_mlx.synth", "--config", "d_model=64,bogus=1", "--out", str(tmp_path / "x")),
                   "bogus")
    one_line_error(call("spel_mlx.synth", "--config", "draft_map=0:99", "--out", str(tmp_path / "x")), "99")
    assert os.listdir(tmp_path) == []


def test_c_draft_matches_numpy_fakequant(synth_file):
    """The golden draft path (C engine when it builds) agrees with the numpy
    fake-quant reference of SPEC 3 on every argmax."""
    try:
        from spel_mlx.native.cdraft import CDraft  # noqa: F401
    except (ImportError, OSError) as e:
        pytest.skip(f"C draft unavailable: {e}")
    f = read_spelw(synth_file)
    c = golden.compute_draft(TINY, f.tensors, f.golden.tokens, prefer="c")
    n = golden.compute_draft(TINY, f.tensors, f.golden.tokens, prefer="numpy")
    assert np.abs(c - n).max() < 1e-4
    assert (c.argmax(1) == n.argmax(1)).all()


def test_default_checkpoint_message(monkeypatch, tmp_path):
    from spel_mlx.checkpoints import CheckpointError
    from spel_mlx.checkpoints import load as checkpoint
    from spel_mlx.reader import load_checkpoint
    monkeypatch.setattr(checkpoint, "DEFAULT_DIR", tmp_path / "default")
    monkeypatch.delenv("SPEL_WEIGHTS", raising=False)
    with pytest.raises(CheckpointError, match="no trained checkpoint is installed.*spel_mlx.convert"):
        load_checkpoint()
    monkeypatch.setenv("SPEL_WEIGHTS", str(tmp_path / "w.spelw"))
    with pytest.raises(CheckpointError, match="w.spelw: no such file"):
        load_checkpoint()


def test_unexpected_exception_is_one_line_exit_3(monkeypatch, capsys, tmp_path):
    import spel_mlx.cli.convert as conv
    import spel_mlx.cli.verify_weights as vw

    def boom(*a, **k):
        raise RuntimeError("first line\nsecond line")

    monkeypatch.setattr(vw, "verify", boom)
    monkeypatch.delenv("SPEL_DEBUG", raising=False)
    assert vw.main([str(tmp_path / "x.spelw")]) == 3
    err = capsys.readouterr().err
    assert err == "verify_weights: internal error: RuntimeError: first line\n"
    monkeypatch.setattr(conv, "convert", boom)
    assert conv.main([str(tmp_path / "a.spelw"), str(tmp_path / "b")]) == 3
    assert capsys.readouterr().err == ("convert: internal error (no output written): "
                                       "RuntimeError: first line\n")
    monkeypatch.setenv("SPEL_DEBUG", "1")
    with pytest.raises(RuntimeError, match="first line"):
        vw.main([str(tmp_path / "x.spelw")])


def test_shipped_models_by_short_name(monkeypatch, tmp_path):
    from spel_mlx.checkpoints.load import ASSETS_DIR, DEFAULT_DIR, SHIPPED, resolve_checkpoint_path
    from spel_mlx.reader import load_checkpoint
    monkeypatch.delenv("SPEL_WEIGHTS", raising=False)
    assert SHIPPED["spel-21m"] == DEFAULT_DIR.name
    monkeypatch.chdir(tmp_path)
    assert resolve_checkpoint_path("spel-8m") == str(ASSETS_DIR / "spel-8m")
    monkeypatch.setenv("SPEL_WEIGHTS", "spel-21m")
    assert resolve_checkpoint_path() == str(DEFAULT_DIR)
    (tmp_path / "spel-8m").mkdir()                 # a local folder of that name wins
    assert resolve_checkpoint_path("spel-8m") == "spel-8m"
    with pytest.raises(Exception, match="spel-8m"):
        load_checkpoint("spel-8m")                 # ... and is read (empty: an error naming it)
    monkeypatch.chdir(ASSETS_DIR.parent.parent)
    for name in SHIPPED:                           # each shipped model: its golden logits reproduce
        ck = load_checkpoint(name)
        assert ck.stored_dtype == "F16, draft packed", name
        r = run("spel_mlx.verify_weights", name)
        assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "PASS", r.stdout + r.stderr


def test_config_json_spec_k_is_the_models_default_k(tmp_path, monkeypatch):
    import json
    import shutil
    from spel_mlx.checkpoints import CheckpointError
    from spel_mlx.loading import decoding_config
    from spel_mlx.reader import load_checkpoint
    monkeypatch.delenv("SPEL_SPEC_K", raising=False)
    assert load_checkpoint("spel-21m").cfg.spec_k == 3      # chosen from its v(K+1) curve (README)
    assert load_checkpoint("spel-8m").cfg.spec_k == 4       # no spec_k in its config.json: the SPEC's default
    d = tmp_path / "m"
    shutil.copytree(load_checkpoint("spel-8m").source, d)
    cj = json.loads((d / "config.json").read_text())
    for k, want in ((7, 7), (None, None), (0, "1..16"), ("3", "1..16"), (True, "1..16")):
        cj["spec_k"] = k
        if k is None:
            del cj["spec_k"]
        (d / "config.json").write_text(json.dumps(cj))
        if isinstance(want, str):
            with pytest.raises(CheckpointError, match=f"spec_k.*{want}"):
                load_checkpoint(str(d))
            continue
        cfg = load_checkpoint(str(d)).cfg
        assert cfg.spec_k == (want or 4)
        assert decoding_config(cfg, None, 2).spec_k == 2          # --spec-k wins
        monkeypatch.setenv("SPEL_SPEC_K", "5")
        assert decoding_config(cfg).spec_k == 5                   # ... and so does the environment
        monkeypatch.delenv("SPEL_SPEC_K")
