"""A rank after the first: runs its stage on whatever rank 0 sends, until STOP.

Per message: the header's control first (the previous round's commit or discard,
indices only), then the op.  RESET makes a fresh state; RUN receives the rows'
activations, runs the stage and hands the result on (the next rank's activations,
or, from the last rank, what rank 0 asked for); after STATS and STOP every rank
reports its counters in one all_sum.  Every header goes on to the next rank as soon
as it arrives (the last rank echoes a PING to rank 0).  Anything out of step is a
PipelineError.
"""
from __future__ import annotations

import time

import mlx.core as mx

from ..model.state import StateError
from .link import (DISCARD, NO_CONTROL, OPS, PING, RESET, RUN, STATS, STOP, STRICT, WANT_ARGMAX, WANT_LOGITS,
                   WANT_NOTHING, Link, PipelineError, StageCounters)


def serve(stage, link: Link) -> list:
    """Serve rank 0 until it stops the pipeline; returns the STOP's per-rank counters."""
    d, last = stage.cfg.d_model, stage.stage.last
    counters = StageCounters(link)
    state, strict, seq = None, False, 0
    while True:
        h = link.recv_header()
        seq += 1
        if h.seq != seq:
            raise PipelineError(f"protocol: message {h.seq} ({OPS[h.op]}) arrived where {seq} was due")
        if not last or h.op == PING:    # on at once, so the next rank reads it while this one works
            link.send_header(h)          # (the last rank's PING goes back to rank 0: the echo)
        if h.control != NO_CONTROL:
            _apply_control(state, h.control)
        if h.op == RESET:
            state, strict = stage.new_state(ring=h.ring), bool(h.flags & STRICT)
        elif h.op == RUN:
            if state is None or state.pos != h.pos:
                raise PipelineError(f"protocol: rank 0 runs rows at position {h.pos}, this rank's state is at "
                                    f"{None if state is None else state.pos}")
            x = link.recv((h.rows, d), mx.float32, f"the activations of message {seq}")
            t0 = time.perf_counter()
            y = stage.forward(x, state, strict)
            mx.eval(y)
            counters.ran(h.rows, time.perf_counter() - t0, h.flags != WANT_NOTHING)
            if not last:
                link.send(y, "activations")
            elif h.flags == WANT_ARGMAX:
                link.send(mx.argmax(y, axis=-1).astype(mx.int32), "the argmax rows")
            elif h.flags == WANT_LOGITS:
                link.send(y, "the logits rows")
        elif h.op in (STATS, STOP):
            rows = link.gather_rows(counters.row(), "the other ranks' counters")
            counters.reset()
            if h.op == STOP:
                return rows


def _apply_control(state, control: int) -> None:
    try:
        if state is None:
            raise StateError("no state yet")
        if control == DISCARD:
            state.discard()
        else:
            state.commit(control)
    except StateError as e:
        raise PipelineError(f"protocol: rank 0's {'discard' if control == DISCARD else f'commit({control})'} "
                            f"does not apply here: {e}") from None
