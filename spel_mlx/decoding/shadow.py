"""The cost governor's shadow probes during a stretch of AR rounds (governor.py)."""
from __future__ import annotations

import time


class ShadowProbe:
    """What a stretch of AR rounds does for the governor's shadow probes.

    After each AR round, ``after_round(history, pending)`` with the token it emitted: a
    proposal made after an earlier round is matched against that token (had it been
    verified, its accepted prefix is the prefix the AR tokens match: greedy decoding and
    coupled sampling), and the governor hears the count once a token differs or all
    matched; without a proposal, the draft first catches up on its own thread during
    the next round, then proposes ``propose_k(len(history))`` tokens."""

    def __init__(self, gov, proposer, propose_k, stats, params, seed):
        self.gov, self.proposer, self.propose_k = gov, proposer, propose_k
        self.stats, self.params, self.seed = stats, params, seed
        self.proposal, self.matched, self.synced = None, 0, False

    def after_round(self, history, pending) -> None:
        if self.proposal is not None:
            if pending == self.proposal[self.matched]:
                self.matched += 1
                if self.matched < len(self.proposal):
                    return
            self.gov.shadow_round(self.matched, len(self.proposal))
            self.proposal, self.synced = None, False
            return
        if not self.synced:
            self.proposer.start_sync(history)
            self.synced = True
            return
        k = self.propose_k(len(history))
        if k <= 0:
            return
        t0 = time.perf_counter()
        proposal = self.proposer.shadow(history, pending, k, self.params, self.seed)
        self.stats.draft_s += time.perf_counter() - t0
        if proposal:
            self.proposal, self.matched = list(proposal), 0
