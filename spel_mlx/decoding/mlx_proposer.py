"""An MLX stack as the proposer: the FP32 draft layers (``--draft mlx``) or the
whole target (``--draft target``, the oracle of ``--mode oracle``)."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from .proposer import Proposer, propose_stepwise
from .target import PREFILL_RING, token_ids


class MLXProposer(Proposer):
    """Proposals are k+1 single-token forwards chained through the stack's ring
    without committing (the state counts them as pending); `commit(n)` keeps the
    first n (indices only)."""

    def __init__(self, model, stack: str = "draft", ring: int = 5, strict: bool = False):
        self.model, self.stack, self.strict = model, stack, strict
        self.ring = max(2, ring, PREFILL_RING)
        self.name = "mlx" if stack == "draft" else "target"
        self.state = model.new_state(stack, ring=self.ring)
        self.reset()

    def reset(self):
        self.state.reset()   # keeps the KV buffers (TargetRunner.reset)
        self.pos = 0
        self.forwards = 0

    def _forward(self, tokens):
        return self.model.forward(token_ids(tokens), self.state, strict=self.strict, stack=self.stack)

    def sync(self, history):
        while self.pos < len(history):
            chunk = history[self.pos:self.pos + self.ring]
            mx.eval(self._forward(chunk))
            self.state.commit(len(chunk))
            self.pos += len(chunk)
            self.forwards += len(chunk)

    def propose(self, history, pending, k, params, seed):
        self.sync(history)
        if params.plain_greedy:
            tokens = self._propose_argmax(pending, k)
            qs = None
        else:
            def step(tok, j):
                logits = self._forward([tok])[-1]
                if j == k:
                    mx.eval(logits)
                    return None
                return np.array(logits)
            tokens, qs = propose_stepwise(step, history, pending, k, params, seed)
        self.forwards += k + 1
        return tokens, qs

    shadows = True

    def shadow(self, history, pending, k, params, seed) -> list:
        tokens, _ = self.propose(history, pending, k, params, seed)
        self.commit(1)      # row 0 is `pending`, which the AR round commits anyway
        return tokens

    def _propose_argmax(self, pending, k) -> list:
        # plain greedy: the argmax stays on the device, no logits copied out
        tokens, tok = [], pending
        for j in range(k + 1):
            logits = self._forward([tok])[-1]
            if j == k:
                mx.eval(logits)  # the state must cover d_{k-1}; its logits are unused
                break
            tok = int(mx.argmax(logits).item())
            tokens.append(tok)
        return tokens

    def commit(self, n: int):
        self.state.commit(n)
        self.pos += n
