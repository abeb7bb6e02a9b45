"""cffi build script of the C draft engine: ``spel_mlx._spel_draft``.

setup.py lists ``neon/build_ffi.py:ffibuilder`` in cffi_modules, so a normal
``pip install`` compiles it; there is no manual step.  One set of sources builds
everywhere: AVX2 code sits in functions with target attributes chosen at run time,
NEON code under ``__aarch64__`` (dotprod via a target attribute + HWCAP check).
"""
import os
import shlex
import shutil
import sys
import sysconfig

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))


def engine_sources(root=HERE) -> list:
    """Every .c file under neon/ but its tests, relative to it: the engine (draft.c,
    forward.c, ahead.c, gemv.c), its kernels (kernels.c: the scalar reference and the
    choice; arch/x86, arch/arm), quant.c, pool.c, sampling.c.  The cross-compiled tests
    build the same list."""
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("tests", "__pycache__"))
        out += [os.path.relpath(os.path.join(folder, f), root) for f in sorted(files) if f.endswith(".c")]
    return out


SOURCES = engine_sources()
# -ffp-contract=off: no silent fused multiply-adds, so results match numpy and do
# not depend on which ISA variant of a function ran.
CFLAGS = ["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-math-errno", "-pthread"]


def _check_compiler():
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    exe = shlex.split(cc)[0] if cc.strip() else "cc"
    if shutil.which(exe) is None:
        raise RuntimeError(
            f"spel_mlx: building the C draft engine (neon/) needs a C compiler, but {exe!r} "
            f"was not found (set CC, or install gcc/clang: e.g. `apt-get install gcc`, "
            f"`xcode-select --install`).")


def cdef_text():
    with open(os.path.join(HERE, "spel_api.h")) as f:
        return f.read()


def make_builder():
    ffi = FFI()
    ffi.cdef(cdef_text())
    ffi.set_source(
        "spel_mlx._spel_draft",
        '#include <stdint.h>\n#include "spel_api.h"\n',
        # relative to the working directory (pip builds from the project root)
        sources=[os.path.relpath(os.path.join(HERE, s)) for s in SOURCES],
        include_dirs=[HERE],
        extra_compile_args=CFLAGS,
        extra_link_args=["-pthread"],
        libraries=[] if sys.platform == "win32" else ["m"],
    )
    return ffi


_check_compiler()   # this module is only imported to build the extension
ffibuilder = make_builder()

if __name__ == "__main__":
    _check_compiler()
    ffibuilder.compile(verbose=True)
