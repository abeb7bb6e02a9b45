"""SpelModel: the target stack and the FP32 draft stack sharing tok_emb, final_norm, lm_head.

Parameter paths are exactly the names of ``spel_mlx.layout`` (``layers.{i}.``,
``draft.layers.{j}.``), so a weights dict loads as is.  Two forwards over the
same layers: ``forward`` decodes M tokens over a ``DecodeState`` (one compiled
pass, see passes.py), ``batch_logits`` runs [B, T] batches from the zero state
for training.
"""
from __future__ import annotations

import numpy as np

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .. import layout
from ..config import ModelConfig
from .state import DecodeState, StateError
from .backends import auto_ops, device_name, runs_on
from .layers import Block, DraftStack, RMSNorm
from .linear import Linear, row_block
from .passes import run_pass
from .training_ops import TrainingOps


class SpelModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg.validate()
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = [Block(cfg, cfg.layer_kind(i)) for i in range(cfg.n_layers)]
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = Linear(cfg.d_model, cfg.vocab)
        self.draft = DraftStack(cfg)
        # device ("cpu" | "gpu") -> its ops, made on first use there (one model may run
        # passes on both: a GPU target beside its MLX draft layers on the CPU)
        object.__setattr__(self, "_ops_by_device", {})
        object.__setattr__(self, "_compile", True)
        # (stack, M, window, device) -> compiled pass; kept out of the module tree
        object.__setattr__(self, "_compiled", {})
        # passes built so far: a round that built one paid for tracing it (decoding.loop)
        object.__setattr__(self, "passes_built", 0)
        # the K/V cache dtype of the states new_state makes ("float32": SPEC's exact model)
        object.__setattr__(self, "kv_cache", "float32")

    # --- weights ------------------------------------------------------------------
    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: dict) -> "SpelModel":
        model = cls(cfg)
        model.load_weights_dict(weights)
        return model

    def load_weights_dict(self, weights: dict) -> None:
        """Load ``{name: array}`` with exactly the names/shapes of layout.py."""
        want = {s.name: s.shape for s in layout.tensor_specs(self.cfg)}
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
            items.append((name, w if isinstance(w, mx.array) and w.dtype == mx.float32
                          else mx.array(np.asarray(w, dtype=np.float32))))
        self.load_weights(items, strict=True)
        mx.eval(self.parameters())

    def update(self, parameters: dict, strict: bool = True):
        """nn.Module.update; also drops the compiled passes (they hold the old arrays)."""
        self._compiled.clear()
        return super().update(parameters, strict=strict)

    def weights_dict(self) -> dict:
        """``{name: np.float32 array}`` in layout order."""
        flat = dict(tree_flatten(self.parameters()))
        return {s.name: np.array(flat[s.name], dtype=np.float32) for s in layout.tensor_specs(self.cfg)}

    @property
    def compile(self) -> bool:
        """True: passes run mx.compile'd; False: the same functions eagerly (debugging,
        host-reading ops).  Changing it drops the cached passes."""
        return self._compile

    @compile.setter
    def compile(self, value: bool) -> None:
        object.__setattr__(self, "_compile", bool(value))
        self._compiled.clear()

    # --- ops ------------------------------------------------------------------------
    @property
    def ops(self):
        """The ops of the current default device."""
        return self.ops_for(device_name())

    def ops_for(self, device: str):
        """The ops of ``device`` ("cpu" | "gpu"): ``auto_ops`` there until set."""
        dev = device_name(device)
        ops = self._ops_by_device.get(dev)
        if ops is None:
            ops = self._ops_by_device[dev] = auto_ops(dev)
        return ops

    def set_ops(self, ops, device=None) -> None:
        """Swap the ops of ``device`` ("cpu" | "gpu"; None: the current default device)
        for an ``MLXOps`` (None: ``auto_ops()``); drops the compiled passes.  Ops that
        cannot run there are refused.  Ops with ``requires_eager`` turn compilation
        off, other ops turn it on."""
        dev = device_name(device)
        if ops is not None and not runs_on(ops, dev):
            raise ValueError(f"ops {type(ops).__name__} cannot run on the {dev} device")
        self._ops_by_device[dev] = auto_ops(dev) if ops is None else ops
        self.compile = not any(o.requires_eager for o in self._ops_by_device.values())

    # --- the forward over a stack -------------------------------------------------------
    def stack_layers(self, stack: str) -> list:
        if stack == "target":
            return self.layers
        if stack == "draft":
            return self.draft.layers
        raise ValueError(f"stack must be 'target' or 'draft', not {stack!r}")

    def stack_logits(self, tokens, layers: list, caches: list, ops):
        """Embedding, the layers (each with its cache, or None), final norm, LM head."""
        x = self.tok_emb(tokens)
        for blk, cache in zip(layers, caches):
            x = blk(x, cache, ops)
        return ops.linear(ops.rms_norm(x, self.final_norm.weight, self.final_norm.eps), self.lm_head)

    def batch_logits(self, tokens, stack: str = "target", fake_quant: bool = False, chunk: int = 64,
                     params: dict | None = None):
        """logits [B, T, V] of tokens [B, T] from the zero state: the training forward.
        ``fake_quant``: the draft's linears with SPEC 3 fake quantization (QAT);
        ``chunk``: tokens per closed-form block of the delta rule; ``params``: a flat
        ``{name: array}`` dict loaded first (what a compiled training step traces)."""
        if params is not None:
            self.update(tree_unflatten(list(params.items())))
        layers = self.stack_layers(stack)
        return self.stack_logits(tokens, layers, [None] * len(layers), TrainingOps(fake_quant, chunk))

    # --- decoding -------------------------------------------------------------------
    def new_state(self, stack: str = "target", ring: int | None = None) -> DecodeState:
        self.stack_layers(stack)
        ring = self.cfg.spec_k + 1 if ring is None else ring
        return DecodeState(self.cfg, stack, ring, kv=self.kv_cache)

    def forward(self, tokens, state: DecodeState, strict: bool = False, stack: str | None = None,
                capture: dict | None = None) -> mx.array:
        """Run M tokens after the state's last written position; no commit.

        Returns logits [M, V] float32.  strict: every row gets the bits of the
        single-token pass (M single-token passes, or one M-row pass where that gives
        the same bits, ``rows_independent``); fast: one M-row pass with GEMM
        projections.  capture: filled with ``capture[layer] = {"q": [M,H,hd],
        "k": [M,H,hd]}`` per GDN layer (layer = index within the stack)."""
        stack = state.stack if stack is None else stack
        if stack != state.stack:
            raise ValueError(f"state belongs to the {state.stack!r} stack, not {stack!r}")
        toks = _token_list(tokens, self.cfg.vocab)
        M = len(toks)
        state.check_room(M)
        if M == 1 or not strict or self.rows_independent(stack, M):
            logits, qk = self._run(toks, state, capture is not None)
            if capture is not None:
                capture.update(qk)
            return logits
        rows, qks = [], []
        for t in toks:
            logits, qk = self._run([t], state, capture is not None)
            rows.append(logits)
            qks.append(qk)
        if capture is not None:
            for li in qks[0]:
                capture[li] = {n: mx.concatenate([qk[li][n] for qk in qks]) for n in ("q", "k")}
        return mx.concatenate(rows, axis=0)

    __call__ = forward

    def rows_lazy(self, tokens, state: DecodeState) -> mx.array:
        """M positions in one pass, built but not started; logits [M, V].  The same bits
        as ``forward`` in fast mode (and in strict mode where ``rows_independent``).
        `tokens`: ids, or an int32 [M] array that may not be computed yet."""
        toks = tokens if isinstance(tokens, mx.array) else _token_list(tokens, self.cfg.vocab)
        return run_pass(self, toks, state, dispatch=False)[0]

    def step_lazy(self, token: mx.array, state: DecodeState) -> mx.array:
        """One position from a token that may not be computed yet (an int32 [1] array:
        the argmax of the pass before), built but not started; logits [1, V].  One row
        is the same pass in strict and fast mode."""
        if token.shape != (1,) or token.dtype != mx.int32:
            raise ValueError(f"step_lazy takes an int32 [1] token array, not {token.dtype} {token.shape}")
        return self.rows_lazy(token, state)

    def host_tokens(self, n: int):
        """Token ids to build a pass on before they are chosen (``ops.host_tokens``:
        ``array`` for `step_lazy`/`rows_lazy`, ``set(ids)`` before it runs), or None
        where the current device's ops have none."""
        return self.ops.host_tokens(n)

    def rows_independent(self, stack: str, M: int) -> bool:
        """True when an M-row pass gives every row exactly the bits of a single-token
        pass: the ops say so, and every weight's row blocks at 1 and M rows are whole
        16-column vectors (the linear tiles; others go to the BLAS)."""
        if not self.ops.rows_independent():
            return False
        key = ("rows_independent", stack, M, device_name())
        ok = self._compiled.get(key)
        if ok is None:
            lins = [self.lm_head] + [lin for blk in self.stack_layers(stack) for lin in blk.linears()]
            ok = all((row_block(*lin.weight.shape, m) or lin.weight.shape[0]) % 16 == 0
                     for lin in lins for m in (1, M))
            self._compiled[key] = ok
        return ok

    def prefill(self, tokens, state: DecodeState, stack: str | None = None, strict: bool = False) -> mx.array:
        """Feed a prompt in chunks of the ring size, committing each; last logits [V]."""
        toks = _token_list(tokens, self.cfg.vocab)
        if not toks:
            raise ValueError("prefill needs at least one token")
        if state.pending:
            raise StateError("prefill needs a committed state (commit or discard the pending tokens)")
        logits = None
        for i in range(0, len(toks), state.ring):
            chunk = toks[i:i + state.ring]
            logits = self.forward(chunk, state, strict=strict, stack=stack)
            state.commit(len(chunk))
        return logits[-1]

    def _run(self, toks: list, state: DecodeState, capture: bool = False):
        return run_pass(self, toks, state, capture=capture)


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
