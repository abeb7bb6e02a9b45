"""The independent float64 reference of SPEC 2 and of the quantized draft (SPEC 3):
what the tests compare the MLX model and the C draft against, and what golden.py's
numpy paths compute.

Written straight from the spec, one token at a time, without sharing code with
spel_mlx.model.  ``matvec(name, W, x)`` computes every linear map of the layers
(name = the tensor name, e.g. ``draft.layers.1.mlp.w1.weight``); the default is
``W @ x`` in float64.  The quantized draft plugs in the reference q8/ternary GEMVs of
spel_mlx.quant (``quantized_matvec``): q8 wqkv/wo, ternary w1/w3/w2, each input
quantized per vector to int8, int32-exact dots.  Embedding, norms, conv, decay, beta,
final norm and the LM head stay float64 (the head is computed with plain ``W @ x``).
"""
from __future__ import annotations

import math

import numpy as np

from . import quant

Q8 = ("mixer.wqkv.weight", "mixer.wo.weight")
TERNARY = ("mlp.w1.weight", "mlp.w3.weight", "mlp.w2.weight")


def _rmsnorm(x, g, eps):
    return x / math.sqrt(float(np.mean(x * x)) + eps) * g


def _unit(x):
    return x / math.sqrt(float(np.dot(x, x)) + 1e-6)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _rope(x, pos, theta):
    """Rotate pairs (2i, 2i+1) by pos * theta^(-2i/hd)."""
    hd = x.shape[0]
    y = x.copy()
    for i in range(hd // 2):
        ang = pos * theta ** (-2.0 * i / hd)
        c, s = math.cos(ang), math.sin(ang)
        y[2 * i] = x[2 * i] * c - x[2 * i + 1] * s
        y[2 * i + 1] = x[2 * i] * s + x[2 * i + 1] * c
    return y


def forward_reference(cfg, weights, tokens, stack="target", matvec=None):
    """Logits [M, V] (float64) for tokens fed one per position from an empty state."""
    if matvec is None:
        def matvec(name, W, x):
            return W @ x
    w = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()
         if not k.startswith("golden.")}
    H, hd, eps = cfg.n_heads, cfg.head_dim, cfg.norm_eps
    if stack == "target":
        layers = [(f"layers.{i}.", cfg.layer_kind(i)) for i in range(cfg.n_layers)]
    elif stack == "draft":
        layers = [(f"draft.layers.{j}.", cfg.layer_kind(i)) for j, i in enumerate(cfg.draft_map)]
    else:
        raise ValueError(stack)

    # per-layer state
    S = {p: np.zeros((H, hd, hd)) for p, k in layers if k == "gdn"}
    hist = {p: [np.zeros(cfg.d_model), np.zeros(cfg.d_model)] for p, k in layers if k == "gdn"}
    keys = {p: [] for p, k in layers if k == "attn"}
    vals = {p: [] for p, k in layers if k == "attn"}

    out = []
    for pos, tok in enumerate(tokens):
        x = w["tok_emb.weight"][int(tok)].copy()
        for p, kind in layers:
            xn = _rmsnorm(x, w[p + "attn_norm.weight"], eps)
            mixed = np.zeros(H * hd)
            if kind == "gdn":
                conv = w[p + "mixer.conv"]
                x2, x1 = hist[p]
                u = _silu(conv[0] * x2 + conv[1] * x1 + conv[2] * xn)
                hist[p] = [x1, xn]
                qkv = matvec(p + "mixer.wqkv.weight", w[p + "mixer.wqkv.weight"], u)
                for h in range(H):
                    q = _unit(qkv[h * hd:(h + 1) * hd])
                    k = _unit(qkv[H * hd + h * hd:H * hd + (h + 1) * hd])
                    v = qkv[2 * H * hd + h * hd:2 * H * hd + (h + 1) * hd]
                    a = _sigmoid(w[p + "mixer.decay_logit"][h])
                    beta = _sigmoid(w[p + "mixer.beta_logit"][h])
                    Sh = S[p][h]
                    err = v - Sh @ k
                    Sh = a * Sh + beta * np.outer(err, k)
                    S[p][h] = Sh
                    mixed[h * hd:(h + 1) * hd] = Sh @ q / math.sqrt(hd)
            else:
                qkv = matvec(p + "mixer.wqkv.weight", w[p + "mixer.wqkv.weight"], xn)
                ks, vs = [], []
                qs = []
                for h in range(H):
                    qs.append(_rope(_unit(qkv[h * hd:(h + 1) * hd]), pos, cfg.rope_theta))
                    ks.append(_rope(_unit(qkv[H * hd + h * hd:H * hd + (h + 1) * hd]), pos, cfg.rope_theta))
                    vs.append(qkv[2 * H * hd + h * hd:2 * H * hd + (h + 1) * hd].copy())
                keys[p].append(ks)
                vals[p].append(vs)
                for h in range(H):
                    scores = np.array([math.sqrt(hd) * float(np.dot(qs[h], keys[p][t][h]))
                                       for t in range(pos + 1)])
                    e = np.exp(scores - scores.max())
                    pr = e / e.sum()
                    o = np.zeros(hd)
                    for t in range(pos + 1):
                        o += pr[t] * vals[p][t][h]
                    mixed[h * hd:(h + 1) * hd] = o
            x = x + matvec(p + "mixer.wo.weight", w[p + "mixer.wo.weight"], mixed)
            hn = _rmsnorm(x, w[p + "ffn_norm.weight"], eps)
            g = _silu(matvec(p + "mlp.w1.weight", w[p + "mlp.w1.weight"], hn)) * \
                matvec(p + "mlp.w3.weight", w[p + "mlp.w3.weight"], hn)
            x = x + matvec(p + "mlp.w2.weight", w[p + "mlp.w2.weight"], g)
        out.append(w["lm_head.weight"] @ _rmsnorm(x, w["final_norm.weight"], eps))
    return np.array(out)


def quantized_matvec(weights: dict):
    """A ``matvec(name, W, x)`` hook for forward_reference: quantized for the draft's
    projections, float64 W @ x for anything else."""
    cache = {}

    def matvec(name, W, x):
        leaf = name.split(".", 3)[-1] if name.startswith("draft.layers.") else None
        if leaf in Q8 or leaf in TERNARY:
            if name not in cache:
                w32 = np.asarray(weights[name], dtype=np.float32)
                cache[name] = quant.quantize_q8(w32) if leaf in Q8 else quant.quantize_ternary(w32)
            q, s = cache[name]
            xq, sx = quant.quantize_activation(np.asarray(x, dtype=np.float32))
            return quant._scale(s, sx, quant.dot_q8_int(q, xq)).astype(np.float64)
        return W @ x

    return matvec


def draft_logits_reference(cfg, weights: dict, tokens) -> np.ndarray:
    """Quantized-draft logits [n, V] (float64) for tokens fed one per position from reset."""
    return forward_reference(cfg, weights, list(tokens), stack="draft", matvec=quantized_matvec(weights))
