"""The settings registry: every SPEL_* variable declared once (spel_mlx/settings.py), read
only through it, parsed one way, documented by a table generated from it."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spel_mlx import settings
from spel_mlx.settings import SETTINGS, SettingError, setting

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- the settings table: spel_mlx.settings.table() -->", "<!-- end of the settings table -->"
# C macros the Python and the docs name (kernel ids, build switches, the version define)
NOT_VARIABLES = re.compile(r"SPEL_(KERNEL_|LAYER_|AVX|TARGET_AVX|NO_|ASYNC_PENDING|BUSY|CANCELLED|TIMEOUT$|"
                           r"MLX_VERSION|MAX_THREADS|PAD$)")


def names_in(path: Path) -> set:
    return set(re.findall(r"\bSPEL_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")))


def test_readme_table_is_generated_from_the_registry():
    text = (ROOT / "README.md").read_text()
    assert BEGIN in text and END in text
    current = text.split(BEGIN)[1].split(END)[0].strip()
    assert current == settings.table(), "regenerate: python -c 'from spel_mlx.settings import table; print(table())'"


def test_every_variable_named_anywhere_is_declared():
    """Every SPEL_* name in the Python, shell and docs (and every one a C or C++ file
    reads with getenv) is declared; the C sources' other SPEL_* names are macros."""
    text = [p for folder in ("spel_mlx", "metal", "converters", "bench", "tests", ".ci")
            for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh", "") and p.is_file()
            and "__pycache__" not in p.parts]
    text += [ROOT / "setup.py", ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    named = set().union(*(names_in(p) for p in text))
    for folder in ("spel_mlx", "metal", "neon"):
        for p in (ROOT / folder).rglob("*"):
            if p.suffix in (".c", ".h", ".cpp", ".metal"):
                named |= set(re.findall(r'getenv\("(SPEL_[A-Z0-9_]+)"', p.read_text(errors="replace")))
    undeclared = sorted(n for n in named if n not in SETTINGS and not NOT_VARIABLES.match(n))
    assert undeclared == [], f"declare these in spel_mlx/settings.py: {undeclared}"


def test_the_package_reads_the_environment_only_through_the_registry():
    """No os.environ / os.getenv of a SPEL_* name outside settings.py (other variables,
    e.g. XDG_CACHE_HOME or MLX_HOSTFILE, are not ours to declare)."""
    offenders = []
    for folder in ("spel_mlx", "metal", "converters"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "settings.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr in ("get", "getenv", "pop") and node.args \
                        and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("SPEL_"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.args[0].value}")
                if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                        and str(node.slice.value).startswith("SPEL_") and "environ" in ast.unparse(node.value):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.slice.value}")
    assert offenders == []


@pytest.mark.parametrize("name,raw,value", [
    ("SPEL_HUGE_PAGES", "0", False), ("SPEL_HUGE_PAGES", " on ", True), ("SPEL_HUGE_PAGES", "", True),
    ("SPEL_DEBUG", "1", True), ("SPEL_DEBUG", "", False),
    ("SPEL_DRAFT_THREADS", "3", 3), ("SPEL_DRAFT_THREADS", "", None),
    ("SPEL_SIMD", "AVX2", "avx2"), ("SPEL_PIPELINE_TIMEOUT", "2.5", 2.5), ("SPEL_WEIGHTS", " m.spelw ", "m.spelw"),
])
def test_values_parse_one_way(name, raw, value):
    assert setting(name, {name: raw}) == value


@pytest.mark.parametrize("name,raw,needle", [
    ("SPEL_HUGE_PAGES", "maybe", "expected 0 or 1"),
    ("SPEL_DRAFT_THREADS", "x", "expected an integer"),
    ("SPEL_DRAFT_THREADS", "7", "1..6"),
    ("SPEL_DRAFT_THREADS", "0", "1..6"),
    ("SPEL_SIMD", "avx9", "one of auto, avx512, avx2, none"),
    ("SPEL_PIPELINE_TIMEOUT", "0", "> 0"),
    ("SPEL_VERIFY_TOL", "abc", "a number"),
    ("SPEL_KERNELS", "gpu", "one of auto"),
])
def test_a_bad_value_is_one_clear_error(name, raw, needle):
    with pytest.raises(SettingError) as e:
        setting(name, {name: raw})
    assert str(e.value).startswith(f"{name}={raw!r}: expected") and needle in str(e.value)
    with pytest.raises(SettingError):
        settings.check({name: raw})


def test_draft_threads_are_parsed_once(monkeypatch):
    """The C draft's threads and the placement calibration's candidates read the same value."""
    from spel_mlx.decoding import factory
    from spel_mlx.native import cdraft
    monkeypatch.setenv("SPEL_DRAFT_THREADS", "3")
    assert cdraft.threads_from_env(None) == 3 and factory.default_draft_threads() == 3
    monkeypatch.setenv("SPEL_DRAFT_THREADS", "three")
    for read in (lambda: cdraft.threads_from_env(None), factory.default_draft_threads):
        with pytest.raises(SettingError, match="SPEL_DRAFT_THREADS='three'"):
            read()


def test_commands_stop_on_a_bad_value_with_one_line():
    env = {"PATH": "/usr/bin:/bin", "SPEL_SIMD": "avx9"}
    for argv in (["-m", "spel_mlx", "info"], ["-m", "spel_mlx.generate", "--help"], ["-m", "spel_mlx.server"]):
        r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 2 and r.stderr == "error: SPEL_SIMD='avx9': expected one of auto, avx512, avx2, none\n"


def test_info_prints_the_effective_values(monkeypatch, capsys):
    from spel_mlx.cli import info
    monkeypatch.setenv("SPEL_HUGE_PAGES", "0")
    monkeypatch.setenv("SPEL_API_KEY", "secret")
    assert info.main(["--preset", "21m"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  SPEL_HUGE_PAGES +False$", out, re.M) and re.search(r"^  SPEL_KERNELS +auto  \(default\)$", out, re.M)
    assert "secret" not in out and re.search(r"^  SPEL_API_KEY +\*\*\*$", out, re.M)
