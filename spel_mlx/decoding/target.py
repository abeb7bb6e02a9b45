"""The target side of a round (SPEC 4): the MLX target with its decoding state.

The state's ring holds at least K+1 slots (one verification batch) and at least
PREFILL_RING, so prompts prefill in batches of that many tokens rather than K+1
(a slot is one S [H, hd, hd] per GDN layer; the gain is in docs/decoding.md).
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

PREFILL_RING = 16


def token_ids(tokens) -> list:
    return [int(t) for t in tokens]


class TargetRunner:
    """The MLX target model plus its decoding state, with a position counter.  A target
    split across processes (``spel_mlx.distributed``) has the same interface."""

    def __init__(self, model, ring: int, strict: bool = False):
        self.model = model
        self.cfg = model.cfg
        self.strict = strict
        self.ring = max(2, ring, PREFILL_RING)
        self.state = model.new_state("target", ring=self.ring)
        self.pos = 0

    def reset(self):
        """An empty state for the next call, keeping the KV buffers grown so far: a fresh
        state would allocate them again and fault their pages in (docs/model.md)."""
        self.state.reset()
        self.pos = 0

    def reserve(self, n: int):
        """Room for n positions now: growing the caches mid-call copies them (and, in fresh
        memory, page-faults) inside one round."""
        self.state.reserve(min(n, self.cfg.max_seq))

    def prefill(self, tokens):
        """Commit `tokens` (chunks of at most `ring`, so strict prefill is exact too)."""
        for i in range(0, len(tokens), self.ring):
            chunk = tokens[i:i + self.ring]
            logits = self.model.forward(token_ids(chunk), self.state, strict=self.strict, stack="target")
            mx.eval(logits)
            self.state.commit(len(chunk))
            self.pos += len(chunk)

    def verify(self, tokens) -> mx.array:
        """Logits [M, V] for `tokens` at pos..pos+M-1, nothing committed."""
        return self.model.forward(token_ids(tokens), self.state, strict=self.strict, stack="target")

    def verify_rows(self, tokens, argmax: bool):
        """What a round reads of `verify`: (the argmax of each row, None) or, for
        sampling and penalties, (None, the logits as numpy [M, V])."""
        logits = self.verify(tokens)
        if argmax:
            return mx.argmax(logits, axis=-1).tolist(), None
        return None, np.array(logits)

    @property
    def looks_ahead(self) -> bool:
        """Whether `greedy_tokens` can build a pass from a token not yet read."""
        return hasattr(self.model, "step_lazy")

    def greedy_tokens(self, pending: int, count: int):
        """Greedy AR: yields the next `count` tokens after `pending`, committing a
        position per token.  Each step's pass is built from the lazy argmax of the one
        before while that one runs, and started when it has finished (so MLX still
        updates the KV caches in place): the Python and graph-building part of a step
        no longer adds to it.  A consumer that stops early leaves nothing uncommitted."""
        if count < 1:
            return

        def argmax_after(token):      # the lazy int32 [1] argmax of the pass over `token`
            return mx.argmax(self.model.step_lazy(token, self.state)[0], keepdims=True).astype(mx.int32)

        y = argmax_after(mx.array([pending], dtype=mx.int32))
        mx.async_eval(y)
        try:
            for i in range(count):
                self.commit(1)
                nxt = argmax_after(y) if i + 1 < count else None
                token = y.item()
                if nxt is not None:
                    mx.async_eval(nxt)
                    y = nxt
                yield token
        finally:
            if self.state.pending:    # built (maybe started) for a token nobody asked for
                mx.eval(y)
                self.state.discard()

    @property
    def passes_built(self) -> int:
        """Pass shapes built so far (each is traced on first use, milliseconds)."""
        return getattr(self.model, "passes_built", 0)

    def commit(self, n: int):
        self.state.commit(n)
        self.pos += n

    def discard(self):
        """Drop the uncommitted rows of the last `verify`."""
        self.state.discard()
