"""Golden logits of the SPELV001 footer (SPEC 6).

The n golden tokens are fed one per position from a reset state; the footer
holds the logits at each position for the FP32 target and for the QUANTIZED
draft (q8 wqkv/wo, ternary w1/w3/w2, per-vector int8 activations; SPEC 3).

Target: the MLX model (``SpelModel``, strict single-token steps).
Draft: the C engine ``spel_mlx.native.cdraft.CDraft`` when it can be imported and built;
otherwise a numpy fake-quant forward over ``spel_mlx.quant`` (the reference the
C engine is tested against).  ``golden_backends()`` says which paths ran.
"""
from __future__ import annotations

import math

import numpy as np

from .config import ModelConfig
from .layout import tensor_specs

GOLDEN_N = 16
L2_EPS = 1e-6


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


class NumpyStack:
    """A single-token numpy forward of the target (FP32) or the draft, the latter
    either FP32 or fake-quantized exactly as SPEC 3 (quantized weights, int8
    per-vector activations, int32-exact dot products)."""

    def __init__(self, cfg: ModelConfig, weights: dict, stack: str = "draft", quantized: bool = True):
        from . import quant

        self.cfg, self.quant = cfg, quant
        f32 = lambda n: np.asarray(weights[n], dtype=np.float32)  # noqa: E731
        self.emb, self.final_norm, self.head = f32("tok_emb.weight"), f32("final_norm.weight"), f32("lm_head.weight")
        if stack == "target":
            layers = [(f"layers.{i}.", cfg.layer_kind(i)) for i in range(cfg.n_layers)]
        else:
            layers = [(f"draft.layers.{j}.", cfg.layer_kind(src)) for j, src in enumerate(cfg.draft_map)]
        quantize = quantized and stack == "draft"
        self.layers = []
        for prefix, kind in layers:
            p = {"kind": kind, "attn_norm": f32(prefix + "attn_norm.weight"), "ffn_norm": f32(prefix + "ffn_norm.weight")}
            for short, name, scheme in (("wqkv", "mixer.wqkv.weight", "q8"), ("wo", "mixer.wo.weight", "q8"),
                                        ("w1", "mlp.w1.weight", "t"), ("w3", "mlp.w3.weight", "t"),
                                        ("w2", "mlp.w2.weight", "t")):
                w = f32(prefix + name)
                if quantize:
                    q, s = quant.quantize_q8(w) if scheme == "q8" else quant.quantize_ternary(w)
                    p[short] = ("q", q, s)
                else:
                    p[short] = ("f", w)
            if kind == "gdn":
                p["conv"] = f32(prefix + "mixer.conv")
                p["a"] = (1.0 / (1.0 + np.exp(-f32(prefix + "mixer.decay_logit").astype(np.float64)))).astype(np.float32)
                p["beta"] = (1.0 / (1.0 + np.exp(-f32(prefix + "mixer.beta_logit").astype(np.float64)))).astype(np.float32)
            self.layers.append(p)
        hd = cfg.head_dim
        self.inv_freq = (cfg.rope_theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd))
        self.reset()

    def reset(self):
        cfg = self.cfg
        H, hd, d = cfg.n_heads, cfg.head_dim, cfg.d_model
        self.pos = 0
        self.state = []
        for p in self.layers:
            if p["kind"] == "gdn":
                self.state.append({"S": np.zeros((H, hd, hd), np.float32), "tail": np.zeros((2, d), np.float32)})
            else:
                self.state.append({"k": [], "v": []})

    def _linear(self, w, x):
        if w[0] == "f":
            return (w[1] @ x).astype(np.float32)
        _, q, s = w
        xq, sx = self.quant.quantize_activation(x)
        return self.quant._scale(s, sx, self.quant.dot_q8_int(q, xq))

    def _rms(self, x, g):
        return (x / np.sqrt(np.mean(x.astype(np.float64) ** 2) + self.cfg.norm_eps) * g).astype(np.float32)

    @staticmethod
    def _silu(x):
        return (x / (1.0 + np.exp(-x.astype(np.float64)))).astype(np.float32)

    def _heads_l2(self, x):
        H, hd = self.cfg.n_heads, self.cfg.head_dim
        x = x.reshape(H, hd).astype(np.float64)
        return x / np.sqrt((x * x).sum(axis=1, keepdims=True) + L2_EPS)

    def step(self, token: int) -> np.ndarray:
        cfg = self.cfg
        H, hd, inner = cfg.n_heads, cfg.head_dim, cfg.inner
        x = self.emb[token].astype(np.float32)
        for p, st in zip(self.layers, self.state):
            xn = self._rms(x, p["attn_norm"])
            if p["kind"] == "gdn":
                c, tail = p["conv"], st["tail"]
                u = self._silu(c[0] * tail[0] + c[1] * tail[1] + c[2] * xn)
                st["tail"] = np.stack([tail[1], xn])
                qkv = self._linear(p["wqkv"], u)
                q, k = self._heads_l2(qkv[:inner]), self._heads_l2(qkv[inner:2 * inner])
                v = qkv[2 * inner:].reshape(H, hd).astype(np.float64)
                S = st["S"].astype(np.float64)
                a, b = p["a"].astype(np.float64), p["beta"].astype(np.float64)
                pred = np.einsum("hvk,hk->hv", S, k)
                S = a[:, None, None] * S + b[:, None, None] * np.einsum("hv,hk->hvk", v - pred, k)
                st["S"] = S.astype(np.float32)
                o = np.einsum("hvk,hk->hv", S, q) / math.sqrt(hd)
            else:
                qkv = self._linear(p["wqkv"], xn)
                q, k = self._heads_l2(qkv[:inner]), self._heads_l2(qkv[inner:2 * inner])
                v = qkv[2 * inner:].reshape(H, hd).astype(np.float64)
                ang = self.pos * self.inv_freq
                cos, sin = np.cos(ang), np.sin(ang)

                def rope(t):
                    e, o_ = t[:, 0::2], t[:, 1::2]
                    r = np.empty_like(t)
                    r[:, 0::2], r[:, 1::2] = e * cos - o_ * sin, e * sin + o_ * cos
                    return r
                q, k = rope(q), rope(k)
                st["k"].append(k)
                st["v"].append(v)
                K, Vv = np.stack(st["k"]), np.stack(st["v"])        # [T, H, hd]
                logits = math.sqrt(hd) * np.einsum("hd,thd->ht", q, K)
                w = np.exp(logits - logits.max(axis=1, keepdims=True))
                w /= w.sum(axis=1, keepdims=True)
                o = np.einsum("ht,thd->hd", w, Vv)
            h = x + self._linear(p["wo"], o.reshape(inner).astype(np.float32))
            hn = self._rms(h, p["ffn_norm"])
            m = self._silu(self._linear(p["w1"], hn)) * self._linear(p["w3"], hn)
            x = (h + self._linear(p["w2"], m.astype(np.float32))).astype(np.float32)
        self.pos += 1
        return (self.head @ self._rms(x, self.final_norm)).astype(np.float32)


def draft_logits_numpy(cfg: ModelConfig, weights: dict, tokens) -> np.ndarray:
    toks = _check_tokens(cfg, tokens)
    stack = NumpyStack(cfg, weights, "draft", quantized=True)
    return np.stack([stack.step(t) for t in toks])


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
    toks = _check_tokens(cfg, tokens)
    stack = NumpyStack(cfg, weights, "target", quantized=False)
    return np.stack([stack.step(t) for t in toks])


def compute_target(cfg: ModelConfig, weights: dict, tokens, prefer: str = "mlx") -> np.ndarray:
    """FP32 target logits; prefer 'mlx' (the model) or 'numpy' (NumpyStack)."""
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
