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
        state would allocate them again and fault their pages in (2-20 ms a call)."""
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
    def passes_built(self) -> int:
        """Pass shapes built so far (each is traced on first use, milliseconds)."""
        return getattr(self.model, "passes_built", 0)

    def commit(self, n: int):
        self.state.commit(n)
        self.pos += n

    def discard(self):
        """Drop the uncommitted rows of the last `verify`."""
        self.state.discard()
