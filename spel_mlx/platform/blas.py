"""Make MLX's Linux CPU build use an optimized BLAS.

The ``mlx[cpu]`` wheel for Linux links the netlib reference BLAS, whose SGEMM
runs at 3-4 GFLOP/s here instead of ~100.  The dynamic linker resolves MLX's
``cblas_sgemm`` through the global symbol scope first, so a library loaded
with ``RTLD_GLOBAL`` *before* ``mlx.core`` is imported wins.  Two sources,
neither needing root:

* ``numpy`` (default): numpy's wheel bundles an ILP64 OpenBLAS whose symbols
  are renamed (``scipy_cblas_sgemm64_``).  A tiny shim (``_blasshim.c``)
  exports the LP64 names MLX wants and forwards to it.
* ``system``: an LP64 ``libopenblas.so.0`` (Debian's libopenblas0-pthread).

``SPEL_BLAS=auto|numpy|system|reference`` chooses; ``auto`` tries numpy, then
system, then leaves the reference BLAS with a warning.  ``blas_info()`` says
what was chosen; ``python -m spel_mlx.info`` prints it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.machinery
import os
import subprocess
import sys
import sysconfig
import tempfile
import warnings

from ..settings import setting

_INFO: dict = {"kind": "not-loaded", "path": None, "detail": "", "threads": None}
_KEEP: list = []  # keep ctypes handles alive for the life of the process
_SET_THREADS = None  # the loaded OpenBLAS's set_num_threads, once known


def blas_info() -> dict:
    return dict(_INFO)


def set_blas_threads(n: int) -> None:
    """Set the loaded OpenBLAS's thread count.

    The default is 1 (SPEL_BLAS_THREADS or OPENBLAS_NUM_THREADS override it):
    decoding multiplies small matrices (M = K+1 rows), where a second BLAS
    thread spin-waits; on a loaded 2-core machine the K+1 verify cost went
    from 1.8 to 8.4 AR tokens with 2 threads.  Training (large GEMMs) may ask
    for more.
    """
    if _SET_THREADS is None or n < 1:
        return
    _SET_THREADS(int(n))
    _INFO["threads"] = int(n)


def _default_threads() -> int:
    threads = setting("SPEL_BLAS_THREADS")
    if threads is not None:
        return threads
    try:      # OpenBLAS's own variable, as OpenBLAS reads it: a bad value is its default
        return max(1, int(os.environ.get("OPENBLAS_NUM_THREADS") or "1"))
    except ValueError:
        return 1


def _numpy_openblas() -> str | None:
    spec = importlib.machinery.PathFinder.find_spec("numpy")
    if spec is None or not spec.submodule_search_locations:
        return None
    site = os.path.dirname(list(spec.submodule_search_locations)[0])
    libs = sorted(glob.glob(os.path.join(site, "numpy.libs", "libscipy_openblas*.so*")))
    libs += sorted(glob.glob(os.path.join(site, "numpy", ".dylibs", "libscipy_openblas*")))
    return libs[0] if libs else None


def _shim_path() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = os.path.join(here, "_blasshim" + suffix)
        if os.path.exists(p):
            return p
    # Source checkout without a build step: compile the shim into a cache dir.
    src = os.path.join(here, "_blasshim.c")
    if not os.path.exists(src):
        return None
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "spel_mlx")
    out = os.path.join(cache, "libspel_blasshim.so")
    if os.path.exists(out) and os.path.getmtime(out) >= os.path.getmtime(src):
        return out
    cc = sysconfig.get_config_var("CC") or "cc"
    try:
        os.makedirs(cache, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        subprocess.run(cc.split()[:1] + ["-O2", "-shared", "-fPIC", src, "-o", tmp],
                       check=True, capture_output=True, timeout=60)
        os.replace(tmp, out)
        return out
    except Exception:
        return None


def _load_numpy_shim() -> tuple[bool, str]:
    lib = _numpy_openblas()
    if lib is None:
        return False, "numpy's bundled OpenBLAS not found"
    shim = _shim_path()
    if shim is None:
        return False, "BLAS shim not built and no C compiler to build it"
    ob = ctypes.CDLL(lib)
    names = None
    for prefix, suffix in (("scipy_cblas_", "64_"), ("cblas_", "64_"), ("scipy_cblas_", "")):
        try:
            names = [getattr(ob, f"{prefix}{f}{suffix}") for f in ("sgemm", "dgemm", "cgemm")]
            break
        except AttributeError:
            continue
    if names is None:
        return False, f"{lib} has no ILP64 cblas_sgemm"
    if not getattr(ob, "scipy_openblas_get_config64_", None) and "64" not in os.path.basename(lib):
        return False, f"{lib} is not ILP64"
    sh = ctypes.CDLL(shim, mode=ctypes.RTLD_GLOBAL)
    addrs = [ctypes.cast(f, ctypes.c_void_p) for f in names]
    if sh.spel_blasshim_init(*addrs) != 0:
        return False, "shim init failed"
    _KEEP.extend([ob, sh])
    _INFO.update(kind="numpy-openblas", path=lib, detail=f"LP64 shim {shim}")
    global _SET_THREADS
    for name in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
                 "openblas_set_num_threads"):
        fn = getattr(ob, name, None)
        if fn is not None:
            _SET_THREADS = fn
            break
    return True, ""


def _load_system() -> tuple[bool, str]:
    cands = [ctypes.util.find_library("openblas"), "libopenblas.so.0",
             "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
             "/usr/lib/aarch64-linux-gnu/libopenblas.so.0"]
    for c in cands:
        if not c:
            continue
        try:
            h = ctypes.CDLL(c, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        if getattr(h, "cblas_sgemm", None) is None:
            continue
        _KEEP.append(h)
        _INFO.update(kind="system-openblas", path=c, detail="loaded RTLD_GLOBAL")
        global _SET_THREADS
        _SET_THREADS = getattr(h, "openblas_set_num_threads", None)
        return True, ""
    return False, "no LP64 libopenblas.so.0 on this system"


def ensure_blas() -> dict:
    """Load an optimized BLAS before mlx.core (Linux only); idempotent."""
    if _INFO["kind"] != "not-loaded":
        return blas_info()
    if not sys.platform.startswith("linux"):
        _INFO.update(kind="platform-default", detail="macOS: MLX uses Accelerate")
        return blas_info()
    choice = setting("SPEL_BLAS")
    if "mlx.core" in sys.modules:
        _INFO.update(kind="reference", detail="mlx.core was imported before spel_mlx; "
                     "import spel_mlx first to get the fast BLAS")
        warnings.warn("spel_mlx: mlx.core already imported; MLX keeps its reference BLAS "
                      "(import spel_mlx before mlx)", RuntimeWarning, stacklevel=3)
        return blas_info()
    if choice == "reference":
        _INFO.update(kind="reference", detail="SPEL_BLAS=reference")
        return blas_info()
    reasons = []
    order = {"auto": (_load_numpy_shim, _load_system), "numpy": (_load_numpy_shim,),
             "system": (_load_system,)}[choice]
    for loader in order:
        try:
            ok, why = loader()
        except OSError as e:
            ok, why = False, str(e)
        if ok:
            set_blas_threads(_default_threads())
            return blas_info()
        reasons.append(why)
    _INFO.update(kind="reference", detail="; ".join(reasons))
    warnings.warn("spel_mlx: no optimized BLAS found, MLX matmuls will be ~30x slower: "
                  + "; ".join(reasons), RuntimeWarning, stacklevel=3)
    return blas_info()
