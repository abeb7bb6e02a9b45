"""Which ops implementation runs: the one home of that choice.

``auto_ops()`` is what a new model starts with: the fused CPU primitives on the
CPU device when they are built for this MLX (and SPEL_KERNELS is unset, "auto"
or "cpu"), else plain MLX.  ``select(path)`` picks explicitly (``"auto" | "mlx"
| "cpu" | "metal" | "emulated"``, default SPEL_KERNELS; auto = metal where
available, else cpu when built, else mlx); ``describe()`` says which is in use.
"""
from __future__ import annotations

import os

import mlx.core as mx

from ..metal.executors import metal_available
from ..metal.launch import KERNELS
from . import cpu_ops
from .ops import MLXOps

PATHS = ("auto", "mlx", "cpu", "metal", "emulated")
_selected = None


def auto_ops() -> MLXOps:
    if os.environ.get("SPEL_KERNELS", "auto").strip().lower() in ("auto", "cpu", "") \
            and mx.default_device() == mx.cpu and cpu_ops.available():
        return cpu_ops.CPUFusedOps()
    return MLXOps()


def resolve(path: str | None = None) -> str:
    p = (path or os.environ.get("SPEL_KERNELS") or "auto").strip().lower()
    if p not in PATHS:
        raise ValueError("kernel path %r: expected one of %s (argument or SPEL_KERNELS)"
                         % (p, ", ".join(PATHS)))
    if p == "auto":
        p = "metal" if metal_available() else "cpu" if cpu_ops.available() else "mlx"
    return p


def select(path: str | None = None) -> MLXOps:
    """The ops object for ``path`` (None: SPEL_KERNELS, else auto); remembered for describe()."""
    global _selected
    p = resolve(path)
    if p == "mlx":
        ops = MLXOps()
    elif p == "cpu":
        ops = cpu_ops.CPUFusedOps()      # raises with the reason when the module is unusable
    else:
        from .metal_ops import EmulatedOps, MetalOps
        ops = MetalOps() if p == "metal" else EmulatedOps()
    _selected = p
    return ops


def describe() -> str:
    """One line: which ops path is in use (or would be chosen)."""
    names = ", ".join(KERNELS)
    try:
        p = _selected or resolve()
    except ValueError as e:
        return "invalid: %s" % e
    how = "selected" if _selected else "auto" if not os.environ.get("SPEL_KERNELS") else "SPEL_KERNELS"
    if p == "metal":
        if not metal_available():
            return "metal (%s) requested, but Metal is unavailable here: select() will fail" % how
        return "metal (%s): custom kernels %s via mx.fast.metal_kernel" % (how, names)
    if p == "emulated":
        return "emulated (%s): kernels %s compiled as C++ on the CPU (tests/diagnostics)" % (how, names)
    ok, why = cpu_ops.status()
    if p == "cpu":
        if not ok:
            return "cpu (%s) requested, but %s: select() will fail" % (how, why)
        simd = cpu_ops._spel_cpu.simd()
        return ("cpu (%s): fused CPU primitives (spel_mlx._spel_cpu, %s): FFN, GDN and attention "
                "sub-blocks, linear, RMSNorm; SIMD %s%s" % (
                    how, why, simd, ", AVX-512 linear tiles" if simd == "avx512" else ", BLAS linear"))
    why = ("" if metal_available() else "; Metal unavailable on this machine") + \
        ("" if ok else "; fused CPU primitives unavailable: " + why)
    return "mlx (%s): MLX ops%s" % (how, why)
