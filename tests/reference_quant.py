"""Numpy reference of the QUANTIZED draft (SPEC 3), for tests only.

It is tests/reference.py's independent float64 forward with the draft's linear maps
swapped for the reference quantized GEMVs of spel_mlx.quant: q8 wqkv/wo, ternary
w1/w3/w2, each input quantized per vector to int8, int32-exact dots.  Everything
else (norms, conv, delta rule, attention, FP32 head) stays float64, so the C engine
(float32) is compared against an independent, more precise computation.
"""
from __future__ import annotations

import numpy as np

from spel_mlx import quant

from reference import forward_reference

Q8 = ("mixer.wqkv.weight", "mixer.wo.weight")
TERNARY = ("mlp.w1.weight", "mlp.w3.weight", "mlp.w2.weight")


def quantized_matvec(weights: dict, q8_head: bool = False):
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
