"""The command line: one dispatcher (`python -m spel_mlx <command>`), the console scripts
on it, the old `python -m spel_mlx.<command>` paths, and the flags every command shares."""
import importlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from spel_mlx import cli
from spel_mlx.cli import args as shared

ROOT = Path(__file__).resolve().parent.parent


def console_scripts() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


def run_python(*argv, timeout=120):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPEL_")}
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=env)


def test_every_command_has_a_script_and_every_script_a_command():
    scripts = console_scripts()
    assert scripts.pop("spel-mlx") == "spel_mlx.cli:main"
    want = {f"spel-mlx-{name}": f"spel_mlx.cli.{module}:main" for name, (module, _) in cli.COMMANDS.items()}
    assert scripts == want


@pytest.mark.parametrize("name", sorted(console_scripts()))
def test_every_console_script_answers_help(name):
    """The entry point as the installed script calls it: main() with sys.argv."""
    module, _, func = console_scripts()[name].partition(":")
    code = (f"import sys; sys.argv = [{name!r}, '--help']; from {module} import {func}; "
            f"sys.exit({func}())")
    r = run_python("-c", code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage:") and "Traceback" not in r.stderr
    installed = Path(sys.executable).parent / name      # the pip-made script, where installed
    if installed.exists():
        r = subprocess.run([str(installed), "--help"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.startswith("usage:"), r.stderr


def test_dispatcher_and_old_paths_run_the_same_parser():
    r = run_python("-m", "spel_mlx", "generate", "--help")
    assert r.returncode == 0 and "--num-draft-tokens" in r.stdout and "--temp" in r.stdout, r.stderr
    old = run_python("-m", "spel_mlx.generate", "--help")
    assert old.returncode == 0 and old.stdout == r.stdout
    for name, (module, _) in cli.COMMANDS.items():       # underscores and hyphens alike
        assert cli.command_module(name) is cli.command_module(name.replace("-", "_"))
    assert cli.main(["no-such-command"]) == 2
    assert cli.main([]) == 0


def test_server_port_out_of_range_is_one_line(capsys):
    from spel_mlx.cli import server
    for port in ("99999", "0", "http"):
        assert server.main(["--port", port]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: argument --port") and "Traceback" not in err, err
    r = run_python("-m", "spel_mlx.server", "--port", "99999")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "65535" in r.stderr, r.stderr


def test_shared_flags_and_aliases():
    from spel_mlx.cli import generate, server
    from spel_mlx.decoding import MODES, PROPOSER_KINDS
    from spel_mlx.model.state import KV_DTYPES
    a = generate.build_parser().parse_args(["--checkpoint", "m", "--temp", "0", "--num-draft-tokens", "7"])
    b = generate.build_parser().parse_args(["--model", "m", "--temperature", "0", "--spec-k", "7"])
    assert vars(a) == vars(b) and a.model == "m" and a.spec_k == 7 and a.temperature == 0.0
    s = server.build_parser().parse_args(["--checkpoint", "m", "--num-draft-tokens", "3"])
    assert s.model == "m" and s.spec_k == 3

    def choices(parser, flag):
        return next(act.choices for act in parser._actions if flag in act.option_strings)
    assert choices(generate.build_parser(), "--draft") == PROPOSER_KINDS
    assert tuple(choices(server.build_parser(), "--kv-cache")) == tuple(KV_DTYPES)
    assert set(choices(server.build_parser(), "--mode")) == set(MODES) - set(shared.BENCHMARK_MODES)
    for bad in (["--spec-k", "17"], ["--draft-threads", "0"], ["--max-tokens", "-1"]):
        with pytest.raises(shared.UsageError):
            generate.build_parser().parse_args(bad)


def test_every_command_module_builds_its_parser_from_the_shared_parts():
    """No command defines --model/--checkpoint or --config by hand."""
    for name, (module, _) in cli.COMMANDS.items():
        src = Path(importlib.import_module(f"spel_mlx.cli.{module}").__file__).read_text()
        for flag in ('"--checkpoint"', '"--model"', '"--config"', '"--port"', '"--temperature"', '"--force"'):
            assert f"add_argument({flag}" not in src, f"{name} defines {flag} itself"


def test_synth_refuses_to_overwrite_without_force(tmp_path, capsys):
    from spel_mlx.cli import synth
    out = tmp_path / "m.spelw"
    out.write_bytes(b"precious")
    tiny = "d_model=32,n_layers=4,n_heads=2,head_dim=16,d_ff=64,vocab=128,max_seq=32,draft_map=0:3"
    assert synth.main(["--config", tiny, "--out", str(out), "--quiet", "--draft", "numpy"]) == 2
    err = capsys.readouterr().err
    assert "already exists: pass --force" in err and err.count("\n") == 1
    assert out.read_bytes() == b"precious"
    assert synth.main(["--config", tiny, "--out", str(out), "--quiet", "--draft", "numpy", "--force"]) == 0
    assert out.read_bytes()[:8] == b"SPELW001"


def test_train_refuses_to_overwrite_outputs_without_force(tmp_path, capsys):
    from spel_mlx.cli import train
    out = tmp_path / "windows.npy"
    out.write_bytes(b"precious")
    assert train.main(["onpolicy", "--init", str(tmp_path / "none"), "--out", str(out)]) == 2
    assert "already exists: pass --force" in capsys.readouterr().err and out.read_bytes() == b"precious"
    folder = tmp_path / "model"
    folder.mkdir()
    assert train.main(["export", "--run", str(tmp_path / "none"), "--out", str(folder)]) == 2
    assert "already exists: pass --force" in capsys.readouterr().err
    assert train.main(["all", "--runs", str(tmp_path / "runs"), "--out", str(folder)]) == 2
    assert "already exists: pass --force" in capsys.readouterr().err and not (tmp_path / "runs").exists()


def test_info_describes_the_checkpoint_it_is_given(tmp_path, capsys):
    from spel_mlx.checkpoints import write_spelw
    from spel_mlx.cli import info
    from spel_mlx.config import resolve_config
    from spel_mlx.model import init_weights
    cfg = resolve_config(overrides="d_model=32,n_layers=4,n_heads=2,head_dim=16,d_ff=64,vocab=128,max_seq=64,"
                                   "draft_map=0:3", use_env=False)
    path = tmp_path / "tiny.spelw"
    write_spelw(str(path), cfg, init_weights(cfg, seed=1))
    assert info.main(["--model", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint:     {path} [SPELW001]" in out and "d_model=32," in out
    assert f"params target:  {cfg.target_params():,}" in out
    assert info.main([]) == 0                                          # the shipped model
    out = capsys.readouterr().out
    assert "checkpoint:" in out and "[safetensors" in out and "params target:  21,352,044" not in out
    assert info.main(["--model", str(path), "--config", "d_model=64"]) == 2
    assert "contradicts" in capsys.readouterr().err
