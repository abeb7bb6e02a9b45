"""Rank 0's target: ``TargetRunner``'s interface (reset, prefill, verify rows, commit)
over a pipeline, so the decoder, its proposers, sampling and governor are unchanged.

One round: rank 0 runs its stage on the K+1 rows ([pending, d_0..d_{K-1}]) and sends
one RUN down the ring; each rank runs its layers and hands the activations on; the
last rank sends back what the round reads (greedy: the argmax of each row; sampling
or a penalty: the rows' logits, since the transforms need the history rank 0 holds).
The round's commit (or a calibration's discard) rides on the next message's header,
so it costs no message of its own.  Prefill chunks go down the ring without waiting
for an answer, so the ranks work on consecutive chunks at once.
"""
from __future__ import annotations

import time

import numpy as np

import mlx.core as mx

from ..decoding.target import PREFILL_RING, token_ids
from .link import DISCARD, NO_CONTROL, RESET, RUN, STRICT, WANT_ARGMAX, WANT_LOGITS, WANT_NOTHING


class PipelineTarget:
    """TargetRunner's interface for a target split across processes; what it cannot do
    is declared, not missing: no pass is built before its token is known, none ahead."""
    looks_ahead = looks_ahead_sampled = False
    build_next = None
    passes_built = 0             # the pass shapes are built on the other ranks
    kv_cache = "float32"         # the stages keep float32 K/V caches

    def __init__(self, pipe, ring: int, strict: bool = False):
        self.pipe, self.stage = pipe, pipe.stage
        self.cfg = self.stage.cfg
        self.strict = strict
        self.ring = max(2, ring, PREFILL_RING)
        self.state, self.pos = None, 0

    def reset(self):
        with self.pipe.lock:
            self.state = self.stage.new_state(ring=self.ring)
            self.pos = 0
            self.pipe.control = NO_CONTROL     # the old state's last commit no longer matters
            self.pipe.exchange(lambda: self.pipe.post(RESET, flags=STRICT if self.strict else 0, ring=self.ring))

    def reserve(self, n: int):
        """Room for n positions in this rank's caches (the other ranks grow theirs as they go)."""
        with self.pipe.lock:
            self.state.reserve(min(n, self.cfg.max_seq))

    def prefill(self, tokens):
        for i in range(0, len(tokens), self.ring):
            chunk = token_ids(tokens[i:i + self.ring])
            self._run(chunk, WANT_NOTHING)
            self.commit(len(chunk))

    def verify(self, tokens) -> mx.array:
        """Logits [M, V] of `tokens` at pos..pos+M-1, nothing committed."""
        return mx.array(self.verify_rows(tokens, argmax=False)[1])

    def verify_rows(self, tokens, argmax: bool):
        out = self._run(token_ids(tokens), WANT_ARGMAX if argmax else WANT_LOGITS)
        return (out.tolist(), None) if argmax else (None, np.array(out))

    def commit(self, n: int):
        with self.pipe.lock:
            self.state.commit(n)
            self.pos += n
            self.pipe.set_control(n)

    def discard(self):
        with self.pipe.lock:
            self.state.discard()
            self.pipe.set_control(DISCARD)

    def _run(self, tokens: list, want: int):
        """This rank's stage on `tokens`, then the RUN down the ring and, if `want`,
        the last rank's answer."""
        pipe, M = self.pipe, len(tokens)
        with pipe.lock:
            t0 = time.perf_counter()
            x = self.stage.forward(tokens, self.state, self.strict)
            mx.eval(x)
            pipe.counters.ran(M, time.perf_counter() - t0, want != WANT_NOTHING)

            def exchange():
                pipe.post(RUN, rows=M, flags=want, pos=self.state.pos)
                pipe.link.send(x, "activations")
                if want == WANT_ARGMAX:
                    return pipe.link.recv((M,), mx.int32, "the argmax rows")
                if want == WANT_LOGITS:
                    return pipe.link.recv((M, self.cfg.vocab), mx.float32, "the logits rows")
                return None
            return pipe.exchange(exchange)
