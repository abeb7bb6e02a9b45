"""Two executors of the same launch plans: Metal (``mx.fast.metal_kernel``) and the
C++ emulation of the kernel bodies (``emu/``) on numpy buffers."""
from __future__ import annotations

import contextlib

import numpy as np

import mlx.core as mx

from . import kernel_body, kernel_header
from .launch import KERNELS, Launch

MX_DTYPES = {np.dtype(np.float32): mx.float32, np.dtype(np.int8): mx.int8,
             np.dtype(np.int32): mx.int32, np.dtype(np.uint32): mx.uint32}


def metal_available() -> bool:
    try:
        return bool(mx.metal.is_available())
    except Exception:  # noqa: BLE001  (no Metal module in this build)
        return False


class MetalExecutor:
    """Runs launches through mx.fast.metal_kernel (kernels built once per name)."""

    def __init__(self):
        if not metal_available():
            raise RuntimeError("Metal is not available on this machine (mx.metal.is_available() "
                               "is False); use select('mlx') or select('emulated')")
        self._kernels = {}
        self._header = kernel_header()

    def _kernel(self, name):
        k = self._kernels.get(name)
        if k is None:
            kd = KERNELS[name]
            k = mx.fast.metal_kernel(name="spel_" + name, input_names=list(kd.inputs),
                                     output_names=list(kd.outputs), source=kernel_body(name),
                                     header=self._header, ensure_row_contiguous=True)
            self._kernels[name] = k
        return k

    def run(self, launch: Launch):
        return self._kernel(launch.kernel)(
            inputs=launch.inputs, template=launch.template, grid=launch.grid,
            threadgroup=launch.threadgroup, output_shapes=launch.output_shapes,
            output_dtypes=[MX_DTYPES[np.dtype(d)] for d in launch.output_dtypes])


class EmuExecutor:
    """Runs launches on the C++-compiled kernel bodies (one shared library per build)."""
    _shared = None

    def __init__(self, lanes=None):
        from .emu import build
        self.emu = build
        self.lanes = lanes
        build.lanes_mode(lanes)  # validate early
        if build.compiler() is None:
            raise RuntimeError("the Metal emulation needs a C++ compiler (g++ or clang++)")
        header = kernel_header()
        self.kernels = {n: build.EmuKernel(n, kd.inputs, kd.outputs, kernel_body(n), header)
                        for n, kd in KERNELS.items()}
        if EmuExecutor._shared is None:
            EmuExecutor._shared = build.EmuLibrary()
        self.library = EmuExecutor._shared
        self._collect = None

    @contextlib.contextmanager
    def collecting(self):
        """Record the instantiations the calls inside need; build them in ONE compiler run."""
        self._collect = []
        try:
            yield
            insts = self._collect
        finally:
            self._collect = None
        self.library.build(self.kernels, insts)

    def run(self, launch: Launch):
        k = self.kernels[launch.kernel]
        if self._collect is not None:
            self._collect.append(self.emu.instance_for(k, launch.inputs, launch.output_dtypes,
                                                       launch.template))
            return [np.zeros(s, d) for s, d in zip(launch.output_shapes, launch.output_dtypes)]
        return self.emu.launch(self.library, self.kernels, k, launch.inputs, launch.template,
                               launch.grid, launch.threadgroup, launch.output_shapes,
                               launch.output_dtypes, lanes=self.lanes)
