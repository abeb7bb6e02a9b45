"""The layers of SPEC 2: RMSNorm, MLP, GatedDeltaNet, Attention, Block.

Each mixer runs in two forms: a decoding pass over M rows [M, d] with its layer's
cache (``passes.GDNCache`` / ``passes.KVCache``), and a whole batch [B, T, d]
from the zero state with ``cache=None`` (training).  Everything an ops backend
may replace goes through ``ops`` (``ops.MLXOps`` is the interface).
"""
from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from ..config import ModelConfig
from ..layout import DRAFT_MIXER_QUANT, DRAFT_MLP_QUANT
from .delta_rule import chunk_gates
from .functional import ROPE_ALL_ROWS, l2_normalize, rope_table
from .linear import Linear


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = mx.ones((d,))
        self.eps = eps

    def __call__(self, x):
        return mx.fast.rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) * (w3 x))."""

    def __init__(self, d: int, ff: int, quant: str | None = None):
        super().__init__()
        self.w1 = Linear(d, ff, quant)
        self.w3 = Linear(d, ff, quant)
        self.w2 = Linear(ff, d, quant)

    def __call__(self, x, ops):
        return ops.linear(ops.silu_mul(ops.linear(x, self.w1), ops.linear(x, self.w3)), self.w2)


class GatedDeltaNet(nn.Module):
    """Short conv -> qkv -> L2 norm -> gated delta rule -> wo (SPEC 2)."""

    kind = "gdn"

    def __init__(self, cfg: ModelConfig, quant: str | None = None):
        super().__init__()
        d, H = cfg.d_model, cfg.n_heads
        self.n_heads, self.head_dim = H, cfg.head_dim
        self.conv = mx.zeros((3, d))
        self.wqkv = Linear(d, 3 * cfg.inner, quant)
        self.wo = Linear(cfg.inner, d, quant)
        self.decay_logit = mx.zeros((H,))
        self.beta_logit = mx.zeros((H,))

    def gates(self, M: int) -> dict:
        """a = sigmoid(decay_logit), b = sigmoid(beta_logit) [H] and, for M > 1,
        chunk_gates(a, M) under "chunk": evaluated once per weights and M, so a
        compiled pass captures them as constants.  Rebuilt when ``update``
        replaces the logits (the cache holds the arrays it was built from)."""
        cache = self.__dict__.get("_gates")
        if cache is None or cache[0] is not self.decay_logit or cache[1] is not self.beta_logit:
            a, b = mx.sigmoid(self.decay_logit), mx.sigmoid(self.beta_logit)
            mx.eval(a, b)
            cache = (self.decay_logit, self.beta_logit, {"a": a, "b": b})
            object.__setattr__(self, "_gates", cache)
        g = cache[2]
        if M > 1 and M not in g:
            g[M] = chunk_gates(g["a"], M)
            mx.eval(g[M])
        return {"a": g["a"], "b": g["b"], "chunk": g.get(M)}

    def __call__(self, x, cache, ops):
        """x [..., T, d] normed input.  A decoding pass reads the state before row 0
        from ``cache`` and leaves there the states and conv tails after each row
        and the unit q, k; ``cache=None`` starts from zeros (training)."""
        if cache is None:       # training: zero state, and the gates follow the parameters
            a, beta, gates = mx.sigmoid(self.decay_logit), mx.sigmoid(self.beta_logit), None
            tail = S0 = None
        else:
            g = self.gates(x.shape[-2])
            a, beta, gates = g["a"], g["b"], g["chunk"]
            tail, S0 = cache.tail, cache.S
        u, tails = ops.conv_step(x, tail, self.conv)
        o, states, q, k = ops.gdn_delta(ops.linear(u, self.wqkv), a, beta, S0, gates)
        if cache is not None:
            cache.states, cache.tails, cache.q, cache.k = states, tails, q, k
        return ops.linear(o.reshape(*x.shape[:-1], -1), self.wo)


class Attention(nn.Module):
    """Causal attention with unit q/k, interleaved RoPE, scale sqrt(hd) (SPEC 2)."""

    kind = "attn"

    def __init__(self, cfg: ModelConfig, quant: str | None = None):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.rope_theta, self.max_seq = cfg.rope_theta, cfg.max_seq
        self.wqkv = Linear(cfg.d_model, 3 * cfg.inner, quant)
        self.wo = Linear(cfg.inner, cfg.d_model, quant)

    def rope_rows(self, rows: int):
        """The RoPE table (cos, sin) for positions 0..rows-1: a decoding pass asks for its
        KV caches' rows, so the table grows with the positions used, as they do."""
        return rope_table(min(rows, self.max_seq), self.head_dim, self.rope_theta)

    def rope_all(self):
        """The table for every position to max_seq, for a pass that captures it once;
        None where that would be large (ROPE_ALL_ROWS)."""
        return self.rope_rows(self.max_seq) if self.max_seq <= ROPE_ALL_ROWS else None

    def rope(self, x, offset, rows: int):
        """x [M,n,H,hd], row j at position offset+j (offset: int or int32 array) < rows:
        pairs (2i, 2i+1) rotated with cos/sin rows of the float64-built table."""
        M, hd = x.shape[0], self.head_dim
        cos, sin = self.rope_rows(rows)
        if isinstance(offset, int):
            c, s = cos[offset:offset + M], sin[offset:offset + M]
        else:
            c = mx.slice(cos, offset, (0,), (M, hd // 2))
            s = mx.slice(sin, offset, (0,), (M, hd // 2))
        c, s = c.reshape(M, 1, 1, hd // 2, 1), s.reshape(M, 1, 1, hd // 2, 1)
        pairs = x.reshape(*x.shape[:-1], hd // 2, 2)
        x0, x1 = pairs[..., 0:1], pairs[..., 1:2]
        return mx.concatenate([x0 * c - x1 * s, x1 * c + x0 * s], axis=-1).reshape(x.shape)

    def __call__(self, x, cache, ops):
        """x [..., T, d] normed input.  A decoding pass writes this batch's rotated k
        and v into ``cache`` at its position and attends over its window;
        ``cache=None`` attends causally within the batch from position 0 (training)."""
        *lead, T, _ = x.shape
        H, hd = self.n_heads, self.head_dim
        qkv = ops.linear(x, self.wqkv).reshape(*lead, T, 3, H, hd)
        if cache is None:
            o = self._causal(qkv, ops)
        else:
            qk = self.rope(l2_normalize(qkv[:, 0:2]), cache.pos, cache.keys.shape[0])
            q, k, v = (t.reshape(T, H, hd) for t in (qk[:, 0:1], qk[:, 1:2], qkv[:, 2:3]))
            keys, values = cache.update_and_fetch(k, v)
            o = ops.attend(q, keys, values, cache.pos, T)
        return ops.linear(o.reshape(*lead, T, -1), self.wo)

    def _causal(self, qkv, ops):
        """[B, T, 3, H, hd] -> [B, T, H, hd] with MLX's fused RoPE, positions 0..T-1
        (short, so float32 angles are exact enough), and the ops' causal attention."""
        hd = self.head_dim
        q, k, v = (mx.swapaxes(qkv[:, :, i], 1, 2) for i in range(3))     # [B, H, T, hd]
        q, k = (mx.fast.rope(l2_normalize(t), hd, traditional=True, base=self.rope_theta, scale=1.0, offset=0)
                for t in (q, k))
        return mx.swapaxes(ops.causal_attention(q, k, v, math.sqrt(hd)), 1, 2)


class Block(nn.Module):
    """One layer (SPEC 2):  h = x + mixer(rmsnorm(x, attn_norm)),
    x' = h + w2(silu(w1 hn) * (w3 hn)),  hn = rmsnorm(h, ffn_norm)."""

    def __init__(self, cfg: ModelConfig, kind: str, draft: bool = False):
        super().__init__()
        self.kind = kind
        mixer = GatedDeltaNet if kind == "gdn" else Attention
        # SPEC 2: the draft's projections are q8, its MLP ternary (layout's one list)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = mixer(cfg, DRAFT_MIXER_QUANT if draft else None)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg.d_model, cfg.d_ff, DRAFT_MLP_QUANT if draft else None)

    def __call__(self, x, cache, ops):
        # each residual half is one ops call, which a backend may run as one node
        return ops.ffn_block(self, ops.mixer_block(self, x, cache))

    def linears(self) -> list:
        return [self.mixer.wqkv, self.mixer.wo, self.mlp.w1, self.mlp.w3, self.mlp.w2]


class DraftStack(nn.Module):
    """The draft's own layers (``draft.layers.{j}``); embedding/norm/head are shared."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = [Block(cfg, cfg.layer_kind(i), draft=True) for i in cfg.draft_map]
