"""Which device the target runs on and which ops implementation runs there: the one
home of both choices.

Devices are MLX's two: ``"gpu"`` (Metal on Apple, CUDA with the ``mlx-cuda-13``
wheel on Linux; ``gpu_backend()`` says which) and ``"cpu"``.  ``placement_device``
turns a ``--placement`` (``gpu | cpu``, None: MLX's default, the GPU where there is
one) into a device, or a clear error when a GPU is asked for and MLX has none;
``device_scope`` runs code on it.

Ops per device: the Metal kernels only on a Metal GPU, the fused CPU primitives only
on the CPU device, the plain MLX ops anywhere (what a CUDA GPU runs).
``auto_ops(device)`` is what a model starts with on a device: the fused CPU
primitives on the CPU when they are built for this MLX (and SPEL_KERNELS is unset,
"auto" or "cpu"), else plain MLX.  ``select(path, device)`` picks explicitly
(``"auto" | "mlx" | "cpu" | "metal" | "emulated"``, default SPEL_KERNELS; auto =
Metal on a Metal GPU, the fused primitives on the CPU when built, else plain MLX);
``describe()`` says which is in use.
"""
from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx

from ..metal import executors
from ..metal.launch import KERNELS
from ..settings import raw as raw_setting, setting
from . import cpu_ops
from .ops import MLXOps

PATHS = ("auto", "mlx", "cpu", "metal", "emulated")
DEVICES = ("cpu", "gpu")
_selected = None


class DeviceError(ValueError):
    """A device or ops choice this machine cannot run (names what is missing)."""


# --- devices -------------------------------------------------------------------------
def _cuda_available() -> bool:
    try:
        return bool(mx.cuda.is_available())
    except Exception:  # noqa: BLE001  (no CUDA module in this build)
        return False


def gpu_backend() -> str | None:
    """"metal" | "cuda" | None: the GPU backend of this MLX on this machine."""
    if executors.metal_available():
        return "metal"
    if _cuda_available():
        return "cuda"
    try:
        return "gpu" if mx.is_available(mx.gpu) else None   # a backend of a later MLX
    except Exception:  # noqa: BLE001
        return None


def gpu_available() -> bool:
    return gpu_backend() is not None


def no_gpu_reason() -> str:
    """Why MLX has no GPU here, with the fix where one is known."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(dist):
        try:
            return version(dist)
        except PackageNotFoundError:
            return None
    why = f"MLX {mx.__version__} reports no GPU on this machine (no Metal, no CUDA)"
    cuda = installed("mlx-cuda-13") or installed("mlx-cuda-12")
    if cuda and installed("mlx-cpu"):
        why += ("; mlx-cpu and mlx-cuda are both installed and ship the same mlx/lib/libmlx.so, "
                "so the CPU build may have overwritten the CUDA one: pip install --force-reinstall "
                f"--no-deps mlx-cuda-13=={cuda} (docs/gpu.md)")
    elif cuda:
        why += "; mlx-cuda is installed: is an NVIDIA driver visible (nvidia-smi)?"
    elif not executors.metal_available():
        why += "; on Linux with an NVIDIA GPU install the CUDA build: pip install 'spel-mlx[cuda]' (docs/gpu.md)"
    return why


def device_name(device=None) -> str:
    """"cpu" | "gpu" of ``device`` (a name, an mx.Device or DeviceType; None: the
    current default device)."""
    if device is None:
        device = mx.default_device()
    if isinstance(device, str):
        if device not in DEVICES:
            raise DeviceError(f"device {device!r}: expected one of {', '.join(DEVICES)}")
        return device
    return "cpu" if device == mx.cpu else "gpu"


def mx_device(name: str):
    return mx.gpu if device_name(name) == "gpu" else mx.cpu


def placement_device(placement: str | None = None) -> str:
    """The target's device for a placement: "gpu" (an error when MLX has no GPU
    here), "cpu", or None: MLX's default (the GPU where there is one, else the CPU).
    "auto" is decided by calibration (decoding/placement.py), not here."""
    if placement is None:
        return "gpu" if gpu_available() else "cpu"
    if placement == "gpu":
        if not gpu_available():
            raise DeviceError(f"placement gpu: {no_gpu_reason()}")
        return "gpu"
    if placement == "cpu":
        return "cpu"
    raise DeviceError(f"placement {placement!r}: expected gpu or cpu (auto is resolved by calibration)")


@contextmanager
def device_scope(name: str):
    """Run the block with ``name`` ("cpu" | "gpu") as MLX's default device on this
    thread (MLX's defaults are per thread)."""
    with mx.stream(mx_device(name)):
        yield


# --- ops -----------------------------------------------------------------------------
def runs_on(ops, device: str) -> bool:
    """Whether ``ops`` can run a pass on ``device``: the fused CPU primitives only on
    the CPU device, the Metal kernels only where Metal exists; plain MLX and the C++
    emulation (host-side) anywhere."""
    if isinstance(ops, cpu_ops.CPUFusedOps):
        return device_name(device) == "cpu"
    if getattr(ops, "path", None) == "metal":
        return executors.metal_available()
    return True


def auto_ops(device=None) -> MLXOps:
    """The ops a model starts with on ``device`` (None: the current default device)."""
    if setting("SPEL_KERNELS") in ("auto", "cpu") \
            and device_name(device) == "cpu" and cpu_ops.available():
        return cpu_ops.CPUFusedOps()
    return MLXOps()


def resolve(path: str | None = None, device=None) -> str:
    """The ops path for ``device`` (None: the current default device): ``path``, else
    SPEL_KERNELS, else auto; a path that cannot run there is a DeviceError."""
    p = (path or setting("SPEL_KERNELS")).strip().lower()
    if p not in PATHS:
        raise ValueError("kernel path %r: expected one of %s (argument or SPEL_KERNELS)"
                         % (p, ", ".join(PATHS)))
    dev = device_name(device)
    if p == "auto":
        if dev == "gpu":
            return "metal" if gpu_backend() == "metal" else "mlx"
        return "cpu" if cpu_ops.available() else "mlx"
    if p == "cpu" and dev != "cpu":
        raise DeviceError(f"kernel path 'cpu': the fused CPU primitives run only on the CPU device, "
                          f"not on the {gpu_backend() or 'gpu'} GPU (use auto or mlx)")
    if p == "metal" and (dev != "gpu" or gpu_backend() not in ("metal", None)):
        raise DeviceError("kernel path 'metal': the Metal kernels run only on a Metal GPU, not on "
                          + ("the CPU device" if dev != "gpu" else f"the {gpu_backend()} GPU"))
    return p


def select(path: str | None = None, device=None) -> MLXOps:
    """The ops object for ``path`` on ``device`` (None: SPEL_KERNELS, else auto; the
    current default device); remembered for describe()."""
    global _selected
    p = resolve(path, device)
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
    """One line: which ops path is in use (or would be chosen) on the default device."""
    names = ", ".join(KERNELS)
    try:
        p = _selected or resolve()
    except ValueError as e:
        return "invalid: %s" % e
    how = "selected" if _selected else "auto" if not raw_setting("SPEL_KERNELS") else "SPEL_KERNELS"
    if p == "metal":
        if not executors.metal_available():
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
                "sub-blocks, linear, RMSNorm; SIMD %s%s; attention helper thread %s" % (
                    how, why, simd, f", {simd.upper()} linear tiles" if cpu_ops._spel_cpu.fma_chain_linear()
                    else ", BLAS linear",
                    cpu_ops._spel_cpu.helper_state()))
    gpu = gpu_backend()
    if device_name() == "gpu":
        return "mlx (%s): MLX ops on the %s GPU" % (how, gpu)
    why = ("" if executors.metal_available() else "; Metal unavailable on this machine") + \
        ("" if ok else ("; WARNING: fused CPU primitives off: " if cpu_ops.mismatch() else
                        "; fused CPU primitives unavailable: ") + why)
    return "mlx (%s): MLX ops%s" % (how, why)
