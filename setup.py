"""Build steps that pyproject.toml cannot express: the C and C++ extensions.

* ``spel_mlx.platform._blasshim``: LP64 CBLAS forwarders (see spel_mlx/platform/blas.py); a
  plain shared library loaded with ctypes, never imported.
* the cffi draft engine from ``neon/`` (when present).
* ``spel_mlx._spel_cpu`` (Linux): fused CPU primitives for the MLX target
  (spel_mlx/cpu_ext/, see spel_mlx/model/cpu_ops.py), built with CMake against the
  MLX found at build time, with nanobind in MLX's domain.  Optional: if it
  cannot be built the package falls back to the plain MLX ops (``python -m
  spel_mlx.info`` says which path runs), unless SPEL_REQUIRE_CPU_EXT=1 (CI).
"""
import glob
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))


class CMakeExtension(Extension):
    def __init__(self, name: str, sourcedir: str):
        super().__init__(name, sources=[])
        self.sourcedir = sourcedir


class BuildExt(build_ext):
    def build_extensions(self):
        # the interpreter's link flags may carry -Wl,-rpath,<its prefix> (pyenv's do): a
        # module needs none, and a wheel must not carry a path of the machine it was built on
        self.compiler.linker_so = [a for a in self.compiler.linker_so if "-rpath" not in a]
        super().build_extensions()

    def build_extension(self, ext):
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        try:
            self._build_cmake(ext)
        except Exception as e:  # noqa: BLE001 - any failure: report, fall back (or fail in CI)
            if os.environ.get("SPEL_REQUIRE_CPU_EXT") == "1":
                raise
            print(f"warning: {ext.name} not built ({e}); spel_mlx uses the plain MLX ops on the CPU",
                  file=sys.stderr)

    def _build_cmake(self, ext):
        import mlx
        import nanobind  # noqa: F401  (its CMake package is found through `python -m nanobind`)
        from importlib.metadata import version
        cmake = shutil.which("cmake")
        if cmake is None:
            raise RuntimeError("cmake not found")
        mlx_dir = os.path.abspath(list(mlx.__path__)[0])
        tmp = os.path.abspath(os.path.join(self.build_temp, "spel_cpu"))
        os.makedirs(tmp, exist_ok=True)
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.check_call([cmake, "-S", ext.sourcedir, "-B", tmp, *gen,
                               "-DCMAKE_BUILD_TYPE=Release",
                               f"-DMLX_DIR={os.path.join(mlx_dir, 'share', 'cmake', 'MLX')}",
                               f"-DPython_EXECUTABLE={sys.executable}",
                               f"-DSPEL_MLX_VERSION={version('mlx')}"])
        subprocess.check_call([cmake, "--build", tmp, "--parallel", str(os.cpu_count() or 1)])
        built = glob.glob(os.path.join(tmp, "_spel_cpu*.so"))
        if not built:
            raise RuntimeError(f"no _spel_cpu module in {tmp}")
        out = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        shutil.copyfile(built[0], out)


ext_modules = []
cffi_modules = []
if sys.platform.startswith("linux"):
    ext_modules.append(Extension("spel_mlx.platform._blasshim", sources=["spel_mlx/platform/_blasshim.c"],
                                 extra_compile_args=["-O2"]))
    ext_modules.append(CMakeExtension("spel_mlx._spel_cpu", os.path.join(HERE, "spel_mlx", "cpu_ext")))
if os.path.exists(os.path.join(HERE, "neon", "build_ffi.py")):
    cffi_modules.append("neon/build_ffi.py:ffibuilder")

setup(ext_modules=ext_modules, cffi_modules=cffi_modules, cmdclass={"build_ext": BuildExt})
