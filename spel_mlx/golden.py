"""Golden logits of the SPELV001 footer (SPEC 6).

The n golden tokens are fed one per position from a reset state; the footer
holds the logits at each position for the FP32 target and for the QUANTIZED
draft (q8 wqkv/wo, ternary w1/w3/w2, per-vector int8 activations; SPEC 3).

Target: the MLX model (``SpelModel``, strict single-token steps).
Draft: the C engine ``spel_mlx.native.cdraft.CDraft`` when it can be imported and built;
otherwise the float64 reference's quantized draft (``spel_mlx.reference``, over
``spel_mlx.quant``: what the C engine is tested against).  ``golden_backends()`` says which paths ran.
"""
from __future__ import annotations


import numpy as np

from .config import ModelConfig
from .layout import tensor_specs

GOLDEN_N = 16


def golden_tokens(cfg: ModelConfig, seed: int, n: int = GOLDEN_N) -> np.ndarray:
    """n seeded tokens in 0..V-1 (uint32)."""
    rng = np.random.default_rng([seed, 0x5E1F])
    return rng.integers(0, cfg.vocab, size=n, dtype=np.uint32)


def _check_tokens(cfg: ModelConfig, tokens) -> list:
    toks = [int(t) for t in np.asarray(tokens).reshape(-1)]
    if not toks:
        raise ValueError("golden needs at least one token")
    if len(toks) > cfg.max_seq:
        raise ValueError(f"{len(toks)} golden tokens exceed max_seq={cfg.max_seq}")
    bad = [t for t in toks if not 0 <= t < cfg.vocab]
    if bad:
        raise ValueError(f"golden token {bad[0]} out of range 0..{cfg.vocab - 1}")
    return toks


# --------------------------------------------------------------------------- target

def target_logits_mlx(cfg: ModelConfig, weights: dict, tokens) -> np.ndarray:
    """FP32 target logits [n, V] from the MLX model, one strict step per token."""
    from .model import SpelModel
    import mlx.core as mx

    toks = _check_tokens(cfg, tokens)
    model = SpelModel.from_weights(cfg, weights)
    state = model.new_state("target")
    out = np.empty((len(toks), cfg.vocab), np.float32)
    for i, t in enumerate(toks):
        logits = model.forward([t], state, strict=True)
        state.commit(1)
        out[i] = np.array(logits, dtype=np.float32).reshape(-1)
    del model, state
    mx.clear_cache() if hasattr(mx, "clear_cache") else None
    return out


# --------------------------------------------------------------------------- draft

def draft_logits_c(cfg: ModelConfig, weights: dict, tokens) -> np.ndarray:
    """Quantized-draft logits [n, V] from the C engine (raises ImportError/OSError
    when the engine is unavailable)."""
    from .native.cdraft import CDraft

    toks = _check_tokens(cfg, tokens)
    d = CDraft(cfg, weights, threads=1)
    try:
        return np.stack([np.asarray(d.step(t), dtype=np.float32).reshape(-1) for t in toks])
    finally:
        d.close()


def draft_logits_numpy(cfg: ModelConfig, weights: dict, tokens) -> np.ndarray:
    """Quantized-draft logits [n, V] from the float64 reference (spel_mlx/reference.py)."""
    from .reference import draft_logits_reference
    return draft_logits_reference(cfg, weights, _check_tokens(cfg, tokens)).astype(np.float32)


# --------------------------------------------------------------------------- API

_last_backends = {"target": None, "draft": None}


def golden_backends() -> dict:
    """Which implementation computed the last golden target / draft logits."""
    return dict(_last_backends)


def compute_draft(cfg: ModelConfig, weights: dict, tokens, prefer: str = "auto") -> np.ndarray:
    """Quantized-draft logits; prefer 'c', 'numpy' or 'auto' (C when it loads)."""
    if prefer in ("auto", "c"):
        try:
            out = draft_logits_c(cfg, weights, tokens)
            _last_backends["draft"] = "c"
            return out
        except (ImportError, OSError, AttributeError) as e:
            if prefer == "c":
                raise
            _last_backends["draft_fallback_reason"] = f"{type(e).__name__}: {e}"
    out = draft_logits_numpy(cfg, weights, tokens)
    _last_backends["draft"] = "numpy-fakequant"
    return out


def target_logits_numpy(cfg: ModelConfig, weights: dict, tokens) -> np.ndarray:
    """FP32 target logits [n, V] from the float64 reference (spel_mlx/reference.py)."""
    from .reference import forward_reference
    return forward_reference(cfg, weights, _check_tokens(cfg, tokens), stack="target").astype(np.float32)


def compute_target(cfg: ModelConfig, weights: dict, tokens, prefer: str = "mlx") -> np.ndarray:
    """FP32 target logits; prefer 'mlx' (the model) or 'numpy' (the float64 reference)."""
    if prefer == "mlx":
        out = target_logits_mlx(cfg, weights, tokens)
        _last_backends["target"] = "mlx"
        return out
    if prefer != "numpy":
        raise ValueError(f"target backend {prefer!r}: expected 'mlx' or 'numpy'")
    out = target_logits_numpy(cfg, weights, tokens)
    _last_backends["target"] = "numpy"
    return out


def compute_golden(cfg: ModelConfig, weights: dict, tokens, draft: str = "auto", target: str = "mlx",
                   between=None) -> tuple:
    """(target_logits [n, V], draft_logits [n, V]) float32 for ``tokens`` fed one per
    position from a reset state.  ``between()`` runs after the target pass (synth uses
    it to drop mapped pages before the draft pass)."""
    missing = [s.name for s in tensor_specs(cfg) if s.name not in weights]
    if missing:
        raise ValueError(f"weights lack {missing[:3]}")
    t = compute_target(cfg, weights, tokens, prefer=target)
    if between is not None:
        between()
    return t, compute_draft(cfg, weights, tokens, prefer=draft)
