"""`python -m spel_mlx.generate`: output, statistics, bad input, Ctrl-C.

A tiny random checkpoint is written to tmp.  Most cases call `generate.run`
in-process (fast); a few run the real CLI in a subprocess to prove there is no
traceback and that SIGINT stops cleanly with statistics.
"""
import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import spel_mlx  # noqa: F401
from spel_mlx.native import clib
from spel_mlx.cli import generate as gen   # the command module (spel_mlx.generate is the API function)

TINY = "d_model=32,n_layers=4,n_heads=2,head_dim=16,d_ff=64,vocab=128,max_seq=96,draft_map=0:3"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from spel_mlx.config import resolve_config
    from spel_mlx.model import init_weights
    from spel_mlx.checkpoints import write_spelw
    d = tmp_path_factory.mktemp("gen")
    cfg = resolve_config(overrides=TINY, use_env=False)
    w = init_weights(cfg, seed=5)
    for j, src in enumerate(cfg.draft_map):  # draft = copies of its target layers
        for name in list(w):
            if name.startswith(f"layers.{src}."):
                w["draft." + name.replace(f"layers.{src}.", f"layers.{j}.", 1)] = w[name].copy()
    path = d / "tiny.spelw"
    write_spelw(str(path), cfg, w)
    return path


def run(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = gen.run([str(a) for a in argv], stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def stats_of(err: str) -> dict:
    lines = [ln for ln in err.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, err
    return json.loads(lines[0])


def test_greedy_modes_agree_end_to_end(ckpt):
    base = ["--checkpoint", ckpt, "--prompt", "the cat sat on the mat. the cat", "--max-tokens", 30,
            "--temperature", 0, "--stats"]
    code, ref, err = run(*base, "--mode", "ar")
    assert code == 0, err
    assert stats_of(err)["tokens"] == 30
    for extra in (["--mode", "spec", "--draft", "mlx"], ["--mode", "governed", "--draft", "ngram"],
                  ["--mode", "spec", "--draft", "auto", "--spec-k", "8"],
                  ["--mode", "spec", "--draft", "mlx", "--strict", "--spec-k", "16"],
                  ["--mode", "oracle", "--no-stream"]):
        code, out, err = run(*base, *extra)
        assert code == 0, (extra, err)
        assert out == ref, extra
        st = stats_of(err)
        assert st["tokens"] == 30 and st["stop_reason"] == "max_tokens"
        for key in ("alpha", "tokens_per_round", "governor_trips", "ar_rounds", "c", "v", "tok_s",
                    "draft_s", "verify_s"):
            assert key in st


def test_half_kv_cache_modes_agree(ckpt):
    base = ["--checkpoint", ckpt, "--prompt", "the cat sat on the mat. the cat", "--max-tokens", 30,
            "--temperature", 0, "--stats", "--kv-cache", "float16"]
    code, ref, err = run(*base, "--mode", "ar")
    assert code == 0 and stats_of(err)["kv_cache"] == "float16", err
    for extra in (["--draft", "mlx"], ["--draft", "mlx", "--strict"], ["--draft", "c"]):
        code, out, err = run(*base, *extra)
        assert code == 0 and out == ref, (extra, err)
    assert stats_of(run(*base[:-2])[2])["kv_cache"] == "float32"


def test_default_draft_by_sampling(ckpt):
    """Greedy spec: n-gram, else the C draft (auto); sampled: the C draft."""
    code, out, err = run("--checkpoint", ckpt, "--max-tokens", 12, "--temperature", 0, "--stats",
                         "--draft-threads", 2)
    assert code == 0, err
    st = stats_of(err)
    assert st["draft"] == "auto" and st["tokens"] == 12
    if clib.available():
        assert st["draft_threads"] == 2      # its fallback, the C draft
    code, out, err = run("--checkpoint", ckpt, "--max-tokens", 12, "--seed", 1, "--stats")
    assert code == 0, err
    st = stats_of(err)
    assert st["draft"] == ("c" if clib.available() else "mlx") and st["tokens"] == 12


def test_sampling_seeded_reproducible(ckpt):
    argv = ["--checkpoint", ckpt, "--max-tokens", 25, "--temperature", 0.9, "--top-k", 40,
            "--top-p", 0.9, "--repetition-penalty", 1.2, "--draft", "mlx"]
    a = run(*argv, "--seed", 3)
    b = run(*argv, "--seed", 3)
    assert a[0] == 0 and a[1] == b[1]


def test_coupled_spec_prints_the_sampled_ar_text(ckpt):
    """--accept coupled: spec prints --mode ar's text for the same seed (the sampling
    defaults); --accept residual runs the other rule."""
    argv = ["--checkpoint", ckpt, "--max-tokens", 30, "--seed", 4, "--stats"]
    ar = run(*argv, "--mode", "ar", "--accept", "coupled")
    spec = run(*argv, "--accept", "coupled")
    res = run(*argv, "--accept", "residual")
    assert ar[0] == spec[0] == res[0] == 0 and ar[1] == spec[1]
    assert stats_of(spec[2])["accept"] == "coupled" and stats_of(res[2])["accept"] == "residual"
    assert stats_of(res[2])["tokens"] == 30


def test_safetensors_folder_checkpoint(ckpt, tmp_path):
    from spel_mlx.converters.spelw_safetensors import spelw_to_safetensors
    folder = tmp_path / "st"
    spelw_to_safetensors(str(ckpt), str(folder))
    a = run("--checkpoint", ckpt, "--max-tokens", 10, "--temperature", 0, "--mode", "ar")
    b = run("--checkpoint", folder, "--max-tokens", 10, "--temperature", 0, "--draft", "mlx")
    assert a[0] == b[0] == 0 and a[1] == b[1]


def test_runs_into_max_seq(ckpt):
    code, out, err = run("--checkpoint", ckpt, "--prompt", "x" * 90, "--max-tokens", 50,
                         "--temperature", 0, "--stats", "--draft", "mlx", "--spec-k", 16)
    assert code == 0, err
    st = stats_of(err)
    assert st["stop_reason"] == "max_seq" and st["tokens"] == 96 - 90 + 1


@pytest.mark.parametrize("argv,needle", [
    (["--bogus"], "unrecognized arguments"),
    (["--mode", "fast"], "--mode 'fast'"),
    (["--mode", "forced=1.5"], "forced needs"),
    (["--spec-k", "0"], "--spec-k/--num-draft-tokens: 0: must be in 1..16"),
    (["--spec-k", "17"], "--spec-k/--num-draft-tokens: 17: must be in 1..16"),
    (["--draft", "gpu"], "invalid choice"),
    (["--draft-threads", "9"], "--draft-threads: 9: must be in 1..6"),
    (["--max-tokens", "abc"], "invalid int"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "2"], "top_p"),
    (["--prompt", "y" * 97], "longer than max_seq=96"),
    (["--prompt", ""], "empty"),
    (["--config", "d_model=64"], "contradicts the checkpoint"),
    (["--config", "colour=red"], "unknown config key"),
    (["--prompt-file", "/nonexistent/p.txt"], "--prompt-file"),
    (["--mode", "oracle", "--draft", "ngram"], "conflicts"),
    (["--alpha-threshold", "1.5"], "--alpha-threshold"),
    (["--governor-window", "0"], "--governor-window"),
    (["--seed", "-1"], "seed=-1"),
    (["--accept", "maximal"], "invalid choice"),
    (["--kv-cache", "bfloat16"], "invalid choice"),
    (["--pipeline", "--kv-cache", "float16"], "--kv-cache float16 is not available"),
])
def test_bad_input_one_line_exit_2(ckpt, argv, needle):
    code, out, err = run("--checkpoint", ckpt, *argv)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err, err


def test_bad_checkpoints(tmp_path, ckpt):
    missing = tmp_path / "nope.spelw"
    garbage = tmp_path / "garbage.spelw"
    garbage.write_bytes(b"NOTSPEL!" + bytes(100))
    truncated = tmp_path / "trunc.spelw"
    truncated.write_bytes(ckpt.read_bytes()[:5000])
    for path, needle in ((missing, "no such file"), (garbage, "garbage.spelw"), (truncated, "trunc.spelw")):
        code, out, err = run("--checkpoint", path)
        assert code == 2 and err.count("\n") == 1 and needle in err, err


def test_tokenizer_vocab_mismatch(ckpt, tmp_path):
    from spel_mlx.tokenizer import DEFAULT_SP_MODEL
    if not os.path.isfile(DEFAULT_SP_MODEL):
        pytest.skip("no SentencePiece model shipped yet")
    code, out, err = run("--checkpoint", ckpt, "--tokenizer", DEFAULT_SP_MODEL)
    assert code == 2 and "vocab" in err and err.count("\n") == 1, err
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    code, out, err = run("--checkpoint", ckpt, "--tokenizer", bad)
    assert code == 2 and err.count("\n") == 1, err


def test_no_installed_checkpoint_message(monkeypatch, tmp_path):
    from spel_mlx.checkpoints import load as checkpoint
    monkeypatch.setattr(checkpoint, "DEFAULT_DIR", tmp_path / "default")
    monkeypatch.delenv("SPEL_WEIGHTS", raising=False)
    code, out, err = run()
    assert code == 1
    assert err.count("\n") == 1 and "no trained checkpoint is installed" in err
    assert "python -m spel_mlx" in err  # says how to make one


def _cli(*argv, **kw):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("SPEL_WEIGHTS", None)
    return subprocess.run([sys.executable, "-m", "spel_mlx.generate", *map(str, argv)],
                          capture_output=True, text=True, env=env, timeout=120, **kw)


def test_cli_subprocess_ok_and_errors_without_traceback(ckpt, tmp_path):
    r = _cli("--checkpoint", ckpt, "--max-tokens", 8, "--temperature", 0, "--stats")
    assert r.returncode == 0, r.stderr
    assert stats_of(r.stderr)["tokens"] == 8
    r = _cli("--checkpoint", tmp_path / "missing.spelw")
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    r = _cli("--checkpoint", ckpt, "--spec-k", 99)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1


def test_ctrl_c_stops_cleanly_with_stats(tmp_path):
    from spel_mlx.config import resolve_config
    from spel_mlx.model import init_weights
    from spel_mlx.checkpoints import write_spelw
    cfg = resolve_config(overrides=TINY.replace("max_seq=96", "max_seq=4096"), use_env=False)
    path = tmp_path / "long.spelw"
    write_spelw(str(path), cfg, init_weights(cfg, seed=1))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "spel_mlx.generate", "--checkpoint", str(path),
                          "--max-tokens", "4000", "--mode", "ar", "--strict", "--stats"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                         # a shell's background job ignores SIGINT, and so would the child
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = p.stdout.read(1)  # streaming: text arrives before the end, so a token is out
        assert first
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    err = err.decode()
    assert p.returncode == 130, err
    assert "Traceback" not in err
    st = stats_of(err)
    assert st["stop_reason"] == "interrupted" and 0 < st["tokens"] < 4000


def test_selftest_tiny_shape_passes():
    from spel_mlx import selftest
    from spel_mlx.config import resolve_config
    cfg = resolve_config(overrides="d_model=32,n_layers=4,n_heads=2,head_dim=16,d_ff=64,draft_map=0:3",
                         use_env=False)
    out = io.StringIO()
    failures = selftest.run(cfg, seed=0, out=out)
    text = out.getvalue()
    assert failures == 0, text
    lines = text.splitlines()
    assert len(lines) == 9 and lines[-1].startswith("PASS (0 failures)")
    for i in range(1, 9):
        assert lines[i - 1].startswith(f"[{i}] ")
        assert " FAIL " not in lines[i - 1]


def test_selftest_reports_a_failing_suite(monkeypatch):
    from spel_mlx import selftest
    from spel_mlx.config import resolve_config
    cfg = resolve_config(overrides="d_model=32,n_layers=4,n_heads=2,head_dim=16,d_ff=64,draft_map=0:3",
                         use_env=False)

    def broken(ctx):
        raise RuntimeError("boom")
    monkeypatch.setattr(selftest, "SUITES", (("always broken", broken),) + selftest.SUITES[1:2])
    out = io.StringIO()
    assert selftest.run(cfg, out=out) == 1
    assert "[1] always broken" in out.getvalue() and "RuntimeError: boom" in out.getvalue()
    assert out.getvalue().splitlines()[-1].startswith("FAIL (1 failure)")


def test_spel_spec_k_env(ckpt, monkeypatch):
    monkeypatch.setenv("SPEL_SPEC_K", "8")
    code, out, err = run("--checkpoint", ckpt, "--max-tokens", 6, "--temperature", 0, "--stats",
                         "--draft", "mlx")
    assert code == 0 and stats_of(err)["k"] == 8
    code, out, err = run("--checkpoint", ckpt, "--max-tokens", 6, "--spec-k", 2, "--stats", "--draft", "mlx")
    assert code == 0 and stats_of(err)["k"] == 2   # the flag wins over the environment
    monkeypatch.setenv("SPEL_SPEC_K", "20")
    code, out, err = run("--checkpoint", ckpt, "--max-tokens", 6)
    assert code == 2 and "spec_k=20" in err and err.count("\n") == 1


def test_selftest_skips_suites_whose_module_is_missing(monkeypatch):
    from spel_mlx import selftest
    from spel_mlx.config import resolve_config
    cfg = resolve_config(overrides="d_model=32,n_layers=4,n_heads=2,head_dim=16,d_ff=64,draft_map=0:3",
                         use_env=False)

    def no_c_draft():
        raise selftest.Skip("C draft unavailable (simulated)")
    monkeypatch.setattr(selftest, "_cdraft_module", no_c_draft)
    out = io.StringIO()
    assert selftest.run(cfg, out=out, only={1, 3, 8}) == 0
    lines = out.getvalue().splitlines()
    assert "SKIP" in lines[0] and "simulated" in lines[0]
    assert " ok " in lines[1] and "mlx draft" in lines[1]   # spec fidelity falls back to the MLX draft
    assert "SKIP" in lines[2]
    assert lines[-1].startswith("PASS (0 failures)")


def test_placement_auto_picks_ranked_first_and_keeps_greedy_output(ckpt):
    base = ["--checkpoint", ckpt, "--prompt", "the cat sat on the mat. the cat", "--max-tokens", 20,
            "--temperature", 0, "--stats"]
    code, ref, err = run(*base, "--mode", "ar")
    assert code == 0, err
    code, out, err = run(*base, "--placement", "auto")
    assert code == 0, err
    assert out == ref  # the placement changes speed, never the greedy tokens
    st = stats_of(err)
    p = st["placement"]
    assert p["available"] and p["target_device"] in ("cpu", "gpu")
    assert p["round_cost"] == pytest.approx((p["k"] + 1) * p["c"] + p["v"])
    assert "rank  placement" in err
    code, _, err = run(*base, "--placement", "auto", "--draft", "mlx")
    assert code == 2 and "drop --draft" in err


def test_selftest_only_rejects_unknown_suite_numbers(capsys):
    # `--only 99` used to run nothing and print PASS: a typo must not pass.
    from spel_mlx.cli import selftest
    for bad in ("99", "0", "x", "3,", ","):
        assert selftest.main(["--config", "d_model=64", "--only", bad]) == 2, bad
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--only" in err[0] and "1..8" in err[0], (bad, err)


class _FullDisk(io.StringIO):
    def write(self, s):
        import errno
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("stream", [[], ["--no-stream"]])
def test_unwritable_stdout_is_one_line_error(ckpt, stream):
    # stdout on a full disk (e.g. `> /dev/full`) used to end in a traceback
    err = io.StringIO()
    code = gen.run(["--checkpoint", str(ckpt), "--prompt", "hi", "--max-tokens", "5", *stream],
                   stdout=_FullDisk(), stderr=err)
    assert code == 1
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0], err.getvalue()


def test_prompt_that_is_not_utf8_is_a_usage_error(monkeypatch):
    # argv and stdin decode invalid bytes to lone surrogates (surrogateescape), which
    # SentencePiece cannot take: that crashed with a pybind11 RuntimeError traceback
    args = gen.build_parser().parse_args(["--prompt", "ab\udcffcd"])
    with pytest.raises(gen.UsageError, match="--prompt: not valid UTF-8"):
        gen.read_prompt(args)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ab\xffcd"), encoding="utf-8",
                                                       errors="surrogateescape"))
    args = gen.build_parser().parse_args(["--prompt-file", "-"])
    with pytest.raises(gen.UsageError, match="--prompt-file -: not valid UTF-8"):
        gen.read_prompt(args)
