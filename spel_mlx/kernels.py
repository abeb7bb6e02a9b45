"""Custom Metal kernels for the target's K+1 verification batch, and their dispatch.

The model's three sequence primitives go through an ops object
(``model.set_ops(ops)``; default ``spel_mlx.model.MLXOps``):

* ``conv_step(x [M,d], tail [2,d], conv [3,d]) -> (u [M,d], tails [M,2,d])``
* ``delta_rule(q, k, v [M,H,hd], a [H], beta [H], S0 [H,hd,hd]) -> (o [M,H,hd], S_all [M,H,hd,hd])``
* ``attend(q [M,H,hd], k_cache, v_cache [max_seq,H,hd], pos0, M) -> o [M,H,hd]``

This module provides

* ``MetalOps``: the same primitives as custom kernels (``metal/*.metal``) run
  through ``mx.fast.metal_kernel``; only where ``mx.metal.is_available()``.
* ``EmulatedOps``: the SAME kernel bodies compiled as C++ against
  ``tests/metal_emu/metal_emu.h`` and run on numpy buffers (tests and
  diagnostics; needs a source checkout and g++).
* ``select(path)`` (``"auto" | "mlx" | "cpu" | "metal" | "emulated"``, default
  from SPEL_KERNELS, else auto = metal when available, else cpu (the fused CPU
  primitives of ``spel_mlx.cpu_ops``) when built, else mlx) and ``describe()``.

Beyond the contract both kernel paths offer fused forms (``delta_rule_fused``:
L2 norm + sigmoid gates + delta rule; ``attend_rope``: q norm + RoPE +
attention) and the ternary GPU draft path (``quantize_activations``,
``ternary_matmul``).  Grid layouts and their reasons: docs/metal.md.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

import mlx.core as mx  # the package __init__ has already loaded the BLAS

from .metal import source as _metal_source

PATHS = ("auto", "mlx", "cpu", "metal", "emulated")


@dataclass(frozen=True)
class KernelDef:
    name: str       # metal/<name>.metal holds the body
    inputs: tuple
    outputs: tuple


KERNELS = {
    k.name: k for k in (
        KernelDef("gdn_conv", ("x", "tail", "conv"), ("u", "tails")),
        KernelDef("gdn_delta", ("q", "k", "v", "decay", "beta", "s0"), ("o", "s_all")),
        KernelDef("attn_verify", ("q", "k_cache", "v_cache", "pos0", "inv_freq"), ("o",)),
        KernelDef("tern_act_quant", ("x", "cp"), ("xq", "sx")),
        KernelDef("tern_gemv", ("w", "ws", "xq", "sx"), ("y",)),
        KernelDef("q8_gemv", ("w", "ws", "xq", "sx"), ("y",)),
    )
}
HEADER_FILE = "spel_common.h"
ATTN_THREADS = 128          # attn_verify's NT
DELTA_ROWS_PER_GROUP = 4    # gdn_delta threadgroup (32, 4, 1)
GEMV_ROWS_PER_SIMD = 2      # tern_gemv's RPS
GEMV_SIMD_PER_GROUP = 4


def kernel_body(name: str) -> str:
    return _metal_source(name + ".metal")


def kernel_header() -> str:
    return _metal_source(HEADER_FILE)


def metal_available() -> bool:
    try:
        return bool(mx.metal.is_available())
    except Exception:  # noqa: BLE001  (no Metal module in this build)
        return False


def supports(kind: str, head_dim: int) -> bool:
    """Shapes the kernels handle; other shapes fall back to MLX ops."""
    if kind == "attend":
        return head_dim in (32, 64, 128)
    if kind == "delta":
        return head_dim in (32, 64, 128)
    return True


@dataclass
class Launch:
    kernel: str
    inputs: list
    template: list
    grid: tuple
    threadgroup: tuple
    output_shapes: list
    output_dtypes: list   # numpy dtypes


def _ceil_to(n: int, m: int) -> int:
    return (n + m - 1) // m * m


# ---- launch plans: identical for the Metal and the emulated executor ---------------
def plan_conv(x, tail, conv) -> Launch:
    M, d = x.shape
    tg = 64
    return Launch("gdn_conv", [x, tail, conv], [], (_ceil_to(d, tg), 1, 1), (tg, 1, 1),
                  [(M, d), (M, 2, d)], [np.float32, np.float32])


def plan_delta(q, k, v, decay, beta, s0, fused: bool) -> Launch:
    M, H, hd = q.shape
    return Launch("gdn_delta", [q, k, v, decay, beta, s0], [("HD", hd), ("FUSED", int(fused))],
                  (32, hd, H), (32, DELTA_ROWS_PER_GROUP, 1),
                  [(M, H, hd), (M, H, hd, hd)], [np.float32, np.float32])


def plan_attend(q, k_cache, v_cache, pos0, inv_freq, rope_q: bool) -> Launch:
    M, H, hd = q.shape
    return Launch("attn_verify", [q, k_cache, v_cache, pos0, inv_freq],
                  [("HD", hd), ("ROPE_Q", int(rope_q))],
                  (ATTN_THREADS, M, H), (ATTN_THREADS, 1, 1), [(M, H, hd)], [np.float32])


def plan_act_quant(x, cp_scalar, cp: int) -> Launch:
    N = x.shape[0]
    return Launch("tern_act_quant", [x, cp_scalar], [], (256, N, 1), (256, 1, 1),
                  [(N, cp), (N,)], [np.int8, np.float32])


def plan_gemv(w, ws, xq, sx, kernel="tern_gemv") -> Launch:
    R = w.shape[0]
    N = xq.shape[0]
    nv = 1 if N == 1 else 4
    groups = (R + GEMV_ROWS_PER_SIMD - 1) // GEMV_ROWS_PER_SIMD
    return Launch(kernel, [w, ws, xq, sx], [("NV", nv)],
                  (32, _ceil_to(groups, GEMV_SIMD_PER_GROUP), (N + nv - 1) // nv),
                  (32, GEMV_SIMD_PER_GROUP, 1), [(N, R)], [np.float32])


def rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """theta^(-2i/hd), i < hd/2, in float32 (computed in float64 then rounded)."""
    i = np.arange(head_dim // 2, dtype=np.float64)
    return (float(theta) ** (-2.0 * i / head_dim)).astype(np.float32)


# ---- executors -------------------------------------------------------------------------
_MX_DTYPES = {np.dtype(np.float32): mx.float32, np.dtype(np.int8): mx.int8,
              np.dtype(np.int32): mx.int32, np.dtype(np.uint32): mx.uint32}


class _MetalExecutor:
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
            output_dtypes=[_MX_DTYPES[np.dtype(d)] for d in launch.output_dtypes])


def _emu_module():
    """tests/metal_emu/build.py of the source checkout (not installed with the package)."""
    mod = sys.modules.get("spel_metal_emu_build")
    if mod is not None:
        return mod
    d = os.environ.get("SPEL_METAL_EMU_DIR") or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "metal_emu")
    path = os.path.join(d, "build.py")
    if not os.path.exists(path):
        raise RuntimeError("the Metal emulation harness was not found at %s (it lives in a source "
                           "checkout's tests/metal_emu; set SPEL_METAL_EMU_DIR)" % path)
    spec = importlib.util.spec_from_file_location("spel_metal_emu_build", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["spel_metal_emu_build"] = mod  # before exec: its dataclasses look it up
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules["spel_metal_emu_build"]
        raise
    return mod


class _EmuExecutor:
    """Runs launches on the C++-compiled kernel bodies (one shared library per build)."""
    _shared = None

    def __init__(self, lanes=None):
        self.emu = _emu_module()
        self.lanes = lanes
        self.emu.lanes_mode(lanes)  # validate early
        if self.emu.compiler() is None:
            raise RuntimeError("the Metal emulation needs a C++ compiler (g++ or clang++)")
        header = kernel_header()
        self.kernels = {n: self.emu.EmuKernel(n, kd.inputs, kd.outputs, kernel_body(n), header)
                        for n, kd in KERNELS.items()}
        if _EmuExecutor._shared is None:
            _EmuExecutor._shared = self.emu.EmuLibrary()
        self.library = _EmuExecutor._shared
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


# ---- ops -------------------------------------------------------------------------------
class _KernelOps:
    """The model's ops contract (plus fused and ternary extras) on custom kernels."""
    path = "?"

    def __init__(self, executor):
        self._ex = executor
        self._fallback_ops = None
        self._freq_cache = {}

    # array plumbing, specialised by the subclasses
    def _in(self, a, dtype=np.float32):
        raise NotImplementedError

    def _scalar(self, v: int):
        raise NotImplementedError

    def _out(self, a):
        raise NotImplementedError

    def _fallback(self):
        if self._fallback_ops is None:
            from .model import MLXOps  # late: model.py imports this module's users
            self._fallback_ops = MLXOps()
        return self._fallback_ops

    # -- GDN -----------------------------------------------------------------------------
    def conv_step(self, x, tail, conv):
        u, tails = self._ex.run(plan_conv(self._in(x), self._in(tail), self._in(conv)))
        return self._out(u), self._out(tails)

    def delta_rule(self, q, k, v, a, beta, S0):
        hd = q.shape[-1]
        if not supports("delta", hd):
            return self._unsupported("delta_rule", hd, q, k, v, a, beta, S0)
        o, s_all = self._ex.run(plan_delta(self._in(q), self._in(k), self._in(v), self._in(a),
                                           self._in(beta), self._in(S0), fused=False))
        return self._out(o), self._out(s_all)

    def delta_rule_fused(self, q_raw, k_raw, v, decay_logit, beta_logit, S0):
        """L2-normalize q, k (eps inside the norm), sigmoid the logits, then delta_rule."""
        hd = q_raw.shape[-1]
        if not supports("delta", hd):
            raise ValueError("delta_rule_fused: head_dim %d unsupported (32, 64 or 128)" % hd)
        o, s_all = self._ex.run(plan_delta(self._in(q_raw), self._in(k_raw), self._in(v),
                                           self._in(decay_logit), self._in(beta_logit),
                                           self._in(S0), fused=True))
        return self._out(o), self._out(s_all)

    # -- attention ----------------------------------------------------------------------
    def attend(self, q, k_cache, v_cache, pos0, M):
        """k_cache/v_cache: at least pos0+M rows (the model passes a window); pos0 an int or
        an int32 scalar array (traced inside the model's mx.compile'd step)."""
        hd = q.shape[-1]
        if not supports("attend", hd):
            return self._unsupported("attend", hd, q, k_cache, v_cache, pos0, M)
        kc, vc = self._kv_rows(k_cache, v_cache, pos0, M)
        (o,) = self._ex.run(plan_attend(self._in(q), kc, vc, self._pos(pos0),
                                        self._unit_freq(hd), rope_q=False))
        return self._out(o)

    def attend_rope(self, q_raw, k_cache, v_cache, pos0, M, inv_freq):
        """q_raw unnormalized and unrotated: normalize + RoPE (angle pos*inv_freq[i]) in-kernel."""
        hd = q_raw.shape[-1]
        if not supports("attend", hd):
            raise ValueError("attend_rope: head_dim %d unsupported (32, 64 or 128)" % hd)
        kc, vc = self._kv_rows(k_cache, v_cache, pos0, M)
        (o,) = self._ex.run(plan_attend(self._in(q_raw), kc, vc, self._pos(pos0),
                                        self._in(inv_freq), rope_q=True))
        return self._out(o)

    def _unit_freq(self, hd):
        # attn_verify always takes inv_freq; unused when ROPE_Q = 0
        f = self._freq_cache.get(hd)
        if f is None:
            f = self._freq_cache[hd] = self._in(np.ones(hd // 2, np.float32))
        return f

    # -- ternary draft on the GPU --------------------------------------------------------------
    def quantize_activations(self, x):
        """x [N, C] -> (xq int8 [N, ceil(C/64)*64], sx f32 [N]) per SPEC 3."""
        x = self._in(x)
        cp = _ceil_to(max(int(x.shape[1]), 1), 64)
        xq, sx = self._ex.run(plan_act_quant(x, self._scalar(cp), cp))
        return self._out(xq), self._out(sx)

    def ternary_matmul(self, x, w_packed, scales):
        """y [N, R] = per-vector int8 x times ternary rows (SPEC 3 packing, uint8 [R, cp/4]
        or its uint32 view [R, cp/16]); a 1-D x gives y [R]."""
        vec = len(x.shape) == 1
        x2 = x.reshape(1, -1) if vec else x
        xq, sx = self.quantize_activations(x2)
        w = self._words(w_packed)
        if int(w.shape[1]) * 16 != int(xq.shape[1]):
            raise ValueError("ternary_matmul: packed rows hold %d weights, activations pad to %d"
                             % (int(w.shape[1]) * 16, int(xq.shape[1])))
        (y,) = self._ex.run(plan_gemv(w, self._in(scales), self._in(xq, np.int8), self._in(sx)))
        y = self._out(y)
        return y.reshape(-1) if vec else y

    def q8_matmul(self, x, q, scales):
        """y [N, R] = per-vector int8 x times q8 rows (int8 [R, C], or already padded to
        [R, ceil(C/64)*64] by pad_q8_rows, which saves a copy per call); 1-D x gives y [R]."""
        vec = len(x.shape) == 1
        x2 = x.reshape(1, -1) if vec else x
        xq, sx = self.quantize_activations(x2)
        cp = int(xq.shape[1])
        w = self._in(q, np.int8)
        if int(w.shape[1]) != cp:
            if int(w.shape[1]) != int(x2.shape[1]):
                raise ValueError("q8_matmul: rows have %d columns, activations %d"
                                 % (int(w.shape[1]), int(x2.shape[1])))
            w = self._pad_cols(w, cp)
        (y,) = self._ex.run(plan_gemv(w, self._in(scales), self._in(xq, np.int8), self._in(sx),
                                      kernel="q8_gemv"))
        y = self._out(y)
        return y.reshape(-1) if vec else y

    def _words(self, w_packed):
        raise NotImplementedError

    def _pad_cols(self, w, cols):
        raise NotImplementedError

    def _unsupported(self, what, hd, *args):
        return getattr(self._fallback(), what)(*args)


class MetalOps(_KernelOps):
    """Custom Metal kernels through mx.fast.metal_kernel (Apple GPUs only).

    Works inside the model's mx.compile'd passes (kernels are graph primitives)."""
    path = "metal"
    name = "metal-kernels"

    def __init__(self):
        super().__init__(_MetalExecutor())

    def _in(self, a, dtype=np.float32):
        a = a if isinstance(a, mx.array) else mx.array(np.asarray(a, dtype=dtype))
        want = _MX_DTYPES[np.dtype(dtype)]
        return a if a.dtype == want else a.astype(want)

    def _scalar(self, v):
        return mx.array(v, dtype=mx.int32)

    def _pos(self, pos0):
        if isinstance(pos0, mx.array):
            return pos0.reshape(()).astype(mx.int32)
        return mx.array(int(pos0), dtype=mx.int32)

    def _kv_rows(self, k_cache, v_cache, pos0, M):
        # the kernel reads rows < pos0+M only; a leading-rows slice is a view (no copy)
        return self._in(k_cache), self._in(v_cache)

    def _out(self, a):
        return a

    def _words(self, w_packed):
        w = w_packed if isinstance(w_packed, mx.array) else mx.array(np.ascontiguousarray(w_packed))
        if w.dtype == mx.uint8:
            w = mx.view(w, mx.uint32)
        return w

    def _pad_cols(self, w, cols):
        return mx.pad(w, [(0, 0), (0, cols - int(w.shape[1]))])


class EmulatedOps(_KernelOps):
    """The kernel bodies compiled as C++ and run on the CPU (tests / diagnostics only).

    Accepts mx or numpy arrays; returns mx arrays (``numpy_out=True``: numpy).  ``lanes``:
    the threads of a threadgroup are OS threads ("threads", default) or fibers ("fibers",
    same results, much faster on a loaded machine); default METAL_EMU_LANES.  It reads
    array values on the host, so it cannot run inside mx.compile: a model using it must
    run uncompiled (``model.compile = False``); ``requires_eager`` says so."""
    path = "emulated"
    name = "metal-emulated"
    requires_eager = True

    def __init__(self, numpy_out: bool = False, lanes: str | None = None):
        super().__init__(_EmuExecutor(lanes))
        self._numpy_out = numpy_out

    def collecting(self):
        """``with ops.collecting(): <calls>`` compiles every kernel the calls need at once."""
        return self._ex.collecting()

    def _in(self, a, dtype=np.float32):
        return np.ascontiguousarray(np.asarray(a), dtype=dtype)

    def _scalar(self, v):
        return np.array(v, dtype=np.int32)

    def _pos(self, pos0):
        return np.array(int(np.asarray(pos0)), dtype=np.int32)

    def _kv_rows(self, k_cache, v_cache, pos0, M):
        n = int(np.asarray(pos0)) + int(M)  # copy only the rows the kernel reads
        return self._in(k_cache[:n]), self._in(v_cache[:n])

    def _out(self, a):
        return a if self._numpy_out else mx.array(a)

    def _words(self, w_packed):
        w = np.ascontiguousarray(np.asarray(w_packed))
        return w.view(np.uint32) if w.dtype == np.uint8 else w.astype(np.uint32, copy=False)

    def _pad_cols(self, w, cols):
        return pad_q8_rows(w)

    def _unsupported(self, what, hd, *args):
        raise ValueError("%s: head_dim %d is outside what the kernels support" % (what, hd))


def pad_q8_rows(q) -> np.ndarray:
    """q8 rows int8 [R, C] -> [R, ceil(C/64)*64] with zero columns (q8_gemv's layout)."""
    q = np.asarray(q, dtype=np.int8)
    cp = _ceil_to(max(int(q.shape[1]), 1), 64)
    out = np.zeros((q.shape[0], cp), np.int8)
    out[:, :q.shape[1]] = q
    return out


# ---- MLX's own 2-bit affine format as the ternary baseline -------------------------------
def ternary_to_mlx_affine(packed: np.ndarray, scales: np.ndarray):
    """SPEC 3 packing -> (w uint32 [R, cp/16], scales [R, cp/64], biases [R, cp/64]) for
    ``mx.quantized_matmul(..., group_size=64, bits=2)``: codes {0, 1, 2} mean -s, 0, +s
    (scale s, bias -s), which represents the ternary rows exactly.  Both formats put 16
    codes in a little-endian 32-bit word, low bits first, so only the code values change:
    ours 0 -> 1, 1 -> 2, 3 -> 0, 2 -> 1."""
    packed = np.ascontiguousarray(packed, dtype=np.uint8)
    R, nbytes = packed.shape
    cp = nbytes * 4
    codes = np.stack([(packed >> (2 * i)) & 3 for i in range(4)], axis=-1).reshape(R, cp)
    remap = np.array([1, 2, 1, 0], dtype=np.uint8)[codes]
    b = remap.reshape(R, nbytes, 4)
    repacked = (b[..., 0] | (b[..., 1] << 2) | (b[..., 2] << 4) | (b[..., 3] << 6)).astype(np.uint8)
    s = np.asarray(scales, dtype=np.float32).reshape(R, 1)
    groups = cp // 64
    return (np.ascontiguousarray(repacked).view(np.uint32), np.repeat(s, groups, axis=1),
            np.repeat(-s, groups, axis=1))


def mlx_affine_ternary_matmul(x, w, scales, biases):
    """The baseline: MLX's built-in 2-bit affine quantized matmul (float activations)."""
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=64, bits=2)


# ---- selection ------------------------------------------------------------------------
_selected = None


def resolve(path: str | None = None) -> str:
    p = (path or os.environ.get("SPEL_KERNELS") or "auto").strip().lower()
    if p not in PATHS:
        raise ValueError("kernel path %r: expected one of %s (argument or SPEL_KERNELS)"
                         % (p, ", ".join(PATHS)))
    if p == "auto":
        from . import cpu_ops
        p = "metal" if metal_available() else "cpu" if cpu_ops.available() else "mlx"
    return p


def select(path: str | None = None):
    """The ops object for ``path`` (None: SPEL_KERNELS, else auto); remembered for describe()."""
    global _selected
    p = resolve(path)
    if p == "mlx":
        from .model import MLXOps
        ops = MLXOps()
    elif p == "cpu":
        from .cpu_ops import CPUFusedOps
        ops = CPUFusedOps()      # raises with the reason when the module is unusable
    elif p == "metal":
        ops = MetalOps()
    else:
        ops = EmulatedOps()
    _selected = p
    return ops


def describe() -> str:
    """One line: which sequence-primitive path is in use (or would be chosen)."""
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
    from . import cpu_ops
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


# ---- ternary GEMV benchmark (custom kernel vs mx.quantized_matmul) ----------------------
def benchmark_ternary(rows: int = 4096, cols: int = 1536, iters: int = 200, seed: int = 0) -> dict:
    """Median seconds per call of the custom ternary GEMV and of MLX's 2-bit affine
    quantized_matmul (and FP32 matmul) on the same rows.  The custom kernel only runs on
    Metal; elsewhere only the MLX baselines are timed (CPU figures, not the GPU's)."""
    rng = np.random.default_rng(seed)
    t = rng.integers(-1, 2, size=(rows, cols)).astype(np.int8)
    s = rng.uniform(0.01, 0.05, size=rows).astype(np.float32)
    cp = _ceil_to(cols, 64)
    tp = np.zeros((rows, cp), np.uint8)
    tp[:, :cols] = np.where(t == 1, 1, np.where(t == -1, 3, 0))
    b = tp.reshape(rows, cp // 4, 4)
    packed = (b[..., 0] | (b[..., 1] << 2) | (b[..., 2] << 4) | (b[..., 3] << 6)).astype(np.uint8)
    x = rng.standard_normal(cols).astype(np.float32)
    xpad = np.zeros(cp, np.float32)
    xpad[:cols] = x
    wq, sg, bg = (mx.array(a) for a in ternary_to_mlx_affine(packed, s))
    wf = mx.array(t.astype(np.float32) * s[:, None])
    xm, xpm = mx.array(x), mx.array(xpad)

    def timed(fn):
        mx.eval(fn())
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            mx.eval(fn())
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    res = {"rows": rows, "cols": cols, "device": "gpu" if metal_available() else "cpu",
           "mlx_affine_2bit_s": timed(lambda: mlx_affine_ternary_matmul(xpm[None], wq, sg, bg)),
           "fp32_matmul_s": timed(lambda: wf @ xm)}
    if metal_available():
        ops = MetalOps()
        wm, sm = mx.array(packed), mx.array(s)
        res["spel_ternary_s"] = timed(lambda: ops.ternary_matmul(xm, wm, sm))
    return res


def _main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m spel_mlx.kernels",
                                 description="Report the kernel path; benchmark the ternary GEMV.")
    ap.add_argument("command", nargs="?", default="info", choices=("info", "bench"))
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=1536)
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args(argv)
    print("kernels:", describe())
    if a.command == "bench":
        if a.rows < 1 or a.cols < 1 or a.iters < 1:
            print("error: --rows, --cols and --iters must be >= 1", file=sys.stderr)
            return 2
        r = benchmark_ternary(a.rows, a.cols, a.iters)
        macs = r["rows"] * r["cols"]
        for key in ("spel_ternary_s", "mlx_affine_2bit_s", "fp32_matmul_s"):
            if key in r:
                print("%-20s %9.1f us  %7.2f GMAC/s  (%s)" % (key[:-2], r[key] * 1e6,
                                                           macs / r[key] / 1e9, r["device"]))
        if "spel_ternary_s" not in r:
            print("custom ternary kernel: not run (Metal unavailable)")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
