"""Initial weights, ``{name: array}`` in layout order, by tensor role.

``init_weights``: random weights with the scales trained models show, for
synthetic checkpoints and tests (synth.py and the golden footers depend on its
exact draws).  ``init_params``: the start of training.  Draft layers get their
own draws in both; ``copy_target_to_draft`` starts a distillation instead.
"""
from __future__ import annotations

import math

import numpy as np

import mlx.core as mx

from .. import layout
from ..config import ModelConfig


def init_weights(cfg: ModelConfig, seed: int = 0, scale: float = 1.0) -> dict:
    """np.float32 weights: linear maps N(0, scale/sqrt(fan_in)), embedding N(0, 1),
    norms 1 with a little jitter, conv taps around (0.1, 0.2, 0.7) (the current
    input dominates), decay logits in [1, 4] (a = 0.73..0.98), beta logits in [-1, 1]."""
    rng = np.random.default_rng(seed)
    out = {}
    for spec in layout.tensor_specs(cfg):
        name, shape = spec.name, spec.shape
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
        out[name] = np.ascontiguousarray(w, dtype=np.float32)
    return out


def init_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """mx float32 weights to train from: unit norms, conv = identity on the current
    token plus noise, per-head memory horizons of 10..200 tokens, beta 0.5, linear
    maps N(0, 1/sqrt(fan_in)) with the residual outputs (wo, w2) scaled by 1/sqrt(2L)."""
    rng = np.random.default_rng(seed)
    out = {}
    resid_scale = 1.0 / math.sqrt(2 * cfg.n_layers)
    for spec in layout.tensor_specs(cfg):
        n, shp = spec.name, spec.shape
        if n.endswith("norm.weight"):
            w = np.ones(shp, np.float32)
        elif n.endswith("mixer.conv"):
            w = np.zeros(shp, np.float32)
            w[2] = 1.0
            w += rng.normal(0, 0.02, shp).astype(np.float32)
        elif n.endswith("decay_logit"):
            a = np.linspace(0.90, 0.995, shp[0])
            w = np.log(a / (1 - a)).astype(np.float32)
        elif n.endswith("beta_logit"):
            w = np.zeros(shp, np.float32)
        elif n == "tok_emb.weight":
            w = rng.normal(0, 1.0, shp).astype(np.float32)
        else:
            std = 1.0 / math.sqrt(shp[1])
            if n.endswith("wo.weight") or n.endswith("w2.weight"):
                std *= resid_scale
            w = rng.normal(0, std, shp).astype(np.float32)
        out[n] = mx.array(w)
    return out


def copy_target_to_draft(cfg: ModelConfig, params: dict) -> dict:
    """Draft layer j := target layer draft_map[j] (the distillation start point)."""
    out = dict(params)
    for j, src in enumerate(cfg.draft_map):
        for spec in layout.layer_specs(cfg, f"layers.{src}.", cfg.layer_kind(src)):
            out[f"draft.layers.{j}." + spec.name[len(f"layers.{src}."):]] = params[spec.name]
    return out
