"""Fused CPU primitives as the model's ``ops`` (spel_mlx.model.MLXOps contract).

``spel_mlx._spel_cpu`` (C++ in spel_mlx/cpu_ext/, built by setup.py against the
installed MLX) adds MLX primitives that run on the CPU stream: the linears (one
sgemm per contiguous row block, no reshapes), RMSNorm, the SwiGLU gate, the
causal conv + SiLU, the gated delta rule over M tokens (with the q/k L2 norm;
every token's state, for the rollback ring) and causal attention of M queries.
Each is one graph node where MLXOps spends 3-30 small ones, and on the CPU
every node costs microseconds of dispatch: docs/model.md has the measured
passes.  A new model uses them on the CPU device (``model.auto_ops``) when the
module is built for the running MLX version; MLXOps stays the reference
(tests/test_cpu_ops.py).
"""
from __future__ import annotations

from .model import MLXOps, _rows

import mlx.core as mx  # noqa: E402

try:
    from . import _spel_cpu
    _IMPORT_ERROR = ""
except ImportError as e:          # not built (no compiler at install, non-Linux)
    _spel_cpu = None
    _IMPORT_ERROR = str(e)


def status() -> tuple:
    """(usable, reason): the module is importable and built for this MLX."""
    if _spel_cpu is None:
        return False, f"spel_mlx._spel_cpu is not built ({_IMPORT_ERROR})"
    if _spel_cpu.mlx_version != mx.__version__:
        return False, (f"spel_mlx._spel_cpu was built for MLX {_spel_cpu.mlx_version}, "
                       f"MLX {mx.__version__} is running (reinstall spel-mlx to rebuild it)")
    return True, "built for MLX " + _spel_cpu.mlx_version


def available() -> bool:
    return status()[0]


class CPUFusedOps(MLXOps):
    """MLXOps with the conv, delta rule and attention as single CPU primitives."""

    name = "cpu-fused"

    def __init__(self):
        ok, why = status()
        if not ok:
            raise RuntimeError(why)

    def linear(self, x, blocks):
        """x [M,in] @ W^T from Linear's contiguous [nb, in, rb] blocks."""
        return _spel_cpu.linear(x, blocks)

    def rms_norm(self, x, weight, eps: float):
        return _spel_cpu.rms_norm(x, weight, float(eps))

    def silu_mul(self, a, b):
        return _spel_cpu.silu_mul(a, b)

    def conv_step(self, x, tail, conv):
        u, tails = _spel_cpu.conv(x, tail, conv)
        return u, tails

    def delta_rule(self, q, k, v, a, beta, S0):
        o, S_all = _spel_cpu.delta(q, k, v, a, beta, S0)
        return o, S_all

    def delta_rule_states(self, q, k, v, a, beta, S0, gates=None):
        o, S_all = _spel_cpu.delta(q, k, v, a, beta, S0)
        return o, _rows(S_all, q.shape[0])

    def gdn_delta(self, qkv, a, beta, S0):
        """Optional fused GDN core: qkv [M, 3*H*hd] (the wqkv projection) -> o, S_all,
        unit q, unit k (L2 norm + delta_rule in one node)."""
        return _spel_cpu.gdn_delta(qkv, a, beta, S0)

    def fma_chain_linear(self) -> bool:
        """Linear products are one FMA chain per element (AVX-512 tiles): a row's
        result does not depend on the row count (see SpelModel.rows_independent)."""
        return bool(_spel_cpu.fma_chain_linear())

    def ffn_block(self, h, norm_weight, w1, w3, w2, eps: float):
        """Optional whole FFN sub-block: h + w2(silu(w1 xn) * w3 xn), xn = rmsnorm(h),
        from the three Linears' [nb, in, rb] blocks: one node, the same bits as the
        separate primitives."""
        return _spel_cpu.ffn_block(h, norm_weight, w1, w3, w2, float(eps))

    def gdn_block(self, x, norm_weight, tail, conv, wqkv, a, beta, S0, wo, eps: float):
        """Optional whole GDN sub-block: x + wo(delta rule(L2 norm(wqkv(conv(rmsnorm(x))))))
        -> (x', S_all [M,H,hd,hd], tails [M,2,d], unit q, unit k); one node."""
        return _spel_cpu.gdn_block(x, norm_weight, tail, conv, wqkv, a, beta, S0, wo, float(eps))

    def attn_block(self, x, norm_weight, wqkv, wo, k_cache, v_cache, pos0, cos, sin, window: int, eps: float):
        """Optional whole attention sub-block: x + wo(attention over the first ``window``
        cache rows) with this batch's rotated k and v written at pos0.. -> (x', k_cache,
        v_cache).  Two nodes around MLX's slice_update, which writes the rows in place
        (a custom multi-output node never may: its inputs are shared by its outputs).
        Close to the separate ops, not bit-equal (L2 norm and RoPE in C++)."""
        if not isinstance(pos0, mx.array):
            pos0 = mx.array(pos0, dtype=mx.int32)
        pos0 = pos0.astype(mx.int32)
        q, k, v = _spel_cpu.attn_qkv(x, norm_weight, wqkv, pos0, cos, sin, k_cache.shape[1], float(eps))
        k_cache = mx.slice_update(k_cache, k, pos0, axes=(0,))
        v_cache = mx.slice_update(v_cache, v, pos0, axes=(0,))
        return _spel_cpu.attn_out(x, q, k_cache, v_cache, pos0, wo, int(window)), k_cache, v_cache

    def attend(self, q, k_cache, v_cache, pos0, M):
        if not isinstance(pos0, mx.array):
            pos0 = mx.array(pos0, dtype=mx.int32)
        return _spel_cpu.attend(q, k_cache, v_cache, pos0.astype(mx.int32))
