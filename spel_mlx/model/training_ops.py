"""The ops of the batched training forward (``SpelModel.batch_logits``).

No decoding state: every sequence starts from zeros, the delta rule runs in
chunks, every op is differentiable.  With ``fake_quant`` the draft's linears
apply SPEC 3 quantization in the forward pass and pass gradients straight
through (QAT): q8 or ternary weight rows by each Linear's ``quant``, and
per-vector int8 activations.
"""
from __future__ import annotations

import mlx.core as mx

from .delta_rule import delta_rule_chunked
from .ops import MLXOps


def _ste(x, xq):
    """xq in the forward pass, the identity's gradient in the backward pass."""
    return x + mx.stop_gradient(xq - x)


def _nonzero(s):
    return mx.where(s > 0, s, 1.0)


def fq_q8_rows(w):
    """q8 per output row: s = max|w|/127, q = round(w/s) in [-127, 127]."""
    s = mx.max(mx.abs(w), axis=1, keepdims=True) / 127.0
    return mx.clip(mx.round(w / _nonzero(s)), -127, 127) * s


def ternary_scale_codes(w, refinements: int = 3):
    """(q in {-1,0,1}, s [R,1]) per SPEC 3: s = mean|w|, then least-squares refinements."""
    s = mx.mean(mx.abs(w), axis=1, keepdims=True)
    for _ in range(refinements):
        q = mx.clip(mx.round(w / _nonzero(s)), -1, 1)
        qq = mx.sum(q * q, axis=1, keepdims=True)
        s = mx.where(qq > 0, mx.sum(w * q, axis=1, keepdims=True) / mx.where(qq > 0, qq, 1.0), s)
    return mx.clip(mx.round(w / _nonzero(s)), -1, 1), s


def fq_ternary_rows(w):
    q, s = ternary_scale_codes(w)
    return q * s


def fq_act(x):
    """Per-vector (last axis) int8: s = max|x|/127, x_q = round(x/s); zeros stay zeros."""
    s = mx.max(mx.abs(x), axis=-1, keepdims=True) / 127.0
    return mx.clip(mx.round(x / _nonzero(s)), -127, 127) * s


def fake_quant_linear(x, w, scheme: str | None):
    """x W^T with SPEC 3 fake quantization (scheme "q8" or "ternary"; None: plain)."""
    if scheme is None:
        return x @ w.T
    wq = fq_q8_rows(w) if scheme == "q8" else fq_ternary_rows(w)
    return _ste(x, fq_act(x)) @ _ste(w, wq).T


class TrainingOps(MLXOps):
    name = "training"

    def __init__(self, fake_quant: bool = False, chunk: int = 64):
        self.fake_quant = fake_quant
        self.chunk = chunk

    def linear(self, x, lin):
        return fake_quant_linear(x, lin.weight, lin.quant if self.fake_quant else None)

    def silu_mul(self, a, b):
        # the plain formula: differentiable, and cheaper than the exp-free one on whole batches
        return a * mx.sigmoid(a) * b

    def delta_rule(self, q, k, v, a, beta, S0, gates=None):
        o, _ = delta_rule_chunked(q, k, v, a, beta, S0, chunk=self.chunk)
        return o, None
