"""Elementwise and small-reduction math shared by the layers and the ops."""
from __future__ import annotations

import functools

import numpy as np

import mlx.core as mx

L2_EPS = 1e-6  # SPEC 2: inside the square root, x / sqrt(sum x^2 + eps)


def l2_normalize(x: mx.array) -> mx.array:
    return x * mx.rsqrt(mx.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


# positions up to which a pass that captures the RoPE table once (the CPU pass plan) gets
# a table for all of max_seq; beyond, passes take tables sized by use (layers.Attention)
ROPE_ALL_ROWS = 1 << 16


@functools.lru_cache(maxsize=16)
def rope_table(rows: int, head_dim: int, theta: float):
    """(cos, sin) [rows, hd/2] of pos * theta^(-2i/hd) for positions 0..rows-1, computed
    in float64.  Each value is computed on its own, so a position's row is the same
    whatever `rows` is: tables are sized by the positions in use (a header's max_seq
    alone allocates nothing)."""
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.arange(rows, dtype=np.float64)[:, None] * inv[None, :]
    return mx.array(np.cos(ang).astype(np.float32)), mx.array(np.sin(ang).astype(np.float32))


# 2^f on [0, 1): degree-6 fit of relative error (max 1.1e-7 in float32), Horner order
_EXP2_FRACTION = (0.00021683440718334168, 0.0012437936384230852, 0.009679987095296383,
                  0.05548214912414551, 0.24023030698299408, 0.6931468844413757, 1.0)
_LOG2E = 1.4426950408889634
_LN2_HI, _LN2_LO = 0.693145751953125, 1.428606765330187e-06   # hi: 16 significant bits


def _exp2_fraction(f):
    p = _EXP2_FRACTION[0]
    for c in _EXP2_FRACTION[1:]:
        p = p * f + c
    return p


def _pow2(n):
    """2^n for integral float n in [-126, 127], built from the exponent bits."""
    return mx.left_shift(n.astype(mx.int32) + 127, 23).view(mx.float32)


def silu_mul(a, b):
    """silu(a) * b = a b / (1 + e^-a), with e^-a = 2^n * poly(f), -a log2 e = n + f.

    MLX's CPU exp is slow (a libm call per element); this is mul/add/shift only,
    within ~3e-7 relative of nn.silu, and the same function for every M, so a
    row's result never depends on its batch (docs/model.md)."""
    n = mx.floor(mx.clip(a * -_LOG2E, -126.0, 126.0))
    # Cody-Waite: -a - n ln2 with ln2 in two parts; rounding -a log2(e) directly
    # would cost ~|t| ulps
    r = (-a - n * _LN2_HI) - n * _LN2_LO
    f = mx.clip(r * _LOG2E, 0.0, 1.0)
    return (a * b) / (1.0 + _exp2_fraction(f) * _pow2(n))


def masked_softmax(scores, visible, axis: int):
    """softmax over ``axis`` where ``visible``, exact 0 elsewhere, with silu_mul's
    exp-free 2^t (t = (s - max) log2 e <= 0).  At least one position per query
    must be visible (its own)."""
    s = mx.where(visible, scores, -mx.inf)
    t = mx.clip((s - s.max(axis=axis, keepdims=True)) * _LOG2E, -126.0, 0.0)
    n = mx.floor(t)
    e = mx.where(visible, _exp2_fraction(t - n) * _pow2(n), 0.0)
    return e / e.sum(axis=axis, keepdims=True)


# (window rows x queries) from which masked_softmax beats mx.softmax: below it
# the extra nodes cost more than the exps saved (docs/model.md)
POLY_SOFTMAX_MIN = 2048


def softmax_visible(scores, visible, axis: int, n: int):
    if n >= POLY_SOFTMAX_MIN:
        return masked_softmax(scores, visible, axis)
    return mx.softmax(mx.where(visible, scores, -mx.inf), axis=axis)


def as_float32(a: mx.array) -> mx.array:
    """a widened to float32 (a half-precision KV cache: exact), a itself if it is."""
    return a if a.dtype == mx.float32 else a.astype(mx.float32)
