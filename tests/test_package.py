"""A real package (issue 35): the license and metadata, one MLX pin for build and run
time, no build path in the built modules' RPATH, every C and C++ source in the sdist,
a loud warning when another MLX turns the fused ops off, and a wheel that installs and
generates in a fresh venv with no compiler at hand."""
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import require_or_skip

ROOT = Path(__file__).resolve().parent.parent
SOURCES = re.compile(r"^(neon|spel_mlx|metal)/.*(\.c|\.cpp|\.h|\.metal|CMakeLists\.txt|build_ffi\.py)$")


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def pin(requirements, name: str, platform: str = "linux") -> str:
    """The version `name` is pinned to (==) for `platform` in a list of requirements."""
    found = [r for r in requirements if re.match(rf"{re.escape(name)}(\[[^\]]*\])?\s*==", r)
             and (";" not in r or platform in r.split(";", 1)[1])]
    assert len(found) == 1, (name, requirements)
    return found[0].split("==", 1)[1].split(";")[0].strip()


def tracked(pattern=SOURCES) -> list:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True)
    if out.returncode:
        pytest.skip("not a git checkout: the tracked sources are unknown")
    return [f for f in out.stdout.split() if pattern.match(f)]


def test_license_and_metadata():
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    meta = pyproject()["project"]
    assert meta["license"] == "MIT" and meta["license-files"] == ["LICENSE"]
    assert any(c.startswith("Programming Language :: Python :: 3") for c in meta["classifiers"])
    assert "Operating System :: POSIX :: Linux" in meta["classifiers"]


def test_build_and_run_time_pin_the_same_mlx():
    p = pyproject()
    build, run = p["build-system"]["requires"], p["project"]["dependencies"]
    assert pin(build, "mlx") == pin(run, "mlx") == pin(p["project"]["optional-dependencies"]["cuda"], "mlx")
    assert pin(build, "nanobind") == pin(p["project"]["optional-dependencies"]["dev"], "nanobind")


def runpaths(so: Path) -> list:
    """The RPATH/RUNPATH entries of a shared object (readelf)."""
    readelf = shutil.which("readelf")
    require_or_skip(readelf is not None, "readelf (binutils) is needed to read RPATH", "SPEL_REQUIRE_CPU_EXT")
    out = subprocess.run([readelf, "-d", str(so)], capture_output=True, text=True, check=True).stdout
    return [p for m in re.finditer(r"\((?:RPATH|RUNPATH)\)\s+Library r(?:un)?path: \[(.*)\]", out)
            for p in m[1].split(":")]


def check_runpaths(folder: Path):
    built = sorted(folder.glob("_*.so"))
    assert built, f"no built modules in {folder}"
    for so in built:
        for p in runpaths(so):
            assert p.startswith("$ORIGIN"), f"{so.name}: RPATH entry {p!r} is an absolute build path"
    return built


def test_built_modules_have_no_build_paths():
    import spel_mlx
    names = [p.name for p in check_runpaths(Path(spel_mlx.__file__).parent)]
    if os.environ.get("SPEL_REQUIRE_CPU_EXT") == "1":
        assert any(n.startswith("_spel_cpu") for n in names)


def test_sdist_holds_every_c_and_cpp_source(tmp_path):
    sources = tracked()
    assert any(f.endswith(".cpp") for f in sources) and any(f.startswith("neon/") for f in sources)
    copy = tmp_path / "src"
    for f in tracked(re.compile(r".*")):
        (copy / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, copy / f)
    require_or_skip(importlib.util.find_spec("build") is not None, "the sdist is made with `build` (the dev extra)",
                    "SPEL_REQUIRE_WHEEL")
    out = subprocess.run([sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp_path / "dist"), str(copy)],
                         capture_output=True, text=True, timeout=900)
    if out.returncode and _offline(out.stdout + out.stderr):
        require_or_skip(False, "pip cannot resolve the build requirements offline", "SPEL_REQUIRE_WHEEL")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    (sdist,) = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    missing = [f for f in sources if f not in names]
    assert not missing, missing
    assert "LICENSE" in names and not any(n.endswith((".so", ".o")) for n in names)


def test_another_mlx_turns_the_fused_ops_off_loudly():
    """A module built for another MLX: a RuntimeWarning at import, a WARNING in info's
    kernels line, and decoding on the plain MLX ops."""
    from spel_mlx.model import cpu_ops
    require_or_skip(cpu_ops._spel_cpu is not None, f"the fused CPU primitives are not built: {cpu_ops._IMPORT_ERROR}",
                    "SPEL_REQUIRE_CPU_EXT")
    code = ("import warnings, spel_mlx, mlx.core; from spel_mlx import _spel_cpu; _spel_cpu.mlx_version = '0.0.1'\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always'); from spel_mlx.model import cpu_ops, backends\n"
            "print([str(x.message) for x in w if x.category is RuntimeWarning]); print(cpu_ops.available())\n"
            "print(backends.describe())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "SPEL_KERNELS"})
    assert out.returncode == 0, out.stderr[-2000:]
    warned, available, kernels = out.stdout.strip().splitlines()[-3:]
    assert "built for MLX 0.0.1" in warned and "fused CPU primitives are off" in warned
    assert available == "False" and "WARNING: fused CPU primitives off" in kernels


def _offline(stderr: str) -> bool:
    return any(s in stderr for s in ("No matching distribution", "Could not find a version", "Failed to establish",
                                     "Temporary failure in name resolution", "Network is unreachable"))


@pytest.mark.timeout(2400)
def test_a_wheel_installs_and_generates_in_a_fresh_venv(tmp_path):
    """`pip wheel .` (from the tracked files), then a venv with nothing else in it: the
    wheel installs with no compiler (CC and CXX fail), its modules carry no build path,
    the fused ops are on, and generate gives the text this checkout gives."""
    src = tmp_path / "src"
    for f in tracked(re.compile(r".*")):
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPEL_")}
    wheels = tmp_path / "wheels"
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(src)],
                         capture_output=True, text=True, timeout=1800, env={**env, "SPEL_REQUIRE_CPU_EXT": "1"})
    if out.returncode and _offline(out.stderr):
        require_or_skip(False, f"pip cannot resolve the build requirements offline: {out.stderr.strip()[-300:]}",
                        "SPEL_REQUIRE_WHEEL")
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = wheels.glob("spel_mlx-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    no_compiler = {**env, "CC": "/bin/false", "CXX": "/bin/false"}
    out = subprocess.run([str(py), "-m", "pip", "install", "-q", "--only-binary=:all:", str(wheel)],
                         capture_output=True, text=True, timeout=1200, env=no_compiler)
    if out.returncode and _offline(out.stderr):
        require_or_skip(False, f"pip cannot resolve the run-time requirements offline: {out.stderr.strip()[-300:]}",
                        "SPEL_REQUIRE_WHEEL")
    assert out.returncode == 0, out.stderr[-3000:]
    code = ("import spel_mlx, pathlib; from spel_mlx.model import cpu_ops; print(cpu_ops.status()); "
            "print(pathlib.Path(spel_mlx.__file__).parent); "
            "m, t = spel_mlx.load(); print(repr(spel_mlx.generate(m, t, 'Elizabeth was', max_tokens=16, temperature=0)))")
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env=no_compiler)
    assert out.returncode == 0, out.stderr[-3000:]
    status, where, text = out.stdout.strip().splitlines()[-3:]
    assert status.startswith("(True"), status
    assert Path(where).is_relative_to(venv)
    check_runpaths(Path(where))
    import spel_mlx
    model, tok = spel_mlx.load("spel-21m")  # the venv ran without SPEL_*: the default pair
    assert text == repr(spel_mlx.generate(model, tok, "Elizabeth was", max_tokens=16, temperature=0))
    model.close()
    cli = subprocess.run([str(venv / "bin" / "python"), "-m", "spel_mlx", "generate", "--prompt", "It is",
                          "--max-tokens", "8", "--temperature", "0"], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path, env=no_compiler)
    assert cli.returncode == 0 and cli.stdout.strip(), cli.stderr[-2000:]
