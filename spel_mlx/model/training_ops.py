"""The ops of the batched training forward (``SpelModel.batch_logits``).

No decoding state: every sequence starts from zeros, the delta rule runs in
chunks, every op is differentiable.  With ``fake_quant`` the draft's linears
apply SPEC 3 quantization in the forward pass and pass gradients straight
through (QAT): q8 or ternary weight rows by each Linear's ``quant``, and
per-vector int8 activations.
"""
from __future__ import annotations

import mlx.core as mx

from . import cpu_ops
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


# --- the fused CPU bodies (spel_mlx._spel_cpu) with their backward -------------------
# MLX's CPU graph evaluates exp one element at a time and the chunked delta rule as
# hundreds of small nodes; these run each as one node (docs/training.md, "Trainer speed").

def fused() -> bool:
    """Whether the training forward uses the fused CPU bodies: the module is built for
    this MLX and the default device is the CPU (SPEL_TRAIN_FUSED=0 turns them off)."""
    from ..settings import setting
    return (setting("SPEL_TRAIN_FUSED") and cpu_ops.available()
            and mx.default_device() == mx.cpu)


def _c(x):
    return mx.contiguous(x)


@mx.custom_function
def silu_mul_fused(a, b):
    """silu(a) * b (the exp-free formula of model.silu_mul) over [..., n]."""
    n = a.shape[-1]
    return cpu_ops._spel_cpu.silu_mul(a.reshape(-1, n), b.reshape(-1, n)).reshape(a.shape)


@silu_mul_fused.vjp
def _silu_mul_vjp(primals, cotangent, output):
    a, b = primals
    return tuple(cpu_ops._spel_cpu.silu_mul_grad(_c(a), _c(b), _c(cotangent)))


@mx.custom_function
def softmax_causal(s):
    """softmax over the last axis of s [..., T, T], row i over columns 0..i (0 beyond)."""
    return cpu_ops._spel_cpu.softmax_rows(_c(s), True)


@softmax_causal.vjp
def _softmax_causal_vjp(primals, cotangent, p):
    return (p * (cotangent - mx.sum(cotangent * p, axis=-1, keepdims=True)),)


@mx.custom_function
def _token_nll(logits, targets):
    """(-log softmax(logits)[target], log-sum-exp) per row of logits [R, V]."""
    lse = cpu_ops._spel_cpu.logsumexp_rows(_c(logits))
    return lse - mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0], lse


@_token_nll.vjp
def _token_nll_vjp(primals, cotangents, outputs):
    logits, targets = primals
    d = cpu_ops._spel_cpu.xent_grad(_c(logits), outputs[1], _c(targets.astype(mx.int32)), _c(cotangents[0]))
    return d, mx.zeros_like(targets)


def cross_entropy(logits, targets):
    """mean next-token NLL in nats of logits [..., V] against targets [...]."""
    if fused():
        V = logits.shape[-1]
        return mx.mean(_token_nll(logits.reshape(-1, V), targets.reshape(-1))[0])
    lse = mx.logsumexp(logits, axis=-1)
    return mx.mean(lse - mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0])


def delta_rule_fused(chunk: int):
    """The delta rule from the zero state over q, k, v [B, T, H, hd] as one node, and
    its backward from the state before each chunk of `chunk` tokens."""
    @mx.custom_function
    def run(q, k, v, a, beta):
        return tuple(cpu_ops._spel_cpu.delta_train(_c(q), _c(k), _c(v), a, beta, chunk))

    @run.vjp
    def run_vjp(primals, cotangents, outputs):
        q, k, v, a, beta = primals
        dq, dk, dv, da, db = cpu_ops._spel_cpu.delta_train_grad(_c(q), _c(k), _c(v), a, beta, outputs[1],
                                                                _c(cotangents[0]), chunk)
        return dq, dk, dv, mx.sum(da, axis=0), mx.sum(db, axis=0)
    return run


class TrainingOps(MLXOps):
    name = "training"

    def __init__(self, fake_quant: bool = False, chunk: int = 64):
        self.fake_quant = fake_quant
        self.chunk = chunk
        self.fused = fused()
        self._delta = delta_rule_fused(chunk) if self.fused else None

    def linear(self, x, lin):
        return fake_quant_linear(x, lin.weight, lin.quant if self.fake_quant else None)

    def silu_mul(self, a, b):
        if self.fused:
            return silu_mul_fused(a, b)
        # the plain formula: differentiable, and cheaper than the exp-free one on whole batches
        return a * mx.sigmoid(a) * b

    def silu(self, x):
        return silu_mul_fused(x, mx.ones_like(x)) if self.fused else super().silu(x)

    def causal_attention(self, q, k, v, scale: float):
        if not self.fused:
            return super().causal_attention(q, k, v, scale)
        return softmax_causal((q @ mx.swapaxes(k, -1, -2)) * scale) @ v

    def delta_rule(self, q, k, v, a, beta, S0, gates=None):
        if self.fused and S0 is None:
            return self._delta(q, k, v, a, beta)[0], None
        o, _ = delta_rule_chunked(q, k, v, a, beta, S0, chunk=self.chunk)
        return o, None
