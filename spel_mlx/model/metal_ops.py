"""The Metal kernels (spel_mlx.metal) as the model's ops: ``MetalOps`` on Apple GPUs,
``EmulatedOps`` on their C++ emulation (tests, diagnostics).

Both implement conv_step, delta_rule and attend from the same launch plans, plus
fused forms (``delta_rule_fused``: L2 norm + sigmoid gates + delta rule;
``attend_rope``: q norm + RoPE + attention) and the ternary GPU draft path
(``quantize_activations``, ``ternary_matmul``, ``q8_matmul``).  Everything else
is MLXOps.  Grid layouts and their reasons: docs/metal.md.
"""
from __future__ import annotations

import numpy as np

import mlx.core as mx

from ..metal.executors import MX_DTYPES, EmuExecutor, MetalExecutor
from ..metal.formats import pad_q8_rows
from ..metal.launch import (ceil_to, plan_act_quant, plan_attend, plan_conv, plan_delta, plan_gemv,
                            supports)
from .ops import MLXOps


class _KernelOps(MLXOps):
    """The kernel-backed methods; subclasses supply the array plumbing."""
    path = "?"

    def __init__(self, executor):
        self._ex = executor
        self._freq_cache = {}

    def _in(self, a, dtype=np.float32):
        raise NotImplementedError

    def _scalar(self, v: int):
        raise NotImplementedError

    def _pos(self, pos0):
        raise NotImplementedError

    def _kv_rows(self, k_cache, v_cache, pos0, M):
        raise NotImplementedError

    def _out(self, a):
        raise NotImplementedError

    def _words(self, w_packed):
        raise NotImplementedError

    def _pad_cols(self, w, cols):
        raise NotImplementedError

    def _unsupported(self, what, hd):
        """A shape the kernels do not handle: None to fall back to MLXOps, or raise."""
        return None

    # -- GDN -----------------------------------------------------------------------------
    def conv_step(self, x, tail, conv):
        u, tails = self._ex.run(plan_conv(self._in(x), self._in(tail), self._in(conv)))
        return self._out(u), self._out(tails)

    def delta_rule(self, q, k, v, a, beta, S0, gates=None):
        hd = q.shape[-1]
        if not supports("delta", hd):
            self._unsupported("delta_rule", hd)
            return super().delta_rule(q, k, v, a, beta, S0, gates)
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
        """k_cache/v_cache: at least pos0+M rows; pos0 an int or an int32 scalar array."""
        hd = q.shape[-1]
        if not supports("attend", hd):
            self._unsupported("attend", hd)
            return super().attend(q, k_cache, v_cache, pos0, M)
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

    # -- ternary draft on the GPU ----------------------------------------------------------
    def quantize_activations(self, x):
        """x [N, C] -> (xq int8 [N, ceil(C/64)*64], sx f32 [N]) per SPEC 3."""
        x = self._in(x)
        cp = ceil_to(max(int(x.shape[1]), 1), 64)
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


class MetalOps(_KernelOps):
    """Custom Metal kernels through mx.fast.metal_kernel (Apple GPUs only); they are
    graph primitives, so they work inside the model's compiled passes."""
    path = "metal"
    name = "metal-kernels"

    def __init__(self):
        super().__init__(MetalExecutor())

    def _in(self, a, dtype=np.float32):
        a = a if isinstance(a, mx.array) else mx.array(np.asarray(a, dtype=dtype))
        want = MX_DTYPES[np.dtype(dtype)]
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
    """The kernel bodies compiled as C++ and run on the CPU (tests / diagnostics).

    Accepts mx or numpy arrays; returns mx arrays (``numpy_out=True``: numpy).  ``lanes``:
    the threads of a threadgroup are OS threads ("threads", default) or fibers ("fibers",
    same results, much faster on a loaded machine); default METAL_EMU_LANES.  It reads
    array values on the host, so a model using it runs uncompiled (``requires_eager``)."""
    path = "emulated"
    name = "metal-emulated"
    requires_eager = True

    def __init__(self, numpy_out: bool = False, lanes: str | None = None):
        super().__init__(EmuExecutor(lanes))
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

    def _unsupported(self, what, hd):
        raise ValueError("%s: head_dim %d is outside what the kernels support" % (what, hd))
