"""The hybrid Gated-DeltaNet + RoPE-attention model of SPEC 2, in MLX.

Modules read top to bottom: RMSNorm, GatedDeltaNet, Attention, MLP, Block,
SpelModel.  Parameter paths are exactly the names of ``spel_mlx.layout``
(``layers.{i}.``, ``draft.layers.{j}.``), so a weights dict loads as is.

The decoding state (KV caches, GDN rings) lives in ``spel_mlx.state``; the model
only reads the committed/pending slot and writes new slots.  Three sequence
primitives (short conv, delta rule, causal attention) go through a replaceable
``ops`` object (``auto_ops()``: the fused CPU primitives of ``spel_mlx.cpu_ops``
on the CPU when built, else ``MLXOps``; Metal kernels in ``spel_mlx.kernels``),
as may, optionally, the linears, norms and SwiGLU gate.

Every forward is ONE ``mx.compile``d pass of a whole stack over M rows,
compiled per (stack, M, attention window).  A single-token forward is the M=1
pass and a strict forward runs the M=1 pass row by row, which makes strict
batches bit-identical to sequential decoding by construction; a fast forward
is one M-row pass with GEMM projections.  See docs/model.md.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from . import layout
from .config import ModelConfig
from .state import DecodeState, StateError

import mlx.core as mx  # noqa: E402  (after spel_mlx: the BLAS is loaded)
import mlx.nn as nn  # noqa: E402

L2_EPS = 1e-6  # inside the square root: x / sqrt(sum x^2 + eps)  (SPEC 2: "eps inside the norm")
MIN_WINDOW = 64  # smallest attention window of a pass (see _window)


def l2_normalize(x: mx.array) -> mx.array:
    return x * mx.rsqrt(mx.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


# ---------------------------------------------------------------------------
# Replaceable sequence primitives
# ---------------------------------------------------------------------------
class MLXOps:
    """Default sequence primitives in plain MLX ops.

    A replacement (e.g. Metal kernels) subclasses this and overrides any
    method; shapes and meaning must stay the same.  All arrays are float32.
    """

    name = "mlx-ops"

    def conv_step(self, x, tail, conv):
        """Causal 3-tap depthwise conv + SiLU over M new rows.

        x [M,d] (normed input), tail [2,d] (the two inputs before x[0]),
        conv [3,d].  Returns u [M,d] = silu(conv0*x_{t-2} + conv1*x_{t-1} +
        conv2*x_t) and tails [M,2,d], tails[j] = (x_{j-1}, x_j), the conv
        state after row j.
        """
        M, d = x.shape
        xs = mx.concatenate([tail, x], axis=0)  # [M+2, d]
        # slices, not integer indexing: fewer graph nodes in the hot step
        pre = conv[0:1] * xs[0:M] + conv[1:2] * xs[1:M + 1] + conv[2:3] * xs[2:M + 2]
        if M == 1:
            tails = xs[1:3].reshape(1, 2, d)
        else:
            tails = mx.stack([xs[1:M + 1], xs[2:M + 2]], axis=1)
        return nn.silu(pre), tails

    def delta_rule(self, q, k, v, a, beta, S0):
        """Gated delta rule over M tokens.

        q, k, v [M,H,hd] (q, k already L2-normalized), a, beta [H] (already
        sigmoided), S0 [H,hd,hd] (rows index v, columns index k).
        S_t = a*S_{t-1} + beta*(v_t - S_{t-1} k_t) k_t^T,  o_t = S_t q_t / sqrt(hd).
        Returns o [M,H,hd] and S_all [M,H,hd,hd] (S after each token).

        One token runs the recurrence (the AR step and strict rows); several
        run the chunked closed form (see ``_delta_chunk``), ~20 ops for any M.
        """
        M, H, hd = q.shape
        if M == 1:
            return self.delta_rule_loop(q, k, v, a, beta, S0)
        o, u, kh, decay, s0_coef = self._delta_chunk(q, k, v, a, beta, S0)
        outer = (u.reshape(H, M, hd, 1) * kh.reshape(H, M, 1, hd)).reshape(H, M, hd * hd)
        S_all = mx.addmm(s0_coef * S0.reshape(H, 1, hd * hd), decay, outer)
        return o, S_all.reshape(H, M, hd, hd).transpose(1, 0, 2, 3)

    def delta_rule_states(self, q, k, v, a, beta, S0, gates=None):
        """delta_rule with the states as a list [S_0 .. S_{M-1}] of [H,hd,hd].

        What the model's pass uses: for M > 1 each state is its own small
        product, so a state nobody evaluates (a rejected token's; the pass
        leaves the ring slots lazy) is never computed.  ``gates``: the
        ``chunk_gates(a, beta, M, hd)`` arrays, precomputed once per weights.
        """
        M, H, hd = q.shape
        if M == 1 or type(self).delta_rule is not MLXOps.delta_rule:
            # one token, or a subclass replaced delta_rule: its states, row by row
            o, S_all = self.delta_rule(q, k, v, a, beta, S0)
            return o, _rows(S_all, M)
        o, u, kh, decay, s0_coef = self._delta_chunk(q, k, v, a, beta, S0, gates)
        uT = u.transpose(0, 2, 1)                                           # [H,hd,M]
        states = [mx.addmm(s0_coef[:, j:j + 1] * S0, uT * decay[:, j:j + 1], kh)
                  for j in range(M)]
        return o, states

    def _delta_chunk(self, q, k, v, a, beta, S0, gates=None):
        """The delta rule over M > 1 tokens in closed form.

        With u_j = beta (v_j - S_{j-1} k_j), S_j = a S_{j-1} + u_j k_j^T
        unrolls to S_j = a^(j+1) S0 + sum_{i<=j} a^(j-i) u_i k_i^T, so the u's
        solve the unit lower-triangular system
            u_j + beta sum_{i<j} a^(j-1-i) (k_i.k_j) u_i = beta (v_j - a^j S0 k_j),
        and o_j = a^(j+1) S0 q_j + sum_{i<=j} a^(j-i) (k_i.q_j) u_i.
        (I + N)^-1 for the nilpotent N is (I - N)(I + N^2)(I + N^4)...: log2(M)
        small matmuls instead of M sequential steps.  Agrees with the loop to
        ~5e-7 (decays a^(j-i) <= 1 only, no division by powers of a).

        Returns o [M,H,hd] (already / sqrt(hd)), u [H,M,hd], k [H,M,hd],
        decay [H,M,M] (a^(j-i), 0 above the diagonal), a^(j+1) [H,M,1].
        """
        M, H, hd = q.shape
        g = chunk_gates(a, beta, M, hd) if gates is None else gates
        qh, kh, vh = (x.transpose(1, 0, 2) for x in (q, k, v))             # [H,M,hd]
        kq = mx.concatenate([kh, qh], axis=1)                               # [H,2M,hd]
        dots = kq @ kh.transpose(0, 2, 1)                                   # k_j.k_i ; q_j.k_i
        s0x = kq @ S0.transpose(0, 2, 1)                                    # (S0 k_j) ; (S0 q_j)
        N = g["n_coef"] * dots[:, :M]
        rhs = g["beta"] * (vh - g["a_j"] * s0x[:, :M])
        u = mx.addmm(rhs, N, rhs, alpha=-1.0)                               # (I - N) rhs
        span, P = 2, None
        while span < M:
            P = N @ N if P is None else P @ P                               # N^span
            u = mx.addmm(u, P, u)
            span *= 2
        o = mx.addmm(g["o_coef"] * s0x[:, M:], g["o_decay"] * dots[:, M:], u)
        return o.transpose(1, 0, 2), u, kh, g["decay"], g["s0_coef"]

    def delta_rule_loop(self, q, k, v, a, beta, S0):
        """The delta rule one token at a time (same contract as delta_rule)."""
        M, H, hd = q.shape
        a3 = a.reshape(H, 1, 1)
        b3 = beta.reshape(H, 1, 1)
        S = S0
        outs, states = [], []
        for t in range(M):
            kt = k[t:t + 1].reshape(H, hd, 1)                 # column k_t
            err = b3 * (v[t:t + 1].reshape(H, hd, 1) - S @ kt)  # beta (v - S k)   [H,hd,1]
            S = a3 * S + err * kt.reshape(H, 1, hd)            # + outer(err, k)
            outs.append(S @ q[t:t + 1].reshape(H, hd, 1))
            states.append(S)
        if M == 1:
            return outs[0].reshape(1, H, hd) * (1.0 / math.sqrt(hd)), S.reshape(1, H, hd, hd)
        o = mx.concatenate(outs, axis=2).transpose(2, 0, 1) * (1.0 / math.sqrt(hd))
        return o, mx.stack(states)

    def rms_norm(self, x, weight, eps: float):
        """RMSNorm of the rows of x [M,d] (SPEC 2)."""
        return mx.fast.rms_norm(x, weight, eps)

    def silu_mul(self, a, b):
        """The SwiGLU gate silu(a) * b (see the module function silu_mul)."""
        return silu_mul(a, b)

    def attend(self, q, k_cache, v_cache, pos0, M):
        """Causal softmax attention of M queries against a KV cache window.

        q [M,H,hd] (rotated, unit vectors); k_cache/v_cache [W,H,hd], the
        first W cache rows (W >= pos0+M) with this batch's k/v already written
        at pos0..pos0+M-1.  Query j sees positions <= pos0+j; rows past that
        are stale and masked.  pos0 is an int or an int32 scalar array (inside
        the compiled pass).  Score scale sqrt(hd) (SPEC 2).  Returns [M,H,hd].

        The cache is read as a contiguous [W*H, hd] / [W, H*hd] matrix and every
        query meets every head (H times the FLOPs, a few MFLOP); the head-matched
        diagonal is then picked out.  This avoids transposing (copying) the
        cache window, which dominated long-context decoding.
        """
        W, H, hd = k_cache.shape
        if M > 1 and W <= ATTEND_HEAD_MAJOR_MAX:
            return self._attend_head_major(q, k_cache, v_cache, pos0, M)
        R = k_cache.reshape(W * H, hd) @ q.reshape(M * H, hd).T        # [(w,h), (j,h')]
        if M == 1:
            s = R.reshape(W, H * H)[:, ::H + 1]                           # h == h': [W,H]
            s = mx.where(mx.arange(W)[:, None] <= pos0, s * math.sqrt(hd), -mx.inf)
            p = mx.softmax(s, axis=0)                                     # [W,H]
            r = p.T @ v_cache.reshape(W, H * hd)                          # [h, (h',d)]
            return r.reshape(H * H, hd)[::H + 1].reshape(1, H, hd)
        # the h == h' entries as strided views of the (contiguous) matmul
        # outputs: R[(w,h),(j,h)] sits at w*H*M*H + h*(M*H+1) + j*H, and
        # r[(j,h),(h,d)] at j*H*H*hd + h*(H*hd+hd) + d (~15% faster at 4k rows
        # than multiplying by an identity and summing, same values)
        s = mx.as_strided(R, (W, H, M), (H * M * H, M * H + 1, H))        # [W,H,M]
        visible = mx.arange(W)[:, None, None] <= (mx.arange(M) + pos0)[None, None, :]
        p = _softmax_visible(s * math.sqrt(hd), visible, 0, W * M)
        r = p.transpose(2, 1, 0).reshape(M * H, W) @ v_cache.reshape(W, H * hd)
        return mx.as_strided(r, (M, H, hd), (H * H * hd, H * hd + hd, 1))

    def _attend_head_major(self, q, k_cache, v_cache, pos0, M):
        """attend for several queries over a short window: per-head matmuls
        reading the cache through strided views (BLAS transposes, no copy
        measured), ~2x fewer ops and FLOPs than the all-heads form for M > 1;
        past ~1k rows the strided reads lose (ATTEND_HEAD_MAJOR_MAX)."""
        W, H, hd = k_cache.shape
        s = q.transpose(1, 0, 2) @ k_cache.transpose(1, 2, 0)              # [H,M,W]
        visible = mx.arange(W)[None, :] <= (mx.arange(M) + pos0)[:, None]  # [M,W]
        p = _softmax_visible(s * math.sqrt(hd), visible, -1, W * M)
        return (p @ v_cache.transpose(1, 0, 2)).transpose(1, 0, 2)         # [M,H,hd]


DEFAULT_OPS = MLXOps()


def auto_ops():
    """The ops a new model starts with: on the CPU device the fused CPU primitives
    (``spel_mlx.cpu_ops``) when they are built for this MLX and SPEL_KERNELS is
    unset, "auto" or "cpu"; else the plain MLX ops (Metal kernels are chosen
    explicitly, through ``spel_mlx.kernels.select``)."""
    import os
    if os.environ.get("SPEL_KERNELS", "auto").strip().lower() in ("auto", "cpu", "") \
            and mx.default_device() == mx.cpu:
        from . import cpu_ops
        if cpu_ops.available():
            return cpu_ops.CPUFusedOps()
    return DEFAULT_OPS


# widest cache window MLXOps.attend reads head-major for M > 1 (see _attend_head_major;
# 21m, M=5: 0.10 vs 0.18 ms at W=128, 0.8 vs 1.1 ms at 1024, 8.1 vs 4.6 ms at 4096)
ATTEND_HEAD_MAJOR_MAX = 1024


def chunk_gates(a, beta, M: int, hd: int) -> dict:
    """The gate-only factors of the chunked delta rule for M tokens (a, beta [H]).

    decay [H,M,M] = a^(j-i) for i <= j else 0; n_coef = beta a^(j-1-i) for
    i < j else 0; a_j [H,M,1] = a^j; s0_coef = a^(j+1); o_coef and o_decay =
    s0_coef and decay / sqrt(hd); beta [H,1,1].  They depend on the weights
    only, so the model computes them once per (weights, M), not per pass.
    """
    H = a.shape[0]
    j = np.arange(M)
    lag = mx.array((j[:, None] - j[None, :]).astype(np.float32))          # j - i
    la = mx.log(a).reshape(H, 1, 1)
    a3, b3 = a.reshape(H, 1, 1), beta.reshape(H, 1, 1)
    decay = mx.where(lag >= 0, mx.exp(la * lag), 0.0)
    a_j = mx.exp(la * mx.array(j.astype(np.float32)).reshape(1, M, 1))
    scale = 1.0 / math.sqrt(hd)
    return {"decay": decay, "n_coef": mx.where(lag >= 1, (b3 / a3) * decay, 0.0),
            "a_j": a_j, "s0_coef": a3 * a_j, "o_coef": (scale * a3) * a_j,
            "o_decay": scale * decay, "beta": b3}


@functools.lru_cache(maxsize=8)
def rope_table(max_seq: int, head_dim: int, theta: float):
    """(cos, sin) [max_seq, hd/2] of pos * theta^(-2i/hd), computed in float64."""
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.arange(max_seq, dtype=np.float64)[:, None] * inv[None, :]
    return mx.array(np.cos(ang).astype(np.float32)), mx.array(np.sin(ang).astype(np.float32))


# ---------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------
class Linear(nn.Module):
    """y = x W^T with W stored [out, in] (SPEC 2), no bias.

    On the CPU a compiled pass multiplies by a private copy of W laid out for
    the BLAS: blocks of 32-64 output rows, each block stored transposed and
    contiguous ([nb, in, rb], one batched matmul node).  MLX hands OpenBLAS a
    strided W^T as a transposed operand, which it re-packs on every call:
    x @ W.T for 2-16 rows ran 4-6x slower than for one row (a 768x256 weight,
    5 rows: 133 us vs 35 us contiguous).  Blocks keep each packed panel and
    its result in L2.  Blocking changes only which rows one BLAS call sees,
    so the M=1 pass stays the same function for single steps and strict rows.
    """

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        scale = 1.0 / math.sqrt(d_in)
        self.weight = mx.random.uniform(-scale, scale, (d_out, d_in))

    def __call__(self, x, ops=None):
        W = self.weight
        M = x.shape[0] if x.ndim == 2 else 0
        rb = _row_block(W.shape[0], W.shape[1], M) if M else None
        if M and hasattr(ops, "linear"):
            blocks = self.__dict__.get("_views", (None, {}))[1].get(("3d", rb))
            if blocks is not None and self._views[0] is self.weight:
                return ops.linear(x, blocks)                              # one fused node
        if rb is None:
            return x @ self.weight_view(None)
        y = x @ self.weight_view(rb)                                     # [nb, M, rb]
        return y.reshape(1, -1) if M == 1 else y.transpose(1, 0, 2).reshape(M, -1)

    def weight_view(self, rb, warm: bool = False):
        """W^T (rb None) or W as row blocks [nb, in, rb].  Traced (``warm``
        False): strided views of the weight, differentiable.  ``warm`` (outside
        any trace: the model warms every pass's layout before compiling it):
        on the CPU a contiguous copy, evaluated and kept, so a compiled pass
        captures it as a constant.  Dropped when ``update`` replaces W (the
        cache holds the array it was built from)."""
        cache = self.__dict__.get("_views")
        if cache is None or cache[0] is not self.weight:
            cache = (self.weight, {})
            object.__setattr__(self, "_views", cache)
        view = cache[1].get(rb)
        if view is None:
            W = self.weight
            view = W.T if rb is None else W.reshape(W.shape[0] // rb, rb, W.shape[1]).transpose(0, 2, 1)
            if warm:
                if mx.default_device() == mx.cpu:
                    view = mx.contiguous(view)
                mx.eval(view)
                cache[1][rb] = view
        return view

    def blocks(self, M: int):
        """The warm [nb, in, rb] blocks an M-row fused call uses (see warm), or None."""
        cache = self.__dict__.get("_views")
        if cache is None or cache[0] is not self.weight:
            return None
        return cache[1].get(("3d", _row_block(self.weight.shape[0], self.weight.shape[1], M)))

    def warm(self, M: int, blocks: bool = False) -> None:
        """Build the weight layout an M-row call uses (see weight_view);
        ``blocks``: also as a 3-D [nb, in, rb] array (one block for a plain
        W^T), the operand of an ops object's fused ``linear``."""
        W = self.weight
        rb = _row_block(W.shape[0], W.shape[1], M)
        view = self.weight_view(rb, warm=True)
        if blocks and ("3d", rb) not in self._views[1]:
            b3 = view if rb is not None else view.reshape(1, *view.shape)
            b3 = mx.contiguous(b3)
            mx.eval(b3)
            self._views[1][("3d", rb)] = b3


# Rows per block of the CPU matmuls (see Linear), by batch size; None turns
# blocking off.  Measured over all of a model's weights (ms, M = 1/5/9/17 rows):
# shipped d256: 64 rows 1.13/1.70/2.23/3.45, 32 rows 1.29/2.14/2.50/3.71,
# one contiguous W^T 2.08/3.57/4.79/5.99, strided W^T 2.65/7.79/8.43/9.58;
# 218m: 64 rows 31/40/76/173, 32 rows 32/50/56/104.
BLOCK_ROWS = {5: 64, None: 32}   # up to 5 rows: 64-row blocks; more: 32
MIN_BLOCK_ROWS = 16


def _row_block(rows: int, cols: int, M: int):
    """Rows per block for this weight and batch, or None for one W^T."""
    if BLOCK_ROWS is None or mx.default_device() != mx.cpu:
        return None
    limit = BLOCK_ROWS[5] if M <= 5 else BLOCK_ROWS[None]
    if rows <= limit:
        return None
    rb = max(r for r in range(1, limit + 1) if rows % r == 0)
    return rb if rb >= MIN_BLOCK_ROWS else None


def _rms_norm(ops, x, norm):
    """norm(x) through the ops object's rms_norm when it has one (ops objects
    need only the three sequence primitives; the rest are optional)."""
    f = getattr(ops, "rms_norm", None)
    return norm(x) if f is None else f(x, norm.weight, norm.eps)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = mx.ones((d,))
        self.eps = eps

    def __call__(self, x):
        return mx.fast.rms_norm(x, self.weight, self.eps)


# 2^f on [0, 1): degree-6 fit of relative error (max 1.1e-7 in float32), Horner order
_EXP2_FRACTION = (0.00021683440718334168, 0.0012437936384230852, 0.009679987095296383,
                  0.05548214912414551, 0.24023030698299408, 0.6931468844413757, 1.0)
_LOG2E = 1.4426950408889634
_LN2_HI, _LN2_LO = 0.693145751953125, 1.428606765330187e-06   # hi: 16 significant bits


def silu_mul(a, b):
    """silu(a) * b = a b / (1 + e^-a), with e^-a = 2^n * poly(f) (-a log2 e
    = n + f).  MLX's CPU exp calls libm's fmaf per element (~16 ns each):
    the SwiGLU of a 5-row 21m pass took ~1 ms of exp.  Mul/add/shift only,
    fused into one kernel: 0.31 vs 0.98 ms (M=5, 12 layers), 0.70 vs 3.4 ms
    (M=17), about even for one row; within ~3e-7 relative of nn.silu.  The
    same function for every M, so a row's result never depends on its batch."""
    n = mx.floor(mx.clip(a * -_LOG2E, -126.0, 126.0))   # 2^n a normal float
    # the remainder -a - n ln2 with ln2 split in two (Cody-Waite): rounding
    # t = -a log2(e) itself would cost ~|t| ulps (1.5e-6 relative at a = -22)
    r = (-a - n * _LN2_HI) - n * _LN2_LO
    f = mx.clip(r * _LOG2E, 0.0, 1.0)
    p = _EXP2_FRACTION[0]
    for c in _EXP2_FRACTION[1:]:
        p = p * f + c
    two_n = mx.left_shift(n.astype(mx.int32) + 127, 23).view(mx.float32)
    return (a * b) / (1.0 + p * two_n)


def masked_softmax(scores, visible, axis: int):
    """softmax of ``scores`` over ``axis`` where ``visible``, exact 0 elsewhere,
    with the exp-free 2^t of silu_mul (t = (s - max) log2 e <= 0): the many-row
    attention passes spent ~16 ns per score in MLX's CPU exp (0.44 of 2.2 ms
    per layer at 2k rows, M=5).  Within ~1e-7 of mx.softmax; at least one
    position per query is visible (its own)."""
    s = mx.where(visible, scores, -mx.inf)
    t = mx.clip((s - s.max(axis=axis, keepdims=True)) * _LOG2E, -126.0, 0.0)
    n = mx.floor(t)
    f = t - n
    p = _EXP2_FRACTION[0]
    for c in _EXP2_FRACTION[1:]:
        p = p * f + c
    e = mx.where(visible, p * mx.left_shift(n.astype(mx.int32) + 127, 23).view(mx.float32), 0.0)
    return e / e.sum(axis=axis, keepdims=True)


# (window rows x queries) from which masked_softmax beats mx.softmax: below it the
# extra nodes cost more than the exps saved (21m, M=5: even at 128 rows, -0.2 ms
# at 512, -1.9 ms at 2048; M=17: -1.2 ms at 512)
POLY_SOFTMAX_MIN = 2048


def _softmax_visible(scores, visible, axis: int, n: int):
    if n >= POLY_SOFTMAX_MIN:
        return masked_softmax(scores, visible, axis)
    return mx.softmax(mx.where(visible, scores, -mx.inf), axis=axis)


class MLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) * (w3 x))."""

    def __init__(self, d: int, ff: int):
        super().__init__()
        self.w1 = Linear(d, ff)
        self.w3 = Linear(d, ff)
        self.w2 = Linear(ff, d)

    def __call__(self, x, ops=None):
        gate = getattr(ops, "silu_mul", silu_mul)
        return self.w2(gate(self.w1(x, ops), self.w3(x, ops)), ops)


class GatedDeltaNet(nn.Module):
    """Short conv -> qkv -> L2 norm -> gated delta rule -> wo (SPEC 2)."""

    kind = "gdn"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, H = cfg.d_model, cfg.n_heads
        self.n_heads, self.head_dim = H, cfg.head_dim
        self.conv = mx.zeros((3, d))
        self.wqkv = Linear(d, 3 * cfg.inner)
        self.wo = Linear(cfg.inner, d)
        self.decay_logit = mx.zeros((H,))
        self.beta_logit = mx.zeros((H,))

    def gates(self, M: int) -> dict:
        """sigmoid(decay_logit) "a", sigmoid(beta_logit) "b" [H] and, for M > 1,
        ``chunk_gates`` under "chunk": evaluated arrays computed once per
        weights and M (a compiled pass captures them as constants).  The cache
        holds the parameter arrays it was built from and is rebuilt when
        ``update`` replaces them.  The model warms it before tracing a pass."""
        cache = self.__dict__.get("_gates")
        if cache is None or cache[0] is not self.decay_logit or cache[1] is not self.beta_logit:
            a, b = mx.sigmoid(self.decay_logit), mx.sigmoid(self.beta_logit)
            mx.eval(a, b)
            cache = (self.decay_logit, self.beta_logit, {"a": a, "b": b})
            object.__setattr__(self, "_gates", cache)
        g = cache[2]
        if M > 1 and M not in g:
            g[M] = chunk_gates(g["a"], g["b"], M, self.head_dim)
            mx.eval(g[M])
        return {"a": g["a"], "b": g["b"], "chunk": g.get(M)}

    def qkv(self, u, ops=None):
        """u [M,d] -> unit q, unit k, v, each [M,H,hd]."""
        M, H, hd = u.shape[0], self.n_heads, self.head_dim
        qkv = self.wqkv(u, ops).reshape(M, 3, H, hd)
        qk = l2_normalize(qkv[:, 0:2])                     # q and k in one pass
        return qk[:, 0:1].reshape(M, H, hd), qk[:, 1:2].reshape(M, H, hd), qkv[:, 2:3].reshape(M, H, hd)

    def __call__(self, x, S0, tail, ops):
        """x [M,d] normed input.  Returns out [M,d], the M states [H,hd,hd] (a list, or
        with ops.gdn_delta one stacked [M,H,hd,hd] array), tails [M,2,d], q, k."""
        u, tails = ops.conv_step(x, tail, self.conv)
        g = self.gates(x.shape[0])
        fused = getattr(ops, "gdn_delta", None)
        if fused is not None:     # L2 norm + delta rule from the raw projection, one node
            o, S_all, q, k = fused(self.wqkv(u, ops), g["a"], g["b"], S0)
            return self.wo(o.reshape(x.shape[0], -1), ops), S_all, tails, q, k   # states stacked
        q, k, v = self.qkv(u, ops)
        if hasattr(ops, "delta_rule_states"):
            o, states = ops.delta_rule_states(q, k, v, g["a"], g["b"], S0, gates=g["chunk"])
        else:
            o, S_all = ops.delta_rule(q, k, v, g["a"], g["b"], S0)
            states = _rows(S_all, x.shape[0])
        return self.wo(o.reshape(x.shape[0], -1), ops), states, tails, q, k


class Attention(nn.Module):
    """Causal attention with unit q/k, interleaved RoPE, scale sqrt(hd) (SPEC 2)."""

    kind = "attn"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.rope_theta = cfg.rope_theta
        # not a parameter: kept out of the module tree
        object.__setattr__(self, "_rope_table", rope_table(cfg.max_seq, cfg.head_dim, cfg.rope_theta))
        self.wqkv = Linear(cfg.d_model, 3 * cfg.inner)
        self.wo = Linear(cfg.inner, cfg.d_model)

    def rope(self, x, offset):
        """x [M,n,H,hd]; row j is at position offset+j (offset: int or int32 array).

        Rotates pairs (2i, 2i+1) by pos * theta^(-2i/hd), with cos/sin rows
        from a float64-built table (one gather instead of recomputing angles).
        """
        M, hd = x.shape[0], self.head_dim
        cos, sin = self._rope_table
        if isinstance(offset, int):
            c, s = cos[offset:offset + M], sin[offset:offset + M]
        else:
            c = mx.slice(cos, offset, (0,), (M, hd // 2))
            s = mx.slice(sin, offset, (0,), (M, hd // 2))
        c, s = c.reshape(M, 1, 1, hd // 2, 1), s.reshape(M, 1, 1, hd // 2, 1)
        pairs = x.reshape(*x.shape[:-1], hd // 2, 2)
        x0, x1 = pairs[..., 0:1], pairs[..., 1:2]
        return mx.concatenate([x0 * c - x1 * s, x1 * c + x0 * s], axis=-1).reshape(x.shape)

    def qkv(self, x, offset, ops=None):
        """x [M,d] -> rotated unit q, rotated unit k, v, each [M,H,hd]."""
        M, H, hd = x.shape[0], self.n_heads, self.head_dim
        qkv = self.wqkv(x, ops).reshape(M, 3, H, hd)
        qk = self.rope(l2_normalize(qkv[:, 0:2]), offset)
        return qk[:, 0:1].reshape(M, H, hd), qk[:, 1:2].reshape(M, H, hd), qkv[:, 2:3].reshape(M, H, hd)

    def __call__(self, x, k_cache, v_cache, pos0, window, ops):
        """x [M,d] normed input at positions pos0.. (pos0: int32 scalar array).

        Writes this batch's k/v into the full caches, attends over the first
        ``window`` rows.  Returns out [M,d] and the updated caches.
        """
        M = x.shape[0]
        q, k, v = self.qkv(x, pos0, ops)
        k_cache = mx.slice_update(k_cache, k, pos0, axes=(0,))
        v_cache = mx.slice_update(v_cache, v, pos0, axes=(0,))
        o = ops.attend(q, k_cache[:window], v_cache[:window], pos0, M)
        return self.wo(o.reshape(M, -1), ops), k_cache, v_cache


class Block(nn.Module):
    """x + mixer(rmsnorm(x)), then + SwiGLU(rmsnorm(.))."""

    def __init__(self, cfg: ModelConfig, kind: str):
        super().__init__()
        self.kind = kind
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = GatedDeltaNet(cfg) if kind == "gdn" else Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg.d_model, cfg.d_ff)

    def ffn(self, h, ops=None):
        if ops is None:
            return h + self.mlp(self.ffn_norm(h))
        return h + self.mlp(_rms_norm(ops, h, self.ffn_norm), ops)


class DraftStack(nn.Module):
    """The draft's own layers (``draft.layers.{j}``); embedding/norm/head are shared."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = [Block(cfg, cfg.layer_kind(i)) for i in cfg.draft_map]


class SpelModel(nn.Module):
    """Target stack + FP32 draft stack sharing tok_emb, final_norm, lm_head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg.validate()
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = [Block(cfg, cfg.layer_kind(i)) for i in range(cfg.n_layers)]
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = Linear(cfg.d_model, cfg.vocab)
        self.draft = DraftStack(cfg)
        self._ops = auto_ops()
        object.__setattr__(self, "_compile", True)
        # (stack, M, window, device) -> compiled pass; a plain attribute, not in the module tree
        object.__setattr__(self, "_compiled", {})

    # --- weights ------------------------------------------------------------
    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: dict) -> "SpelModel":
        model = cls(cfg)
        model.load_weights_dict(weights)
        return model

    def load_weights_dict(self, weights: dict) -> None:
        """Load ``{name: array}`` with exactly the names/shapes of layout.py."""
        specs = layout.tensor_specs(self.cfg)
        want = {s.name: s.shape for s in specs}
        missing = [n for n in want if n not in weights]
        extra = [n for n in weights if n not in want and not n.startswith("golden.")]
        if missing or extra:
            raise ValueError(f"weights do not match the config: missing {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
                             f"{' ...' if len(extra) > 5 else ''}")
        items = []
        for name, shape in want.items():
            w = weights[name]
            if tuple(w.shape) != tuple(shape):
                raise ValueError(f"tensor {name}: shape {tuple(w.shape)}, expected {tuple(shape)}")
            items.append((name, mx.array(np.asarray(w, dtype=np.float32))))
        self.load_weights(items, strict=True)
        mx.eval(self.parameters())

    def update(self, parameters: dict, strict: bool = True):
        """nn.Module.update; also drops the compiled passes (they hold the old arrays)."""
        self._compiled.clear()
        return super().update(parameters, strict=strict)

    def weights_dict(self) -> dict:
        """``{name: np.float32 array}`` in layout order."""
        flat = dict(_flatten(self.parameters()))
        return {s.name: np.array(flat[s.name], dtype=np.float32) for s in layout.tensor_specs(self.cfg)}

    @property
    def compile(self) -> bool:
        """True: passes run mx.compile'd; False: the same functions eagerly (debugging,
        host-reading ops).  Changing it drops the cached passes."""
        return self._compile

    @compile.setter
    def compile(self, value: bool) -> None:
        object.__setattr__(self, "_compile", bool(value))
        self._compiled.clear()

    # --- ops -----------------------------------------------------------------
    @property
    def ops(self):
        return self._ops

    def set_ops(self, ops) -> None:
        """Swap the sequence primitives (see MLXOps); drops the compiled passes.

        Ops with ``requires_eager = True`` (they read arrays on the host) turn
        compilation off; going back to the default ops turns it on again.
        """
        self._ops = auto_ops() if ops is None else ops
        self.compile = not getattr(self._ops, "requires_eager", False)
        self._compiled.clear()

    # --- state ---------------------------------------------------------------
    def stack_layers(self, stack: str) -> list:
        if stack == "target":
            return self.layers
        if stack == "draft":
            return self.draft.layers
        raise ValueError(f"stack must be 'target' or 'draft', not {stack!r}")

    def new_state(self, stack: str = "target", ring: int | None = None) -> DecodeState:
        self.stack_layers(stack)
        ring = self.cfg.spec_k + 1 if ring is None else ring
        return DecodeState(self.cfg, stack, ring)

    # --- forward -------------------------------------------------------------
    def forward(self, tokens, state: DecodeState, strict: bool = False, stack: str | None = None,
                capture: dict | None = None) -> mx.array:
        """Run M tokens after the state's last written position; no commit.

        Returns logits [M, V] float32.  strict: every row runs the single-token
        pass (bit-identical to M single-token calls), or the M-row pass where that
        gives the same bits (``rows_independent``); fast: one M-row pass with
        GEMM projections.  capture: filled with ``capture[layer] = {"q": [M,H,hd],
        "k": [M,H,hd]}`` per GDN layer (layer = index within the stack).
        """
        stack = state.stack if stack is None else stack
        if stack != state.stack:
            raise ValueError(f"state belongs to the {state.stack!r} stack, not {stack!r}")
        toks = _token_list(tokens, self.cfg.vocab)
        M = len(toks)
        state.check_room(M)
        if M == 1 or not strict or self.rows_independent(stack, M):
            logits, qk = self._run(toks, state)
            if capture is not None:
                capture.update(qk)
            return logits
        rows, qks = [], []
        for t in toks:
            logits, qk = self._run([t], state)
            rows.append(logits)
            qks.append(qk)
        if capture is not None:
            for li in qks[0]:
                capture[li] = {n: mx.concatenate([qk[li][n] for qk in qks]) for n in ("q", "k")}
        return mx.concatenate(rows, axis=0)

    def rows_independent(self, stack: str, M: int) -> bool:
        """True when an M-row pass gives every row exactly the bits of a single-token
        pass, so strict mode may run it as one pass: the fused CPU sub-blocks (whose
        kernels work row by row: norms, conv, the delta rule token after token, RoPE,
        attention per query) and linear products that are one FMA chain per output
        element (the AVX-512 tiles, ``_spel_cpu.fma_chain_linear``) for every weight's
        blocks at 1 and at M rows (whole 16-column vectors).  tests/test_cpu_ops.py
        checks the bits; anywhere else strict runs M single-token passes."""
        ops = self._ops
        fma = getattr(ops, "fma_chain_linear", None)
        if fma is None or not fma() or mx.default_device() != mx.cpu or \
                not all(hasattr(ops, f) for f in ("ffn_block", "gdn_block", "attn_block")):
            return False
        key = ("rows_independent", stack, M)
        ok = self._compiled.get(key)
        if ok is None:
            lins = [self.lm_head]
            for blk in self.stack_layers(stack):
                lins += [blk.mixer.wqkv, blk.mixer.wo, blk.mlp.w1, blk.mlp.w3, blk.mlp.w2]
            ok = all(((_row_block(*lin.weight.shape, m) or lin.weight.shape[0]) % 16 == 0)
                     for lin in lins for m in (1, M))
            self._compiled[key] = ok
        return ok

    def prefill(self, tokens, state: DecodeState, stack: str | None = None, strict: bool = False) -> mx.array:
        """Feed a prompt in chunks of the ring size, committing each; last logits [V]."""
        toks = _token_list(tokens, self.cfg.vocab)
        if not toks:
            raise ValueError("prefill needs at least one token")
        if state.pending:
            raise StateError("prefill needs a committed state (commit or discard the pending tokens)")
        logits = None
        R = state.ring
        for i in range(0, len(toks), R):
            chunk = toks[i:i + R]
            logits = self.forward(chunk, state, strict=strict, stack=stack)
            state.commit(len(chunk))
        return logits[-1]

    __call__ = forward

    def _run(self, toks: list, state: DecodeState):
        """One pass of len(toks) rows through the state's stack (compiled per shape)."""
        M = len(toks)
        base = state.pos + state.pending
        window = _window(base + M, self.cfg.max_seq)
        key = (state.stack, M, window, str(mx.default_device()))  # device: see _row_block
        fn = self._compiled.get(key)
        if fn is None:
            fn = self._compiled[key] = self._make_pass(state.stack, M, window)
        gdn_in, kv_in = [], []
        for li in state.gdn_layers:
            gdn_in.extend(state.current_gdn(li))
        for li in state.attn_layers:
            kv_in.extend(state.kv(li))
        logits, gdn_out, kv_out, qk = fn(mx.array(toks, dtype=mx.int32),
                                         mx.array(base, dtype=mx.int32), gdn_in, kv_in)
        del kv_in   # only the pass may reference the old caches: lets MLX update them in place
        for n, li in enumerate(state.attn_layers):
            state.set_kv(li, kv_out[2 * n], kv_out[2 * n + 1])
        captured, at = {}, 0
        for n, li in enumerate(state.gdn_layers):
            if gdn_out[at].ndim == 4:       # fused ops: S [M,H,hd,hd] and tails [M,2,d] stacked
                state.write_gdn_rows(li, gdn_out[at], gdn_out[at + 1])
                at += 2
            else:                           # M states [H,hd,hd], then M tails [2,d]
                state.write_gdn(li, gdn_out[at:at + M], gdn_out[at + M:at + 2 * M])
                at += 2 * M
            captured[li] = {"q": qk[2 * n], "k": qk[2 * n + 1]}
        state.advance(M)
        # the GDN slots stay lazy: the next pass evaluates the one it starts from,
        # and a rejected token's state (chunked delta rule) is never computed
        mx.async_eval(logits, kv_out)
        return logits, captured

    def _make_pass(self, stack: str, M: int, window: int):
        """The function of one M-row pass, compiled for a fixed M and window.

        Inputs: tokens [M] int32, pos (int32 scalar: position of row 0), the
        GDN states [S, tail] per GDN layer, the full KV caches [K, V] per
        attention layer.  Outputs: logits [M,V]; per GDN layer the M states S
        [H,hd,hd] then the M conv tails [2,d] (with ops.gdn_delta: the two
        stacked, [M,H,hd,hd] and [M,2,d]); the updated caches; per GDN
        layer q and k [M,H,hd].  The parameters are captured as constants, so
        ``update``/``set_ops`` drop the compiled passes.
        """
        ops = self._ops
        layers = self.stack_layers(stack)
        for blk in layers:       # constants computed now, captured by the trace
            if blk.kind == "gdn":
                blk.mixer.gates(M)
            for lin in (blk.mixer.wqkv, blk.mixer.wo, blk.mlp.w1, blk.mlp.w3, blk.mlp.w2):
                lin.warm(M, blocks=hasattr(ops, "linear"))
        self.lm_head.warm(M, blocks=hasattr(ops, "linear"))

        # whole sub-blocks as single nodes (CPU ops with ffn_block/gdn_block)
        fused = {}
        attn_block = getattr(ops, "attn_block", None)
        if hasattr(ops, "ffn_block") and hasattr(ops, "gdn_block"):
            for li, blk in enumerate(layers):
                mlp = [lin.blocks(M) for lin in (blk.mlp.w1, blk.mlp.w3, blk.mlp.w2)]
                mix = [blk.mixer.wqkv.blocks(M), blk.mixer.wo.blocks(M)]
                if all(b is not None for b in mlp + mix):
                    fused[li] = (mlp, mix)

        def one_pass(tokens, pos, gdn_in, kv_in):
            x = self.tok_emb(tokens)
            gdn_out, kv_out, qk = [], [], []
            gi = ai = 0
            for li, blk in enumerate(layers):
                if li in fused:
                    mlp, mix = fused[li]
                    if blk.kind == "gdn":
                        g = blk.mixer.gates(M)
                        h, states, tails, q, k = ops.gdn_block(
                            x, blk.attn_norm.weight, gdn_in[2 * gi + 1], blk.mixer.conv, mix[0],
                            g["a"], g["b"], gdn_in[2 * gi], mix[1], blk.attn_norm.eps)
                        gdn_out += [states, tails]
                        qk += [q, k]
                        gi += 1
                    else:
                        kc, vc = kv_in[2 * ai], kv_in[2 * ai + 1]
                        if attn_block is not None:
                            cos, sin = blk.mixer._rope_table
                            h, kc, vc = attn_block(x, blk.attn_norm.weight, mix[0], mix[1], kc, vc, pos, cos,
                                                   sin, window, blk.attn_norm.eps)
                        else:
                            out, kc, vc = blk.mixer(_rms_norm(ops, x, blk.attn_norm), kc, vc, pos, window, ops)
                            h = x + out
                        kv_out += [kc, vc]
                        ai += 1
                    x = ops.ffn_block(h, blk.ffn_norm.weight, *mlp, blk.ffn_norm.eps)
                    continue
                xn = _rms_norm(ops, x, blk.attn_norm)
                if blk.kind == "gdn":
                    out, states, tails, q, k = blk.mixer(xn, gdn_in[2 * gi], gdn_in[2 * gi + 1], ops)
                    gdn_out += [states, tails] if isinstance(states, mx.array) else states + _rows(tails, M)
                    qk += [q, k]
                    gi += 1
                else:
                    out, kc, vc = blk.mixer(xn, kv_in[2 * ai], kv_in[2 * ai + 1], pos, window, ops)
                    kv_out += [kc, vc]
                    ai += 1
                x = blk.ffn(x + out, ops)
            return self.lm_head(_rms_norm(ops, x, self.final_norm), ops), gdn_out, kv_out, qk

        return mx.compile(one_pass) if self.compile else one_pass


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}{k}.")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _flatten(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def _rows(a, M):
    """[a[0], ..., a[M-1]] as slice+reshape views (integer indexing would gather)."""
    shape = a.shape[1:]
    return [a[j:j + 1].reshape(shape) for j in range(M)] if M > 1 else [a.reshape(shape)]


def _window(n: int, max_seq: int) -> int:
    """Attention window covering n positions (one compiled pass per window).

    Powers of two from MIN_WINDOW to 1024, then multiples of 512: past 1k
    tokens attention costs about as much as the weights, so a window at most
    ~1.5x what is needed, for a handful of compiled shapes (compiling a pass
    takes tens of ms).
    """
    w = MIN_WINDOW
    while w < n and w < 1024:
        w *= 2
    if w < n:
        w = -(-n // 512) * 512
    return min(w, max_seq)


def _token_list(tokens, vocab: int) -> list:
    if isinstance(tokens, mx.array):
        tokens = np.array(tokens)
    if isinstance(tokens, (int, np.integer)):
        tokens = [tokens]
    out = [int(t) for t in np.asarray(tokens).reshape(-1)]
    for t in out:
        if not 0 <= t < vocab:
            raise ValueError(f"token {t} out of range 0..{vocab - 1}")
    return out


def init_weights(cfg: ModelConfig, seed: int = 0, scale: float = 1.0) -> dict:
    """Random weights with realistic scales, ``{name: np.float32}`` in layout order.

    Linear maps ~ N(0, scale/sqrt(fan_in)); embedding ~ N(0, 1); norms 1 with
    a little jitter; conv taps around (0.1, 0.2, 0.7) so the current input
    dominates; decay logits in [1, 4] (a = 0.73..0.98) and beta logits in
    [-1, 1] as trained models show.  draft layers get their own draws.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for spec in layout.tensor_specs(cfg):
        name, shape = spec.name, spec.shape
        leaf = name.rsplit(".", 2)
        if name == "tok_emb.weight":
            w = rng.standard_normal(shape)
        elif name.endswith("norm.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("mixer.conv"):
            w = np.array([0.1, 0.2, 0.7])[:, None] + 0.2 * rng.standard_normal(shape)
        elif name.endswith("decay_logit"):
            w = rng.uniform(1.0, 4.0, shape)
        elif name.endswith("beta_logit"):
            w = rng.uniform(-1.0, 1.0, shape)
        else:  # [out, in] linear maps, lm_head included
            w = rng.standard_normal(shape) * (scale / math.sqrt(shape[1]))
        del leaf
        out[name] = np.ascontiguousarray(w, dtype=np.float32)
    return out
