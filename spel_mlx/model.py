"""The hybrid Gated-DeltaNet + RoPE-attention model of SPEC 2, in MLX.

Modules read top to bottom: RMSNorm, GatedDeltaNet, Attention, MLP, Block,
SpelModel.  Parameter paths are exactly the names of ``spel_mlx.layout``
(``layers.{i}.``, ``draft.layers.{j}.``), so a weights dict loads as is.

The decoding state (KV caches, GDN rings) lives in ``spel_mlx.state``; the model
only reads the committed/pending slot and writes new slots.  Three sequence
primitives (short conv, delta rule, causal attention) go through a replaceable
``ops`` object (``MLXOps`` by default, Metal kernels in ``spel_mlx.kernels``).

Two paths compute the same function:
* the *step*: one token through a whole stack, one ``mx.compile``d call
  (compiled once per attention-window bucket).  Single-token forwards and
  every row of a strict forward run it, which makes strict batches
  bit-identical to sequential decoding by construction;
* the *batch*: M rows at once, projections as GEMMs (fast mode).
"""
from __future__ import annotations

import math

import numpy as np

from . import layout
from .config import ModelConfig
from .state import DecodeState, StateError

import mlx.core as mx  # noqa: E402  (after spel_mlx: the BLAS is loaded)
import mlx.nn as nn  # noqa: E402

L2_EPS = 1e-6  # inside the square root: x / sqrt(sum x^2 + eps)  (SPEC 2: "eps inside the norm")
MIN_WINDOW = 64  # smallest attention window of the step (windows are powers of two)


def l2_normalize(x: mx.array) -> mx.array:
    return x * mx.rsqrt(mx.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


# ---------------------------------------------------------------------------
# Replaceable sequence primitives
# ---------------------------------------------------------------------------
class MLXOps:
    """Default sequence primitives in plain MLX ops.

    A replacement (e.g. Metal kernels) subclasses this and overrides any
    method; shapes and meaning must stay the same.  All arrays are float32.
    """

    name = "mlx-ops"

    def conv_step(self, x, tail, conv):
        """Causal 3-tap depthwise conv + SiLU over M new rows.

        x [M,d] (normed input), tail [2,d] (the two inputs before x[0]),
        conv [3,d].  Returns u [M,d] = silu(conv0*x_{t-2} + conv1*x_{t-1} +
        conv2*x_t) and tails [M,2,d], tails[j] = (x_{j-1}, x_j), the conv
        state after row j.
        """
        M = x.shape[0]
        xs = mx.concatenate([tail, x], axis=0)  # [M+2, d]
        pre = conv[0] * xs[0:M] + conv[1] * xs[1:M + 1] + conv[2] * xs[2:M + 2]
        tails = mx.stack([xs[1:M + 1], xs[2:M + 2]], axis=1)
        return nn.silu(pre), tails

    def delta_rule(self, q, k, v, a, beta, S0):
        """Gated delta rule over M tokens.

        q, k, v [M,H,hd] (q, k already L2-normalized), a, beta [H] (already
        sigmoided), S0 [H,hd,hd] (rows index v, columns index k).
        S_t = a*S_{t-1} + beta*(v_t - S_{t-1} k_t) k_t^T,  o_t = S_t q_t / sqrt(hd).
        Returns o [M,H,hd] and S_all [M,H,hd,hd] (S after each token).
        """
        M, H, hd = q.shape
        a3 = a[:, None, None]
        b2 = beta[:, None]
        S = S0
        outs, states = [], []
        for t in range(M):
            kt = k[t]
            pred = (S @ kt[:, :, None])[..., 0]              # S k  [H,hd]
            err = b2 * (v[t] - pred)                         # beta (v - S k)
            S = a3 * S + err[:, :, None] * kt[:, None, :]    # + outer(err, k)
            outs.append((S @ q[t][:, :, None])[..., 0])
            states.append(S)
        o = mx.stack(outs) * (1.0 / math.sqrt(hd))
        return o, mx.stack(states)

    def attend(self, q, k_cache, v_cache, pos0, M):
        """Causal softmax attention of M queries against a KV cache.

        q [M,H,hd] (rotated, unit vectors), k_cache/v_cache [max_seq,H,hd]
        with this batch's k/v already written at pos0..pos0+M-1.  Query j sees
        positions <= pos0+j.  Score scale sqrt(hd) (SPEC 2).  Returns [M,H,hd].
        """
        hd = q.shape[-1]
        n = pos0 + M
        k = k_cache[:n].transpose(1, 2, 0)        # [H,hd,n]
        v = v_cache[:n].transpose(1, 0, 2)        # [H,n,hd]
        s = (q.transpose(1, 0, 2) @ k) * math.sqrt(hd)   # [H,M,n]
        if M > 1:
            qpos = mx.arange(pos0, n)[:, None]
            s = mx.where(mx.arange(n)[None, :] <= qpos, s, -mx.inf)
        p = mx.softmax(s, axis=-1)
        return (p @ v).transpose(1, 0, 2)

    def attend_step(self, q, k_win, v_win, pos, k_new, v_new):
        """One query at position ``pos`` (an int32 scalar array).

        k_win/v_win [W,H,hd] are the first W cache rows (W > pos; rows >= pos
        are stale and masked), k_new/v_new [H,hd] the current token's k/v (not
        yet in the cache).  Returns [H,hd].  Used inside the compiled step.
        """
        hd = q.shape[-1]
        scale = math.sqrt(hd)
        W = k_win.shape[0]
        s_old = mx.sum(k_win * q[None], axis=-1) * scale          # [W,H]
        s_old = mx.where(mx.arange(W)[:, None] < pos, s_old, -mx.inf)
        s_new = mx.sum(k_new * q, axis=-1, keepdims=True).T * scale  # [1,H]
        m = mx.maximum(mx.max(s_old, axis=0, keepdims=True), s_new)
        p_old = mx.exp(s_old - m)
        p_new = mx.exp(s_new - m)
        den = mx.sum(p_old, axis=0) + p_new[0]                   # [H]
        num = mx.sum(p_old[:, :, None] * v_win, axis=0) + p_new[0][:, None] * v_new
        return num / den[:, None]


DEFAULT_OPS = MLXOps()


# ---------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = mx.ones((d,))
        self.eps = eps

    def __call__(self, x):
        return mx.fast.rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) * (w3 x))."""

    def __init__(self, d: int, ff: int):
        super().__init__()
        self.w1 = nn.Linear(d, ff, bias=False)
        self.w3 = nn.Linear(d, ff, bias=False)
        self.w2 = nn.Linear(ff, d, bias=False)

    def __call__(self, x):
        return self.w2(nn.silu(self.w1(x)) * self.w3(x))


class GatedDeltaNet(nn.Module):
    """Short conv -> qkv -> L2 norm -> gated delta rule -> wo (SPEC 2)."""

    kind = "gdn"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, H = cfg.d_model, cfg.n_heads
        self.n_heads, self.head_dim = H, cfg.head_dim
        self.conv = mx.zeros((3, d))
        self.wqkv = nn.Linear(d, 3 * cfg.inner, bias=False)
        self.wo = nn.Linear(cfg.inner, d, bias=False)
        self.decay_logit = mx.zeros((H,))
        self.beta_logit = mx.zeros((H,))

    def qkv(self, u):
        """u [M,d] -> unit q, unit k, v, each [M,H,hd]."""
        M = u.shape[0]
        qkv = self.wqkv(u).reshape(M, 3, self.n_heads, self.head_dim)
        return l2_normalize(qkv[:, 0]), l2_normalize(qkv[:, 1]), qkv[:, 2]

    def __call__(self, x, S0, tail, ops):
        """x [M,d] normed input.  Returns out [M,d], S_all, tails, q, k."""
        u, tails = ops.conv_step(x, tail, self.conv)
        q, k, v = self.qkv(u)
        o, S_all = ops.delta_rule(q, k, v, mx.sigmoid(self.decay_logit),
                                  mx.sigmoid(self.beta_logit), S0)
        return self.wo(o.reshape(x.shape[0], -1)), S_all, tails, q, k


class Attention(nn.Module):
    """Causal attention with unit q/k, interleaved RoPE, scale sqrt(hd) (SPEC 2)."""

    kind = "attn"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.wqkv = nn.Linear(cfg.d_model, 3 * cfg.inner, bias=False)
        self.wo = nn.Linear(cfg.inner, cfg.d_model, bias=False)

    def rope(self, x, offset):
        """x [M,H,hd]; row j is at position offset+j.  Pairs (2i, 2i+1)."""
        y = mx.fast.rope(x.transpose(1, 0, 2)[None], self.head_dim, traditional=True,
                         base=self.rope_theta, scale=1.0, offset=offset)
        return y[0].transpose(1, 0, 2)

    def qkv(self, x, offset):
        """x [M,d] -> rotated unit q, rotated unit k, v, each [M,H,hd]."""
        M = x.shape[0]
        qkv = self.wqkv(x).reshape(M, 3, self.n_heads, self.head_dim)
        q = self.rope(l2_normalize(qkv[:, 0]), offset)
        k = self.rope(l2_normalize(qkv[:, 1]), offset)
        return q, k, qkv[:, 2]

    def __call__(self, x, k_cache, v_cache, pos0, ops):
        """Batch path: writes k/v into the caches at pos0.. (in place), attends.

        Returns out [M,d] and the updated caches.
        """
        M = x.shape[0]
        q, k, v = self.qkv(x, pos0)
        k_cache[pos0:pos0 + M] = k
        v_cache[pos0:pos0 + M] = v
        o = ops.attend(q, k_cache, v_cache, pos0, M)
        return self.wo(o.reshape(M, -1)), k_cache, v_cache


class Block(nn.Module):
    """x + mixer(rmsnorm(x)), then + SwiGLU(rmsnorm(.))."""

    def __init__(self, cfg: ModelConfig, kind: str):
        super().__init__()
        self.kind = kind
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = GatedDeltaNet(cfg) if kind == "gdn" else Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg.d_model, cfg.d_ff)

    def ffn(self, h):
        return h + self.mlp(self.ffn_norm(h))


class DraftStack(nn.Module):
    """The draft's own layers (``draft.layers.{j}``); embedding/norm/head are shared."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = [Block(cfg, cfg.layer_kind(i)) for i in cfg.draft_map]


class SpelModel(nn.Module):
    """Target stack + FP32 draft stack sharing tok_emb, final_norm, lm_head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg.validate()
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = [Block(cfg, cfg.layer_kind(i)) for i in range(cfg.n_layers)]
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.draft = DraftStack(cfg)
        self._ops = DEFAULT_OPS
        self._steps = {}   # (stack, window) -> compiled step

    # --- weights ------------------------------------------------------------
    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: dict) -> "SpelModel":
        model = cls(cfg)
        model.load_weights_dict(weights)
        return model

    def load_weights_dict(self, weights: dict) -> None:
        """Load ``{name: array}`` with exactly the names/shapes of layout.py."""
        specs = layout.tensor_specs(self.cfg)
        want = {s.name: s.shape for s in specs}
        missing = [n for n in want if n not in weights]
        extra = [n for n in weights if n not in want and not n.startswith("golden.")]
        if missing or extra:
            raise ValueError(f"weights do not match the config: missing {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
                             f"{' ...' if len(extra) > 5 else ''}")
        items = []
        for name, shape in want.items():
            w = weights[name]
            if tuple(w.shape) != tuple(shape):
                raise ValueError(f"tensor {name}: shape {tuple(w.shape)}, expected {tuple(shape)}")
            items.append((name, mx.array(np.asarray(w, dtype=np.float32))))
        self.load_weights(items, strict=True)
        mx.eval(self.parameters())
        self._steps.clear()

    def weights_dict(self) -> dict:
        """``{name: np.float32 array}`` in layout order."""
        flat = dict(_flatten(self.parameters()))
        return {s.name: np.array(flat[s.name], dtype=np.float32) for s in layout.tensor_specs(self.cfg)}

    # --- ops -----------------------------------------------------------------
    @property
    def ops(self):
        return self._ops

    def set_ops(self, ops) -> None:
        """Swap the sequence primitives (see MLXOps); recompiles the step."""
        self._ops = DEFAULT_OPS if ops is None else ops
        self._steps.clear()

    # --- state ---------------------------------------------------------------
    def stack_layers(self, stack: str) -> list:
        if stack == "target":
            return self.layers
        if stack == "draft":
            return self.draft.layers
        raise ValueError(f"stack must be 'target' or 'draft', not {stack!r}")

    def new_state(self, stack: str = "target", ring: int | None = None) -> DecodeState:
        self.stack_layers(stack)
        ring = self.cfg.spec_k + 1 if ring is None else ring
        return DecodeState(self.cfg, stack, ring)

    # --- forward -------------------------------------------------------------
    def forward(self, tokens, state: DecodeState, strict: bool = False, stack: str | None = None,
                capture: dict | None = None) -> mx.array:
        """Run M tokens after the state's last written position; no commit.

        Returns logits [M, V] float32.  strict: every row runs the single-token
        step (bit-identical to M single-token calls).  capture: filled with
        ``capture[layer] = {"q": [M,H,hd], "k": [M,H,hd]}`` per GDN layer
        (layer = index within the stack).
        """
        stack = state.stack if stack is None else stack
        if stack != state.stack:
            raise ValueError(f"state belongs to the {state.stack!r} stack, not {stack!r}")
        toks = _token_list(tokens, self.cfg.vocab)
        M = len(toks)
        state.check_room(M)
        if M == 1 or strict:
            rows = [self._step(t, state, capture) for t in toks]
            logits = rows[0] if M == 1 else mx.concatenate(rows, axis=0)
            if capture is not None and M > 1:
                for layer, d in capture.items():
                    if isinstance(d.get("q"), list):
                        capture[layer] = {"q": mx.concatenate(d["q"]), "k": mx.concatenate(d["k"])}
            elif capture is not None:
                for layer, d in capture.items():
                    if isinstance(d.get("q"), list):
                        capture[layer] = {"q": d["q"][0], "k": d["k"][0]}
            return logits
        return self._batch(toks, state, capture)

    def prefill(self, tokens, state: DecodeState, stack: str | None = None, strict: bool = False) -> mx.array:
        """Feed a prompt in chunks of the ring size, committing each; last logits [V]."""
        toks = _token_list(tokens, self.cfg.vocab)
        if not toks:
            raise ValueError("prefill needs at least one token")
        if state.pending:
            raise StateError("prefill needs a committed state (commit or discard the pending tokens)")
        logits = None
        R = state.ring
        for i in range(0, len(toks), R):
            chunk = toks[i:i + R]
            logits = self.forward(chunk, state, strict=strict, stack=stack)
            state.commit(len(chunk))
        return logits[-1]

    __call__ = forward

    # --- batch path (fast mode) ---------------------------------------------
    def _batch(self, toks, state: DecodeState, capture):
        ops = self._ops
        M = len(toks)
        base = state.pos + state.pending
        x = self.tok_emb(mx.array(toks, dtype=mx.int32))
        for li, blk in enumerate(self.stack_layers(state.stack)):
            xn = blk.attn_norm(x)
            if blk.kind == "gdn":
                S0, tail0 = state.current_gdn(li)
                out, S_all, tails, q, k = blk.mixer(xn, S0, tail0, ops)
                state.write_gdn(li, [S_all[j] for j in range(M)], [tails[j] for j in range(M)])
                if capture is not None:
                    capture[li] = {"q": q, "k": k}
            else:
                kc, vc = state.kv(li)
                out, kc, vc = blk.mixer(xn, kc, vc, base, ops)
                state.set_kv(li, kc, vc)
            x = blk.ffn(x + out)
        state.advance(M)
        return self.lm_head(self.final_norm(x))

    # --- step path (one token, compiled) ------------------------------------
    def _step(self, token: int, state: DecodeState, capture):
        base = state.pos + state.pending
        window = _window(base, self.cfg.max_seq)
        key = (state.stack, window)
        fn = self._steps.get(key)
        if fn is None:
            fn = self._steps[key] = self._make_step(state.stack)
        layers = self.stack_layers(state.stack)
        gdn_in, kv_in = [], []
        for li, blk in enumerate(layers):
            if blk.kind == "gdn":
                gdn_in.extend(state.current_gdn(li))
            else:
                kc, vc = state.kv(li)
                kv_in += [kc[:window], vc[:window]]
        outs = fn(self._step_params(state.stack), mx.array([token], dtype=mx.int32),
                  mx.array(base, dtype=mx.int32), gdn_in, kv_in)
        logits, gdn_out, kv_new, qk = outs
        gi = ai = 0
        for li, blk in enumerate(layers):
            if blk.kind == "gdn":
                state.write_gdn(li, [gdn_out[2 * gi]], [gdn_out[2 * gi + 1]])
                if capture is not None:
                    capture.setdefault(li, {"q": [], "k": []})
                    capture[li]["q"].append(qk[2 * gi])
                    capture[li]["k"].append(qk[2 * gi + 1])
                gi += 1
            else:
                kc, vc = state.kv(li)
                kc[base:base + 1] = kv_new[2 * ai]
                vc[base:base + 1] = kv_new[2 * ai + 1]
                state.set_kv(li, kc, vc)
                ai += 1
        state.advance(1)
        return logits

    def _step_params(self, stack):
        return [self.tok_emb.weight, self.final_norm.weight, self.lm_head.weight] + \
            [p for blk in self.stack_layers(stack) for _, p in _flatten(blk.parameters())]

    def _make_step(self, stack: str):
        """Build the compiled single-token step of one stack.

        Inputs: the stack's parameters (explicit, so reloading weights needs
        no recompilation trick), token [1], pos (int32 scalar), the GDN
        states [S, tail]*, and the attention windows [k_win, v_win]*.
        Outputs: logits [1,V], new [S [1,H,hd,hd]... as S_all, tails],
        the new [k, v] rows [1,H,hd], and the GDN [q, k] for capture.
        """
        ops = self._ops
        layers = self.stack_layers(stack)
        names = [[n for n, _ in _flatten(blk.parameters())] for blk in layers]
        model = self

        def step(params, token, pos, gdn_in, kv_in):
            emb, fnorm, head = params[0], params[1], params[2]
            x = emb[token]
            at = 3
            gi = ai = 0
            gdn_out, kv_new, qk = [], [], []
            for blk, pnames in zip(layers, names):
                p = dict(zip(pnames, params[at:at + len(pnames)]))
                at += len(pnames)
                xn = mx.fast.rms_norm(x, p["attn_norm.weight"], model.cfg.norm_eps)
                if blk.kind == "gdn":
                    mix = blk.mixer
                    u, tails = ops.conv_step(xn, gdn_in[2 * gi + 1], p["mixer.conv"])
                    qkv = (u @ p["mixer.wqkv.weight"].T).reshape(1, 3, mix.n_heads, mix.head_dim)
                    q, k, v = l2_normalize(qkv[:, 0]), l2_normalize(qkv[:, 1]), qkv[:, 2]
                    o, S_all = ops.delta_rule(q, k, v, mx.sigmoid(p["mixer.decay_logit"]),
                                              mx.sigmoid(p["mixer.beta_logit"]), gdn_in[2 * gi])
                    gdn_out += [S_all[0], tails[0]]
                    qk += [q, k]
                    gi += 1
                    out = o.reshape(1, -1) @ p["mixer.wo.weight"].T
                else:
                    mix = blk.mixer
                    qkv = (xn @ p["mixer.wqkv.weight"].T).reshape(1, 3, mix.n_heads, mix.head_dim)
                    q = mix.rope(l2_normalize(qkv[:, 0]), pos)
                    k = mix.rope(l2_normalize(qkv[:, 1]), pos)
                    v = qkv[:, 2]
                    o = ops.attend_step(q[0], kv_in[2 * ai], kv_in[2 * ai + 1], pos, k[0], v[0])
                    kv_new += [k, v]
                    ai += 1
                    out = o.reshape(1, -1) @ p["mixer.wo.weight"].T
                h = x + out
                hn = mx.fast.rms_norm(h, p["ffn_norm.weight"], model.cfg.norm_eps)
                g = nn.silu(hn @ p["mlp.w1.weight"].T) * (hn @ p["mlp.w3.weight"].T)
                x = h + g @ p["mlp.w2.weight"].T
            logits = mx.fast.rms_norm(x, fnorm, model.cfg.norm_eps) @ head.T
            return logits, gdn_out, kv_new, qk

        return mx.compile(step)


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}{k}.")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _flatten(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def _window(pos: int, max_seq: int) -> int:
    """Attention window of the step: the smallest power of two > pos (>= MIN_WINDOW)."""
    w = MIN_WINDOW
    while w <= pos:
        w *= 2
    return min(w, max_seq)


def _token_list(tokens, vocab: int) -> list:
    if isinstance(tokens, mx.array):
        tokens = np.array(tokens)
    if isinstance(tokens, (int, np.integer)):
        tokens = [tokens]
    out = [int(t) for t in np.asarray(tokens).reshape(-1)]
    for t in out:
        if not 0 <= t < vocab:
            raise ValueError(f"token {t} out of range 0..{vocab - 1}")
    return out


def init_weights(cfg: ModelConfig, seed: int = 0, scale: float = 1.0) -> dict:
    """Random weights with realistic scales, ``{name: np.float32}`` in layout order.

    Linear maps ~ N(0, scale/sqrt(fan_in)); embedding ~ N(0, 1); norms 1 with
    a little jitter; conv taps around (0.1, 0.2, 0.7) so the current input
    dominates; decay logits in [1, 4] (a = 0.73..0.98) and beta logits in
    [-1, 1] as trained models show.  draft layers get their own draws.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for spec in layout.tensor_specs(cfg):
        name, shape = spec.name, spec.shape
        leaf = name.rsplit(".", 2)
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
        del leaf
        out[name] = np.ascontiguousarray(w, dtype=np.float32)
    return out
