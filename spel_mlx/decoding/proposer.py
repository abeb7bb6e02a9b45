"""What a round asks of its draft (SPEC 5 step 1): the ``Proposer`` protocol.

Adapters: ``MLXProposer`` (the FP32 draft layers, or the whole target as the
oracle), ``CDraftProposer`` and ``CDraftAheadProposer`` (the C draft, plain or
drafting the next round during verification), ``NgramProposer`` (prompt lookup)
and ``AutoProposer`` (n-gram, else a model proposer); ``factory.make_proposer``
builds them by name.
"""
from __future__ import annotations

import numpy as np

from . import sampling as smp


class Proposer:
    """Protocol of a draft, with the defaults of a stateless one.

    `propose(history, pending, k, params, seed)` -> (tokens, qs): up to k proposals
    continuing history + [pending]; `seed` is the call's noise seed (sampled proposals
    are the coupled samples of the draft's distributions, docs/decoding.md); `qs` is the
    list of the draft distributions the proposals were drawn from under the residual
    rule (``params.accept``), else None.  A stateful proposer
    runs k+1 forwards ([pending, d_0..d_{k-1}]) and keeps them uncommitted;
    `commit(n)` then keeps the first n of those positions.  `history` is what
    the target has committed; a proposer that fell behind (governor AR rounds,
    auto mode) catches up from it (`sync`) before proposing; `start_sync` lets the
    prompt's catch-up run while the target prefills.
    """

    name = "draft"    # the --draft kind, reported as the statistics' "draft"
    forwards = 0      # draft token-forwards run (for the cost figure c)
    threads = None    # C draft worker threads, where there is one
    governor_memory = None   # what the last call's governor left the next (governor.GovernorMemory)
    max_k = None      # a proposer that sets its own length: the most proposals in a round (None: K)
    shadows = False   # whether `shadow` proposes (the cost governor's probes)

    def reset(self):
        pass

    def sync(self, history):
        pass

    def start_sync(self, history, background: bool = False):
        """Begin catching up on ``history`` in the background where the proposer can (the
        C draft on its own thread, beside the target's prefill); ``sync`` finishes it.
        `background`: on the CPU time the target leaves (a catch-up while it decodes)."""

    def settle(self):
        """Wait for a catch-up begun by ``start_sync`` (the end of a call leaves none running)."""

    def propose(self, history, pending, k, params, seed):
        raise NotImplementedError

    def commit(self, n: int):
        pass

    def shadow(self, history, pending, k, params, seed) -> list:
        """The k tokens ``propose`` would propose here, never to be verified: the proposer
        commits only `pending` (the governor compares them with the AR tokens that follow;
        ``shadows`` True where a proposer implements it)."""
        raise NotImplementedError

    def guess(self):
        """(token, q) after a proposal that drafted one position past it (drafting ahead):
        the draft's own sample there and its distribution (q under the residual rule,
        else None); None when there is none.  The residual rule takes it as a proposal
        for the round's last row, so a drafted-ahead continuation is used more often."""
        return None

    def peek(self, proposal, k: int, timeout: float):
        """During the verification of `proposal`: the next round's (pending, proposal) if
        this round accepts all of it and the target's token after it is the draft's
        guess (greedy: the target then builds that verification ahead), for a next call
        of ``propose`` with `k`, waiting at most `timeout` seconds for it; None when there
        is no such prediction (yet).  A wrong one costs nothing but the pass built for it."""
        return None

    def close(self):
        pass

    def extra_stats(self) -> dict:
        """Counters of this proposer for the call's statistics (``DecodeStats.extra``)."""
        return {}


def wants_qs(params) -> bool:
    """Whether proposals must come with their distributions (the residual rule)."""
    return params.accept == "residual" and not params.greedy


def propose_stepwise(forward, history, pending, k, params, seed):
    """(tokens, qs) drafted one forward at a time, for sampling or a repetition penalty.

    `forward(token, j)` runs `token` at offset j of the round's uncommitted batch and
    returns its logits (numpy [V]).  Each position sees history + [pending] + d_<j,
    as the target's row j will, and d_j is the coupled sample at sequence index
    len(history) + 1 + j (sampling.sample_rows).  The (k+1)-th forward only makes the
    draft's state cover d_{k-1}; its logits are unused."""
    W = params.window
    ctx = (list(history[-W:]) if W else []) + [int(pending)]
    tokens, qs = [], ([] if wants_qs(params) else None)
    tok = int(pending)
    for j in range(k + 1):
        logits = forward(tok, j)
        if j == k:
            break
        (tok,), probs = smp.sample_rows(np.asarray(logits)[None], ctx, len(ctx), params, (seed, len(history) + 1 + j),
                                        want_probs=qs is not None)
        if qs is not None:
            qs.append(probs[0])
        ctx.append(tok)
        tokens.append(tok)
    return tokens, qs
