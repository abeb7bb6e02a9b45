"""The ops interface: every computation of a decoding pass that a backend may replace.

``MLXOps`` is the interface and its plain-MLX implementation.  The fused CPU
primitives (``cpu_ops.CPUFusedOps``), the Metal kernels (``metal_ops``) and the
training forward's ops (``training_ops.TrainingOps``) subclass it and override what
they implement; the layers call only these methods.  Arrays are float32 and
token-major: x [M, d], q/k/v [M, H, hd] (training adds a leading batch axis).
Methods must work inside ``mx.compile`` unless ``requires_eager`` is True.
"""
from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from .delta_rule import delta_rule_chunked, delta_rule_recurrent
from .functional import as_float32, l2_normalize, silu_mul, softmax_visible

# widest cache window MLXOps.attend reads head-major for M > 1 (docs/model.md)
ATTEND_HEAD_MAJOR_MAX = 1024


class MLXOps:
    name = "mlx-ops"
    requires_eager = False     # True: reads arrays on the host, so passes run uncompiled
    # True: attend gets the cache's first passes.window(n) rows (its cost grows with the
    # rows it gets); False: the whole cache, of which it reads only the rows a query
    # sees, so one compiled pass serves every context length
    windowed = True

    # --- the two residual halves of a layer (SPEC 2) -------------------------------
    def mixer_block(self, blk, x, cache):
        """x + mixer(rmsnorm(x, attn_norm)); the mixer reads and updates ``cache``."""
        return x + blk.mixer(self.rms_norm(x, blk.attn_norm.weight, blk.attn_norm.eps), cache, self)

    def ffn_block(self, blk, h):
        """h + w2(silu(w1 hn) * (w3 hn)), hn = rmsnorm(h, ffn_norm)."""
        return h + blk.mlp(self.rms_norm(h, blk.ffn_norm.weight, blk.ffn_norm.eps), self)

    def pass_plan(self, model, layers: list, M: int):
        """A whole M-row pass over ``layers`` built by the backend in one call, with the
        signature and outputs of ``passes.make_pass``'s function; None (here): the layers
        run through these methods, traced once by ``mx.compile``."""
        return None

    host_token_inputs = False   # whether host_tokens gives them

    def host_tokens(self, n: int):
        """An object with ``array`` (int32 [n], a graph input) and ``set(ids)`` (once,
        before the graph is evaluated): a pass built on tokens not yet chosen.  None
        (here): the backend has no such input."""
        return None

    # --- projections, norms, gate --------------------------------------------------
    def prepare_linear(self, lin, M: int) -> None:
        """Build, outside any trace, the weight layout an M-row ``linear`` reads."""
        lin.warm(M)

    def linear(self, x, lin):
        return lin(x)

    def rms_norm(self, x, weight, eps: float):
        return mx.fast.rms_norm(x, weight, eps)

    def silu_mul(self, a, b):
        return silu_mul(a, b)

    def rows_independent(self) -> bool:
        """True when every op gives a row the same bits whatever the row count, for
        weights in whole 16-column blocks (then strict batches may run as one pass)."""
        return False

    # --- Gated DeltaNet ------------------------------------------------------------
    def conv_step(self, x, tail, conv):
        """Causal 3-tap depthwise conv + SiLU over T new rows (SPEC 2 step 1).

        x [..., T, d] (normed input), tail [..., 2, d] (the two inputs before x[0],
        None: zeros), conv [3, d].  Returns u [..., T, d] and tails [..., T, 2, d],
        tails[j] = (x_{j-1}, x_j), the conv state after row j."""
        T, d = x.shape[-2:]
        if tail is None:
            tail = mx.zeros((*x.shape[:-2], 2, d), x.dtype)
        xs = mx.concatenate([tail, x], axis=-2)
        # slices, not integer indexing: fewer graph nodes in the hot step
        pre = (conv[0:1] * xs[..., 0:T, :] + conv[1:2] * xs[..., 1:T + 1, :]
               + conv[2:3] * xs[..., 2:T + 2, :])
        if T == 1:
            tails = xs[..., 1:3, :].reshape(*x.shape[:-2], 1, 2, d)
        else:
            tails = mx.stack([xs[..., 1:T + 1, :], xs[..., 2:T + 2, :]], axis=-2)
        return self.silu(pre), tails

    def silu(self, x):
        return nn.silu(x)

    def gdn_delta(self, qkv, a, beta, S0, gates=None):
        """Unit q, k and v from the wqkv projection [..., T, 3*H*hd], then the delta
        rule.  Returns o [..., T, H, hd], the states (as delta_rule), q, k."""
        *lead, T, n = qkv.shape
        H = a.shape[0]
        shape = (*lead, T, H, n // (3 * H))
        qkv = qkv.reshape(*lead, T, 3, *shape[-2:])
        qk = l2_normalize(qkv[..., 0:2, :, :])                # q and k in one pass
        q, k, v = (t.reshape(shape) for t in (qk[..., 0:1, :, :], qk[..., 1:2, :, :], qkv[..., 2:3, :, :]))
        o, states = self.delta_rule(q, k, v, a, beta, S0, gates)
        return o, states, q, k

    def delta_rule(self, q, k, v, a, beta, S0, gates=None):
        """SPEC 2 step 5 over M tokens from S0 [H, hd, hd].  Returns o [M, H, hd]
        (already / sqrt(hd)) and the M states after each token: a list of [H, hd, hd]
        or one [M, H, hd, hd] array.  ``gates``: chunk_gates(a, M), precomputed."""
        if q.shape[-3] == 1:
            return delta_rule_recurrent(q, k, v, a, beta, S0)
        return delta_rule_chunked(q, k, v, a, beta, S0, chunk=q.shape[-3], gates=gates, all_states=True)

    # --- attention -------------------------------------------------------------------
    def causal_attention(self, q, k, v, scale: float):
        """Causal softmax attention within a batch from position 0 (training): q, k, v
        [B, H, T, hd] (rotated), logits scale * q.k.  Returns [B, H, T, hd]."""
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")

    def attend(self, q, k_cache, v_cache, pos0, M):
        """Causal softmax attention of M queries against a KV cache window.

        q [M,H,hd] (rotated unit vectors); k_cache/v_cache [W,H,hd], the first W
        cache rows (W >= pos0+M) with this batch's k/v already written at pos0...
        Query j sees positions <= pos0+j.  pos0: int or int32 scalar array.  Score
        scale sqrt(hd) (SPEC 2).  Returns [M,H,hd].  A float16 cache is widened first."""
        k_cache, v_cache = as_float32(k_cache), as_float32(v_cache)
        W, H, hd = k_cache.shape
        if M > 1 and W <= ATTEND_HEAD_MAJOR_MAX:
            return self._attend_head_major(q, k_cache, v_cache, pos0, M)
        # every query meets every head of the cache read as one contiguous matrix, and
        # the head-matched diagonal is picked out: cheaper than copying the window
        R = k_cache.reshape(W * H, hd) @ q.reshape(M * H, hd).T        # [(w,h), (j,h')]
        if M == 1:
            s = R.reshape(W, H * H)[:, ::H + 1]                           # h == h': [W,H]
            s = mx.where(mx.arange(W)[:, None] <= pos0, s * math.sqrt(hd), -mx.inf)
            p = mx.softmax(s, axis=0)                                     # [W,H]
            r = p.T @ v_cache.reshape(W, H * hd)                          # [h, (h',d)]
            return r.reshape(H * H, hd)[::H + 1].reshape(1, H, hd)
        # the h == h' entries as strided views of the contiguous products:
        # R[(w,h),(j,h)] at w*H*M*H + h*(M*H+1) + j*H, r[(j,h),(h,d)] at j*H*H*hd + h*(H*hd+hd) + d
        s = mx.as_strided(R, (W, H, M), (H * M * H, M * H + 1, H))        # [W,H,M]
        visible = mx.arange(W)[:, None, None] <= (mx.arange(M) + pos0)[None, None, :]
        p = softmax_visible(s * math.sqrt(hd), visible, 0, W * M)
        r = p.transpose(2, 1, 0).reshape(M * H, W) @ v_cache.reshape(W, H * hd)
        return mx.as_strided(r, (M, H, hd), (H * H * hd, H * hd + hd, 1))

    def _attend_head_major(self, q, k_cache, v_cache, pos0, M):
        """Per-head products over strided views of the cache: fewer ops for several
        queries over a short window (ATTEND_HEAD_MAJOR_MAX)."""
        W, H, hd = k_cache.shape
        s = q.transpose(1, 0, 2) @ k_cache.transpose(1, 2, 0)              # [H,M,W]
        visible = mx.arange(W)[None, :] <= (mx.arange(M) + pos0)[:, None]  # [M,W]
        p = softmax_visible(s * math.sqrt(hd), visible, -1, W * M)
        return (p @ v_cache.transpose(1, 0, 2)).transpose(1, 0, 2)         # [M,H,hd]
