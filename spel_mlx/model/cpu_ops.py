"""The fused CPU primitives of ``spel_mlx._spel_cpu`` as the model's ops.

The module (C++ in spel_mlx/cpu_ext/, built by setup.py against the installed
MLX) adds MLX primitives that run on the CPU stream.  On the CPU every graph
node costs microseconds of dispatch, so each residual half of a layer is one
node here (two for attention, around MLX's in-place cache update) where plain
MLX spends dozens; docs/model.md has the measurements.  MLXOps stays the
reference (tests/test_cpu_ops.py).
"""
from __future__ import annotations

import warnings

import mlx.core as mx

from ..platform import cpu_features, huge_pages
from ..platform.cpu_features import attention_helper, simd_cap
from .ops import MLXOps

try:
    from .. import _spel_cpu
    _IMPORT_ERROR = ""
    if simd_cap() not in ("auto", "avx512"):
        _spel_cpu.set_simd_level(simd_cap())
    _spel_cpu.set_helper(attention_helper())
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


def mismatch() -> str | None:
    """Why the module is built but off (another MLX runs than it was built for), else None."""
    return status()[1] if _spel_cpu is not None and not available() else None


if mismatch():     # said once, at import: decoding still works, on the plain MLX ops (slower)
    warnings.warn(f"{mismatch()}: the fused CPU primitives are off, decoding runs on the plain MLX ops",
                  RuntimeWarning, stacklevel=2)


def _weight_blocks(W, rb: int, half: bool):
    return _spel_cpu.weight_blocks(W, rb, half, huge_pages.state() == "on")


def _pos(pos0):
    return (pos0 if isinstance(pos0, mx.array) else mx.array(pos0, dtype=mx.int32)).astype(mx.int32)


class CPUFusedOps(MLXOps):
    name = "cpu-fused"
    windowed = False          # attention reads the rows each query sees, blocked over keys

    def __init__(self, half_weights: bool | None = None):
        """``half_weights`` (None: SPEL_HALF_WEIGHTS, on by default): the FMA-chain tiles
        (AVX-512, or AVX2 with FMA and F16C) read a matrix whose weights are all exactly
        binary16 from float16 blocks (the same bits as float32 blocks, half the bytes)."""
        ok, why = status()
        if not ok:
            raise RuntimeError(why)
        self.half_weights = cpu_features.half_weights() if half_weights is None else bool(half_weights)

    # --- whole residual halves: one node each, the separate primitives' kernels ---------
    def mixer_block(self, blk, x, cache):
        mix = self._blocks(x, blk.mixer.wqkv, blk.mixer.wo)
        if mix is None:
            return super().mixer_block(blk, x, cache)
        norm = blk.attn_norm
        if blk.kind == "gdn":
            g = blk.mixer.gates(x.shape[0])
            h, cache.states, cache.tails, cache.q, cache.k = _spel_cpu.gdn_block(
                x, norm.weight, cache.tail, blk.mixer.conv, mix[0], g["a"], g["b"], cache.S, mix[1],
                float(norm.eps))
            return h
        # attention: two nodes around MLX's slice_update, which writes the cache rows in
        # place (a custom node never may: its outputs would share its inputs).  Its L2
        # norm and RoPE are C++: close to the separate ops, not bit-equal.
        cos, sin = blk.mixer.rope_rows(cache.keys.shape[0])
        pos = _pos(cache.pos)
        q, k, v = _spel_cpu.attn_qkv(x, norm.weight, mix[0], pos, cos, sin, cache.keys.shape[1], float(norm.eps))
        cache.write(k, v)
        return _spel_cpu.attn_out(x, q, cache.keys, cache.values, pos, mix[1])

    def ffn_block(self, blk, h):
        mlp = self._blocks(h, blk.mlp.w1, blk.mlp.w3, blk.mlp.w2)
        if mlp is None:
            return super().ffn_block(blk, h)
        return _spel_cpu.ffn_block(h, blk.ffn_norm.weight, *mlp, float(blk.ffn_norm.eps))

    def pass_plan(self, model, layers: list, M: int):
        """The whole pass as ``_spel_cpu.PassPlan``: the nodes mixer_block and ffn_block
        build, made by one C++ call (faster than replaying their compiled trace);
        None where a weight has no warm blocks for M rows (the traced pass then runs)."""
        rows = self.layout_rows(M)
        plan = []
        for blk in layers:
            mix = [blk.mixer.wqkv.blocks(rows), blk.mixer.wo.blocks(rows)]
            mlp = [lin.blocks(rows) for lin in (blk.mlp.w1, blk.mlp.w3, blk.mlp.w2)]
            if any(b is None for b in mix + mlp):
                return None
            if blk.kind == "gdn":
                g = blk.mixer.gates(M)
                mixer = [blk.attn_norm.weight, blk.mixer.conv, mix[0], g["a"], g["b"], mix[1]]
            else:      # the plan captures the table once: for all of max_seq, where that is small
                if blk.mixer.rope_all() is None:
                    return None
                mixer = [blk.attn_norm.weight, mix[0], *blk.mixer.rope_all(), mix[1]]
            plan.append(_spel_cpu.PlanLayer(blk.kind == "gdn", float(blk.attn_norm.eps), float(blk.ffn_norm.eps),
                                            mixer + [blk.ffn_norm.weight] + mlp))
        head, eps = [], 0.0
        if model.lm_head is not None:      # None: a pipeline stage before the last
            lm = model.lm_head.blocks(rows)
            if lm is None:
                return None
            head, eps = [model.final_norm.weight, lm], float(model.final_norm.eps)
        emb = getattr(model, "tok_emb", None)     # absent: a pipeline stage after the first
        return _spel_cpu.PassPlan(None if emb is None else emb.weight, plan, head, eps)

    host_token_inputs = True

    def host_tokens(self, n: int):
        return _spel_cpu.HostTokens(n)

    @staticmethod
    def layout_rows(M: int) -> int:
        """The batch size whose weight layout an M-row product reads: the tiles
        read every M best from the 64-row blocks of small batches (the 32-row blocks
        suit the BLAS, docs/model.md); one layout also keeps one copy of the weights."""
        return min(M, 5) if _spel_cpu.fma_chain_linear() else M

    @classmethod
    def _blocks(cls, x, *lins):
        """The warm [nb, in, rb] blocks of each Linear for x's rows, or None."""
        if x.ndim != 2:
            return None
        rows = cls.layout_rows(x.shape[0])
        blocks = [lin.blocks(rows) for lin in lins]
        return None if any(b is None for b in blocks) else blocks

    # --- single primitives ---------------------------------------------------------------
    def prepare_linear(self, lin, M: int) -> None:
        # blocks on cache lines, made in one pass; binary16 only for the tiles (the BLAS
        # would widen them per call)
        lin.warm(self.layout_rows(M), blocks=True, build=_weight_blocks,
                 half=self.half_weights and bool(_spel_cpu.fma_chain_linear()), half_test=_spel_cpu.exactly_half)

    def linear(self, x, lin):
        blocks = self._blocks(x, lin)
        return lin(x) if blocks is None else _spel_cpu.linear(x, blocks[0])

    def rms_norm(self, x, weight, eps: float):
        return _spel_cpu.rms_norm(x, weight, float(eps))

    def silu_mul(self, a, b):
        return _spel_cpu.silu_mul(a, b)

    def rows_independent(self) -> bool:
        # every kernel works row by row; the products are one FMA chain per element
        # only with the tiles (AVX-512, or AVX2 with FMA)
        return bool(_spel_cpu.fma_chain_linear()) and mx.default_device() == mx.cpu

    def conv_step(self, x, tail, conv):
        return _spel_cpu.conv(x, tail, conv)

    def gdn_delta(self, qkv, a, beta, S0, gates=None):
        """The q/k L2 norm and the delta rule in one node; states stacked."""
        return _spel_cpu.gdn_delta(qkv, a, beta, S0)

    def delta_rule(self, q, k, v, a, beta, S0, gates=None):
        return _spel_cpu.delta(q, k, v, a, beta, S0)

    def attend(self, q, k_cache, v_cache, pos0, M):
        return _spel_cpu.attend(q, k_cache, v_cache, _pos(pos0))
