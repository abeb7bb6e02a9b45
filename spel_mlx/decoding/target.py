"""The target side of a round (SPEC 4): the MLX target with its decoding state.

The state's ring holds at least K+1 slots (one verification batch) and at least
PREFILL_RING, so prompts prefill in batches of that many tokens rather than K+1
(a slot is one S [H, hd, hd] per GDN layer; the gain is in docs/decoding.md).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

PREFILL_RING = 16


def token_ids(tokens) -> list:
    return [int(t) for t in tokens]


@dataclass
class BuiltPass:
    """A verification pass built during the round before it: its tokens, what a round
    reads of it (the lazy argmax of its rows, or its logits), and until it starts the
    state to go back to if it is not used (held no longer: MLX updates the KV caches in
    place only when the pass alone holds them)."""
    tokens: list
    out: mx.array
    mark: tuple | None
    started: float = 0.0      # perf_counter() when it started


class TargetRunner:
    """The MLX target model plus its decoding state, with a position counter.  A target
    split across processes (``spel_mlx.distributed``) has the same interface."""

    def __init__(self, model, ring: int, strict: bool = False, batches: int = 1):
        """`ring`: the largest batch; `batches`: how many may be pending at once (a
        verification built during the one before)."""
        self.model = model
        self.cfg = model.cfg
        self.strict = strict
        self.ring = max(2, ring, PREFILL_RING)        # also the prefill's batch
        self.state = model.new_state("target", ring=self.ring * max(1, batches))
        self.pos = 0

    @property
    def kv_cache(self) -> str:
        """The K/V cache dtype's name (spel_mlx.model.state.KV_DTYPES)."""
        return self.state.kv_cache

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
        out = self.verify_started(tokens, argmax)
        return (out.tolist(), None) if argmax else (None, np.array(out))

    def verify_started(self, tokens, argmax: bool) -> mx.array:
        """`verify`, started: the lazy argmax of each row (int32 [M]), or the logits."""
        out = self.verify(tokens)
        if argmax:
            out = mx.argmax(out, axis=-1)
            mx.async_eval(out)
        return out

    def build_next(self, tokens, argmax: bool) -> BuiltPass | None:
        """The pass over `tokens` after the uncommitted rows of the running verification,
        as if they will all be committed: built, not started (None where it cannot be:
        no room in the ring or before max_seq, or strict rows that need one pass each)."""
        st, M = self.state, len(tokens)
        if not hasattr(self.model, "rows_lazy") or st.pending + M > st.ring or \
                self.pos + st.pending + M > self.cfg.max_seq or \
                (self.strict and not self.model.rows_independent("target", M)):
            return None
        mark = st.mark()
        logits = self.model.rows_lazy(token_ids(tokens), st)
        return BuiltPass(token_ids(tokens), mx.argmax(logits, axis=-1) if argmax else logits, mark)

    def commit_keep(self, n: int):
        """Commit the round's n rows, keeping the rows of a pass built after them pending."""
        self.state.commit_keep(n)
        self.pos += n

    def start_built(self, built: BuiltPass):
        """Run a built pass (its rows are the pending ones now)."""
        built.mark = None
        built.started = time.perf_counter()
        mx.async_eval(built.out)

    def drop_built(self, built: BuiltPass):
        """Forget a built pass: its rows stop being pending, and one that never ran
        leaves the state as it was before it."""
        self.state.forget(len(built.tokens), built.mark)

    @property
    def looks_ahead(self) -> bool:
        """Whether `ar_tokens` can build a pass from a greedy token not yet read."""
        return hasattr(self.model, "step_lazy")

    @property
    def looks_ahead_sampled(self) -> bool:
        """Whether `ar_tokens` can build a pass from a token the host has not chosen yet
        (the model's ops give host token inputs)."""
        return self.looks_ahead and getattr(getattr(self.model, "ops", None), "host_token_inputs", False)

    def ar_tokens(self, pending: int, count: int, pick=None):
        """AR: yields the next `count` tokens after `pending`, committing a position per
        token.  Each step's pass is built while the one before runs and started when that
        one has finished (so MLX still updates the KV caches in place), so the Python and
        graph-building part of a step no longer adds to it: greedy (`pick` None) from the
        lazy argmax of the pass before; otherwise from host token ids that are set once
        `pick` (the logits row of the pass before, numpy [V] -> token id) has chosen.  A
        consumer that stops early leaves nothing uncommitted."""
        if count < 1:
            return

        def after(token):      # the pass over `token`: its lazy int32 [1] argmax, or its logits row
            out = self.model.step_lazy(token, self.state)[0]
            return mx.argmax(out, keepdims=True).astype(mx.int32) if pick is None else out

        y = after(mx.array([pending], dtype=mx.int32))
        mx.async_eval(y)
        unset = None           # (host ids, their pass) built for a token not chosen yet
        try:
            for i in range(count):
                self.commit(1)
                nxt = None
                if i + 1 < count:
                    if pick is None:
                        nxt = after(y)
                    else:
                        ids = self.model.host_tokens(1)
                        nxt = after(ids.array)
                        unset = (ids, nxt)
                token = y.item() if pick is None else int(pick(np.array(y)))
                if nxt is not None:
                    if unset is not None:
                        unset[0].set([token])
                        unset = None
                    mx.async_eval(nxt)
                    y = nxt
                yield token
        finally:
            if unset is not None:   # built on a token never chosen: runs on any id, then dropped
                unset[0].set([0])
                y = unset[1]
            if self.state.pending:  # built (maybe started) for a token nobody asked for
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
