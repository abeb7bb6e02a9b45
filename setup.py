"""Build steps that pyproject.toml cannot express: the C extensions.

* ``spel_mlx._blasshim``: LP64 CBLAS forwarders (see spel_mlx/_blas.py); a
  plain shared library loaded with ctypes, never imported.
* the cffi draft engine from ``neon/`` (when present).
"""
import os
import sys

from setuptools import Extension, setup

ext_modules = []
cffi_modules = []
if sys.platform.startswith("linux"):
    ext_modules.append(Extension("spel_mlx._blasshim", sources=["spel_mlx/_blasshim.c"],
                                 extra_compile_args=["-O2"]))
if os.path.exists(os.path.join(os.path.dirname(os.path.abspath(__file__)), "neon", "build_ffi.py")):
    cffi_modules.append("neon/build_ffi.py:ffibuilder")

setup(ext_modules=ext_modules, cffi_modules=cffi_modules)
