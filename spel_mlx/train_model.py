"""Functional MLX forward for training (SPEC 2 math), over a flat params dict
named exactly as spel_mlx/layout.py, so a trained dict loads into SpelModel.

Batched [B, T] token arrays, no decoding state.  The GDN delta rule runs in a
chunked-parallel form (``gdn_chunked``) that is algebraically the recurrence
``S_t = a S_{t-1} + b (v_t - S_{t-1} k_t) k_t^T``; ``gdn_recurrent`` is the plain
loop it is tested against.  Draft layers can run with SPEC 3 fake quantization
(q8 / ternary weights, per-vector int8 activations) and straight-through
gradients for QAT.
"""
from __future__ import annotations

import math

import numpy as np

from . import layout
from .config import ModelConfig

import mlx.core as mx  # noqa: E402  (spel_mlx loaded the BLAS first)

QK_EPS = 1e-6


# --- initialisation -------------------------------------------------------
def init_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Random init (numpy, reproducible) for target and draft, as float32 mx arrays."""
    rng = np.random.default_rng(seed)
    out = {}
    d, L = cfg.d_model, cfg.n_layers
    resid_scale = 1.0 / math.sqrt(2 * L)
    for spec in layout.tensor_specs(cfg):
        n, shp = spec.name, spec.shape
        if n.endswith("norm.weight"):
            w = np.ones(shp, np.float32)
        elif n.endswith("mixer.conv"):
            w = np.zeros(shp, np.float32)
            w[2] = 1.0  # start as identity on the current token
            w += rng.normal(0, 0.02, shp).astype(np.float32)
        elif n.endswith("decay_logit"):
            a = np.linspace(0.90, 0.995, shp[0])  # per-head memory horizons 10..200 tokens
            w = np.log(a / (1 - a)).astype(np.float32)
        elif n.endswith("beta_logit"):
            w = np.zeros(shp, np.float32)
        elif n == "tok_emb.weight":
            w = rng.normal(0, 1.0, shp).astype(np.float32)
        else:
            fan_in = shp[1]
            std = 1.0 / math.sqrt(fan_in)
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


# --- SPEC 3 fake quantization (forward = quantized value, backward = identity) ---
def _ste(x, xq):
    return x + mx.stop_gradient(xq - x)


def fq_q8_rows(w):
    """q8 per output row: s = max|w|/127, q = round(w/s) in [-127, 127]."""
    s = mx.max(mx.abs(w), axis=1, keepdims=True) / 127.0
    safe = mx.where(s > 0, s, 1.0)
    q = mx.clip(mx.round(w / safe), -127, 127)
    return q * s


def ternary_scale_codes(w, refinements: int = 3):
    """(q in {-1,0,1}, s [R,1]) per SPEC 3: s = mean|w|, then 3 least-squares refinements."""
    s = mx.mean(mx.abs(w), axis=1, keepdims=True)
    for _ in range(refinements):
        safe = mx.where(s > 0, s, 1.0)
        q = mx.clip(mx.round(w / safe), -1, 1)
        qq = mx.sum(q * q, axis=1, keepdims=True)
        s = mx.where(qq > 0, mx.sum(w * q, axis=1, keepdims=True) / mx.where(qq > 0, qq, 1.0), s)
    safe = mx.where(s > 0, s, 1.0)
    q = mx.clip(mx.round(w / safe), -1, 1)
    return q, s


def fq_ternary_rows(w):
    q, s = ternary_scale_codes(w)
    return q * s


def fq_act(x):
    """Per-vector (last axis) int8: s = max|x|/127, x_q = round(x/s); zeros stay zeros."""
    s = mx.max(mx.abs(x), axis=-1, keepdims=True) / 127.0
    safe = mx.where(s > 0, s, 1.0)
    return mx.clip(mx.round(x / safe), -127, 127) * s


def _linear(x, w, quant: str | None):
    """y = W x for x [..., in]; quant None | 'q8' | 'ternary' (QAT with STE)."""
    if quant is None:
        return x @ w.T
    xq = _ste(x, fq_act(x))
    wq = _ste(w, fq_q8_rows(w) if quant == "q8" else fq_ternary_rows(w))
    return xq @ wq.T


# --- GDN delta rule -----------------------------------------------------------
def gdn_recurrent(q, k, v, a, beta, S0=None):
    """Reference loop. q,k,v [B,H,T,hd] (q,k unit); a,beta [H]. Returns (o [B,H,T,hd], S [B,H,hd,hd]).
    o_t = S_t q_t / sqrt(hd)."""
    B, H, T, hd = q.shape
    S = mx.zeros((B, H, hd, hd), q.dtype) if S0 is None else S0
    a4, b4 = a.reshape(1, H, 1, 1), beta.reshape(1, H, 1, 1)
    outs = []
    for t in range(T):
        kt, vt, qt = k[:, :, t, :, None], v[:, :, t, :, None], q[:, :, t, :, None]
        S = a4 * S + b4 * ((vt - S @ kt) @ mx.swapaxes(kt, -1, -2))
        outs.append((S @ qt)[..., 0])
    return mx.stack(outs, axis=2) / math.sqrt(hd), S


@mx.custom_function
def _unit_lower_inv(A):
    return mx.linalg.tri_inv(A, upper=False, stream=mx.cpu)


@_unit_lower_inv.vjp
def _unit_lower_inv_vjp(primals, cotangent, output):
    # d(A^-1) = -A^-1 dA A^-1  =>  dL/dA = -A^-T G A^-T (only the strict lower part is used)
    Tt = mx.swapaxes(output, -1, -2)
    return (mx.tril(-(Tt @ cotangent @ Tt), -1),)


def gdn_chunked(q, k, v, a, beta, chunk: int = 64, S0=None):
    """Chunked-parallel delta rule, equal to gdn_recurrent (S is None when T % chunk != 0).

    Within a chunk (positions t = 1..C, state S0 before it), with u_s the
    per-token corrections b(v_s - S_{s-1} k_s):
        (I + b M) U = b (V - diag(a^{t-1}) K S0^T),  M[t,s] = a^{t-1-s} k_t.k_s (s < t)
        O = diag(a^t) Q S0^T + (G * Q K^T) U,          G[t,s] = a^{t-s} (s <= t)
        S_C = a^C S0 + U^T diag(a^{C-s}) K
    The unit-lower-triangular inverse depends only on K, so it is batched over
    all chunks; only the cheap state hand-off runs chunk by chunk.
    """
    B, H, T, hd = q.shape
    C = min(chunk, T)
    pad = (-T) % C
    if pad:
        z = [(0, 0), (0, 0), (0, pad), (0, 0)]
        q, k, v = mx.pad(q, z), mx.pad(k, z), mx.pad(v, z)
    N = (T + pad) // C
    q = q.reshape(B, H, N, C, hd)
    k = k.reshape(B, H, N, C, hd)
    v = v.reshape(B, H, N, C, hd)
    loga = mx.log(a).reshape(1, H, 1, 1, 1)
    bcol = beta.reshape(1, H, 1, 1, 1)
    t = mx.arange(1, C + 1, dtype=mx.float32)
    diff = t[:, None] - t[None, :]                         # t - s
    lower_strict = diff > 0
    lower_incl = diff >= 0
    G = mx.where(lower_incl, mx.exp(loga * mx.maximum(diff, 0)), 0.0)          # [1,H,1,C,C]
    Gm = mx.where(lower_strict, mx.exp(loga * mx.maximum(diff - 1, 0)), 0.0)
    d_prev = mx.exp(loga * (t - 1).reshape(C, 1))          # a^{t-1}  [1,H,1,C,1]
    d_cur = mx.exp(loga * t.reshape(C, 1))                 # a^t
    d_end = mx.exp(loga * (C - t).reshape(C, 1))           # a^{C-s}
    aC = mx.exp(loga * C).reshape(1, H, 1, 1)
    kk = k @ mx.swapaxes(k, -1, -2)
    A = mx.eye(C) + bcol * (Gm * kk)
    Tinv = _unit_lower_inv(A)
    W = Tinv @ (bcol * d_prev * k)                         # U = Uv - W S0^T
    Uv = Tinv @ (bcol * v)
    QK = G * (q @ mx.swapaxes(k, -1, -2))
    Ke = d_end * k
    Qc = d_cur * q
    S = mx.zeros((B, H, hd, hd), q.dtype) if S0 is None else S0
    outs = []
    for n in range(N):
        St = mx.swapaxes(S, -1, -2)
        U = Uv[:, :, n] - W[:, :, n] @ St
        outs.append(Qc[:, :, n] @ St + QK[:, :, n] @ U)
        S = aC * S + mx.swapaxes(U, -1, -2) @ Ke[:, :, n]
    o = mx.stack(outs, axis=2).reshape(B, H, N * C, hd)[:, :, :T]
    # Zero-padded tail tokens would still decay S, so the final state is only
    # returned when T is a multiple of the chunk (training never needs it).
    return o / math.sqrt(hd), (None if pad else S)


# --- layers -----------------------------------------------------------------
def _heads(x, B, T, H, hd):
    return x.reshape(B, T, H, hd).transpose(0, 2, 1, 3)


def _unit(x):
    return x * mx.rsqrt(mx.sum(x * x, axis=-1, keepdims=True) + QK_EPS)


def gdn_mixer(p: dict, pre: str, x, cfg: ModelConfig, quant: bool, chunk: int):
    B, T, d = x.shape
    H, hd = cfg.n_heads, cfg.head_dim
    conv = p[pre + "mixer.conv"]
    xp = mx.pad(x, [(0, 0), (2, 0), (0, 0)])
    u = conv[0] * xp[:, :-2] + conv[1] * xp[:, 1:-1] + conv[2] * xp[:, 2:]
    u = u * mx.sigmoid(u)
    qkv = _linear(u, p[pre + "mixer.wqkv.weight"], "q8" if quant else None)
    inner = H * hd
    q = _unit(_heads(qkv[..., :inner], B, T, H, hd))
    k = _unit(_heads(qkv[..., inner:2 * inner], B, T, H, hd))
    v = _heads(qkv[..., 2 * inner:], B, T, H, hd)
    a = mx.sigmoid(p[pre + "mixer.decay_logit"])
    beta = mx.sigmoid(p[pre + "mixer.beta_logit"])
    o, _ = gdn_chunked(q, k, v, a, beta, chunk=chunk)
    o = o.transpose(0, 2, 1, 3).reshape(B, T, inner)
    return _linear(o, p[pre + "mixer.wo.weight"], "q8" if quant else None)


def attn_mixer(p: dict, pre: str, x, cfg: ModelConfig, quant: bool):
    B, T, d = x.shape
    H, hd = cfg.n_heads, cfg.head_dim
    inner = H * hd
    qkv = _linear(x, p[pre + "mixer.wqkv.weight"], "q8" if quant else None)
    q = _unit(_heads(qkv[..., :inner], B, T, H, hd))
    k = _unit(_heads(qkv[..., inner:2 * inner], B, T, H, hd))
    v = _heads(qkv[..., 2 * inner:], B, T, H, hd)
    q = mx.fast.rope(q, hd, traditional=True, base=cfg.rope_theta, scale=1.0, offset=0)
    k = mx.fast.rope(k, hd, traditional=True, base=cfg.rope_theta, scale=1.0, offset=0)
    o = mx.fast.scaled_dot_product_attention(q, k, v, scale=math.sqrt(hd), mask="causal")
    o = o.transpose(0, 2, 1, 3).reshape(B, T, inner)
    return _linear(o, p[pre + "mixer.wo.weight"], "q8" if quant else None)


def block(p: dict, pre: str, kind: str, x, cfg: ModelConfig, quant: bool = False, chunk: int = 64):
    eps = cfg.norm_eps
    xn = mx.fast.rms_norm(x, p[pre + "attn_norm.weight"], eps)
    if kind == "gdn":
        h = x + gdn_mixer(p, pre, xn, cfg, quant, chunk)
    else:
        h = x + attn_mixer(p, pre, xn, cfg, quant)
    hn = mx.fast.rms_norm(h, p[pre + "ffn_norm.weight"], eps)
    tq = "ternary" if quant else None
    g = _linear(hn, p[pre + "mlp.w1.weight"], tq)
    up = _linear(hn, p[pre + "mlp.w3.weight"], tq)
    return h + _linear(g * mx.sigmoid(g) * up, p[pre + "mlp.w2.weight"], tq)


def forward(p: dict, tokens, cfg: ModelConfig, stack: str = "target", quant: bool = False,
            chunk: int = 64):
    """logits [B, T, V] for tokens [B, T] (int32)."""
    x = p["tok_emb.weight"][tokens]
    if stack == "target":
        for i in range(cfg.n_layers):
            x = block(p, f"layers.{i}.", cfg.layer_kind(i), x, cfg, False, chunk)
    else:
        for j, src in enumerate(cfg.draft_map):
            x = block(p, f"draft.layers.{j}.", cfg.layer_kind(src), x, cfg, quant, chunk)
    x = mx.fast.rms_norm(x, p["final_norm.weight"], cfg.norm_eps)
    return x @ p["lm_head.weight"].T


def cross_entropy(logits, targets):
    """mean next-token NLL in nats."""
    lse = mx.logsumexp(logits, axis=-1)
    picked = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return mx.mean(lse - picked)


def kl_target_draft(t_logits, d_logits):
    """mean KL(target || draft) per position, in nats."""
    tl = t_logits - mx.logsumexp(t_logits, axis=-1, keepdims=True)
    dl = d_logits - mx.logsumexp(d_logits, axis=-1, keepdims=True)
    return mx.mean(mx.sum(mx.exp(tl) * (tl - dl), axis=-1))
