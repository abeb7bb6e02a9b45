"""What a round asks of its draft (SPEC 5 step 1): the ``Proposer`` protocol.

Adapters: ``MLXProposer`` (the FP32 draft layers, or the whole target as the
oracle), ``CDraftProposer`` and ``CDraftAheadProposer`` (the C draft, plain or
drafting the next round during verification), ``NgramProposer`` (prompt lookup)
and ``AutoProposer`` (n-gram, else a model proposer); ``factory.make_proposer``
builds them by name.
"""
from __future__ import annotations

from . import sampling as smp


class Proposer:
    """Protocol of a draft, with the defaults of a stateless one.

    `propose(history, pending, k, params, rng)` -> (tokens, qs): up to k proposals
    continuing history + [pending]; `qs` is None for greedy params, otherwise the
    list of draft distributions the proposals were drawn from.  A stateful proposer
    runs k+1 forwards ([pending, d_0..d_{k-1}]) and keeps them uncommitted;
    `commit(n)` then keeps the first n of those positions.  `history` is what
    the target has committed; a proposer that fell behind (governor AR rounds,
    auto mode) catches up from it (`sync`) before proposing.
    """

    name = "draft"    # the --draft kind, reported as the statistics' "draft"
    forwards = 0      # draft token-forwards run (for the cost figure c)
    threads = None    # C draft worker threads, where there is one

    def reset(self):
        pass

    def sync(self, history):
        pass

    def propose(self, history, pending, k, params, rng):
        raise NotImplementedError

    def commit(self, n: int):
        pass

    def close(self):
        pass

    def extra_stats(self) -> dict:
        """Counters of this proposer for the call's statistics (``DecodeStats.extra``)."""
        return {}


def propose_stepwise(forward, history, pending, k, params, rng):
    """(tokens, qs) drafted one forward at a time, for sampling or a repetition penalty.

    `forward(token, j)` runs `token` at offset j of the round's uncommitted batch and
    returns its logits (numpy [V]).  Each position sees history + [pending] + d_<j,
    as the target's row j will.  The (k+1)-th forward only makes the draft's state
    cover d_{k-1}; its logits are unused."""
    ctx = list(history) + [pending]
    tokens, qs = [], (None if params.greedy else [])
    tok = int(pending)
    for j in range(k + 1):
        logits = forward(tok, j)
        if j == k:
            break
        if params.greedy:
            tok = smp.greedy_token(logits, ctx, params)
        else:
            q = smp.probabilities(logits, ctx, params)
            tok = smp.draw(q, rng)
            qs.append(q)
        ctx.append(tok)
        tokens.append(tok)
    return tokens, qs
