"""The cost governor's shadow probes during a stretch of AR rounds (governor.py)."""
from __future__ import annotations

import time

# Rounds a background probe may lag before it is waited for (the wait lifts the draft's
# priority): on a machine whose other core is busy a SCHED_IDLE job may never run.
LATE_ROUNDS = 4


class ShadowProbe:
    """What a stretch of AR rounds does for the governor's shadow probes.

    After each AR round, ``after_round(history, pending)`` with the token it emitted: a
    proposal made after an earlier round is matched against the tokens emitted since
    (had it been verified, its accepted prefix is the prefix the AR tokens match: greedy
    decoding and coupled sampling), and the governor hears the count once a token
    differs or all matched.  Without a proposal, the draft proposes
    ``propose_k(len(history))`` tokens: on its own thread where the proposer can
    (``shadow_start``: the catch-up and the proposal in one job, matched when it
    arrives), else on this one (``shadow``) after catching up on its thread for a round."""

    def __init__(self, gov, proposer, propose_k, stats, params, seed):
        self.gov, self.proposer, self.propose_k = gov, proposer, propose_k
        self.stats, self.params, self.seed = stats, params, seed
        self.proposal, self.matched, self.synced = None, 0, False
        self.started = None     # len(history) when a proposal was started on the draft's thread
        self.late = 0           # rounds the draft's thread has kept this probe waiting
        self.background = getattr(proposer, "shadows_async", False)

    def after_round(self, history, pending) -> None:
        if self.started is not None:
            t0 = time.perf_counter()
            self._wait_if_late()
            proposal = self.proposer.shadow_take()
            self.stats.draft_s += time.perf_counter() - t0
            if proposal is None:
                return          # still drafting: the tokens since are in `history`
            since = history[self.started + 1:] + [pending]     # emitted after its `pending`
            self.started, self.late = None, 0
            if not proposal:
                self.synced = False
                return
            self.proposal, self.matched = list(proposal), 0
            for token in since:
                if self._match(token):
                    return
            return
        if self.proposal is not None:
            self._match(pending)
            return
        if not self.synced and not self.background:    # a background proposal catches up itself
            self.proposer.start_sync(history, background=True)
            self.synced = True
            return
        k = self.propose_k(len(history))
        if k <= 0:
            return
        t0 = time.perf_counter()
        if self.background:
            self._wait_if_late()            # a catch-up still out
            if self.proposer.shadow_start(history, pending, k, self.params, self.seed):
                self.started, self.late = len(history), 0
            self.stats.draft_s += time.perf_counter() - t0
            return
        proposal = self.proposer.shadow(history, pending, k, self.params, self.seed)
        self.stats.draft_s += time.perf_counter() - t0
        if proposal:
            self.proposal, self.matched = list(proposal), 0

    def _wait_if_late(self):
        """One more round waited for the draft's thread; past LATE_ROUNDS, wait for its job."""
        self.late += 1
        if self.late > LATE_ROUNDS:
            self.proposer.settle()

    def _match(self, token) -> bool:
        """One more emitted token against the proposal; True once the probe's round is told."""
        if token == self.proposal[self.matched]:
            self.matched += 1
            if self.matched < len(self.proposal):
                return False
        self.gov.shadow_round(self.matched, len(self.proposal))
        self.proposal, self.synced = None, False
        return True
