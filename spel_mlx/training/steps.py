"""The compiled train step (AdamW with in-graph spike skipping) and held-out evaluation."""
from __future__ import annotations

import mlx.core as mx

from ..config import ModelConfig
from ..model import SpelModel
from ..model.training_ops import cross_entropy
from .config import TrainConfig


def kl_target_draft(t_logits, d_logits, temperature: float = 1.0):
    """mean KL(target_T || draft_T) per position, in nats: both logits divided by T
    (T = 1: the plain KL, computed without the division)."""
    if temperature != 1.0:
        t_logits, d_logits = t_logits / temperature, d_logits / temperature
    tl = t_logits - mx.logsumexp(t_logits, axis=-1, keepdims=True)
    dl = d_logits - mx.logsumexp(d_logits, axis=-1, keepdims=True)
    return mx.mean(mx.sum(mx.exp(tl) * (tl - dl), axis=-1))


def distill_loss(t_logits, d_logits, temperature: float = 1.0, t1_weight: float = 0.0):
    """The draft's objective: KL at the distillation temperature T (sampled decoding's
    distribution), with `t1_weight` of it replaced by the plain KL (greedy's anchor);
    at T = 1 exactly kl_target_draft, whatever the weight."""
    if temperature == 1.0:
        return kl_target_draft(t_logits, d_logits)
    kl_t = kl_target_draft(t_logits, d_logits, temperature)
    if t1_weight == 0.0:
        return kl_t
    return (1.0 - t1_weight) * kl_t + t1_weight * kl_target_draft(t_logits, d_logits)


def _forward(cfg: ModelConfig, chunk: int):
    """(params, tokens, stack) -> logits: the model's training forward over a flat
    params dict; the draft runs with SPEC 3 fake quantization (QAT)."""
    model = SpelModel(cfg)
    return lambda p, x, stack: model.batch_logits(x, stack, fake_quant=stack == "draft", chunk=chunk, params=p)


def _decay_mask(name: str) -> bool:
    return name.endswith(".weight") and "norm" not in name


def make_step(cfg: ModelConfig, tc: TrainConfig, trainable_names: list):
    """Compiled train step: (trainable, frozen, m, v, x, y, lr, t, spike) ->
    (loss, gnorm, ok, trainable', m', v').  The update is skipped in-graph when
    the gradient norm is non-finite or above `spike`."""
    b1, b2, eps, wd, clip = tc.beta1, tc.beta2, tc.adam_eps, tc.weight_decay, tc.clip
    forward = _forward(cfg, tc.chunk)

    if tc.mode == "target":
        def loss_fn(train, frozen, x, y):
            return cross_entropy(forward({**frozen, **train}, x, "target"), y)
    else:
        def loss_fn(train, frozen, x, y):
            p = {**frozen, **train}
            t_logits = mx.stop_gradient(forward(p, x, "target"))
            return distill_loss(t_logits, forward(p, x, "draft"), tc.distill_temperature, tc.distill_t1_weight)

    vg = mx.value_and_grad(loss_fn)

    def step(train, frozen, m, v, x, y, lr, t, spike):
        loss, grads = vg(train, frozen, x, y)
        gsq = sum(mx.sum(g * g) for g in grads.values())
        gnorm = mx.sqrt(gsq)
        ok = mx.logical_and(mx.isfinite(gnorm), gnorm < spike)
        scale = mx.minimum(1.0, clip / (gnorm + 1e-6))
        bc1 = 1 - b1 ** t
        bc2 = 1 - b2 ** t
        new_p, new_m, new_v = {}, {}, {}
        for n in trainable_names:
            g = mx.where(ok, grads[n] * scale, 0.0)
            mn = b1 * m[n] + (1 - b1) * g
            vn = b2 * v[n] + (1 - b2) * g * g
            upd = (mn / bc1) / (mx.sqrt(vn / bc2) + eps)
            if _decay_mask(n):
                upd = upd + wd * train[n]
            new_p[n] = mx.where(ok, train[n] - lr * upd, train[n])
            new_m[n] = mx.where(ok, mn, m[n])
            new_v[n] = mx.where(ok, vn, v[n])
        return loss, gnorm, ok, new_p, new_m, new_v

    return mx.compile(step)


def make_eval(cfg: ModelConfig, tc: TrainConfig):
    """Compiled held-out evaluation: (params, x, y) -> (sum NLL, [KL sum, agree count,
    distillation objective sum]); the objective is the KL itself at T = 1."""
    forward = _forward(cfg, tc.chunk)

    def ev(p, x, y):
        if tc.mode == "target":
            lg = forward(p, x, "target")
            lse = mx.logsumexp(lg, axis=-1)
            nll = lse - mx.take_along_axis(lg, y[..., None], axis=-1)[..., 0]
            return mx.sum(nll), mx.array(0.0), mx.array(0.0), mx.array(0.0)
        tl = forward(p, x, "target")
        dl = forward(p, x, "draft")
        lse = mx.logsumexp(dl, axis=-1)
        nll = lse - mx.take_along_axis(dl, y[..., None], axis=-1)[..., 0]
        n = tl.shape[0] * tl.shape[1]
        kl = kl_target_draft(tl, dl) * n
        agree = mx.sum(mx.argmax(tl, axis=-1) == mx.argmax(dl, axis=-1))
        objective = kl if tc.distill_temperature == 1.0 else \
            distill_loss(tl, dl, tc.distill_temperature, tc.distill_t1_weight) * n
        return mx.sum(nll), kl, agree, objective

    return mx.compile(ev)

