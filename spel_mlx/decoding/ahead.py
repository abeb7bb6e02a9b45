"""Whether the C draft drafts ahead this round (``--draft-ahead auto``).

Drafting ahead (docs/decoding.md) hides the next round's proposal behind this round's
verification.  A round that uses the continuation (a hit) saves a fresh proposal, F
seconds on the critical path; every round that started one waits W at the commit for
it.  So drafting ahead pays while W < h F (h: the hit rate).  On a quiet machine the
continuation is done before the commit (W ~ 0).  When another process holds the
second core, the continuation (at SCHED_IDLE) runs only once the commit waits for it,
so W ~ F and every round pays for it: the policy then drafts plainly and tries ahead
again after a back-off, since the other process may be gone.
"""
from __future__ import annotations

import os
import statistics
from collections import deque
from dataclasses import dataclass


@dataclass
class AheadConfig:
    window: int = 16          # rounds that drafted ahead in the rolling wait and hit rate
    min_rounds: int = 2       # of them before drafting ahead may be switched off
    fresh_samples: int = 16   # fresh proposal times kept (their median is F)
    margin: float = 0.1       # ahead must keep W below (1 - margin) h F ...
    floor: float = 0.25       # ... or below this share of F (a quiet machine's hand-over)
    retry: int = 32           # plain rounds before drafting ahead is tried again ...
    retry_max: int = 512      # ... doubling per failed try, up to this
    first_retry: int = 8      # plain rounds before the first try when the machine looked busy


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity, else the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def spare_core(cpus: int | None = None, load: float | None = None) -> bool:
    """Whether a core looks free for the draft's thread: this process may run on 2+
    CPUs and the 1-minute load average (this process counts one) leaves one of them."""
    cpus = usable_cpus() if cpus is None else cpus
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = 0.0
    return cpus >= 2 and load < cpus - 0.5


class AheadPolicy:
    """Drafts ahead while the measured wait is below what the hits save.

    The proposer reports each round through ``round(ahead, hit, fresh_s, wait_s)``:
    whether it started a continuation, whether its proposal was a kept continuation,
    the time of a fresh proposal (None on a hit) and the time the commit waited for the
    continuation.  ``ahead`` says whether the next round starts one.
    """

    def __init__(self, cfg: AheadConfig | None = None, start_ahead: bool = True):
        self.cfg = cfg or AheadConfig()
        self.window = deque(maxlen=max(1, self.cfg.window))    # (hit, wait_s) of ahead rounds
        self.fresh = deque(maxlen=max(1, self.cfg.fresh_samples))
        self.ahead = start_ahead
        self.switches_off = 0
        self._retry = self.cfg.retry
        self._plain_left = 0 if start_ahead else self.cfg.first_retry
        self._tried = 0             # ahead rounds since the last try started

    def round(self, ahead: bool, hit: bool, fresh_s: float | None, wait_s: float):
        if fresh_s is not None:
            self.fresh.append(fresh_s)
        if not ahead:
            if not self.ahead:
                self._plain_left -= 1
                if self._plain_left <= 0:
                    self.ahead = True
                    self.window.clear()
                    self._tried = 0
            return
        self.window.append((hit, wait_s))
        self._tried += 1
        if self.ahead and self._tried >= self.cfg.min_rounds and self.losing():
            # a re-try that failed at once backs off further; one that lasted starts over
            failed_try = self.switches_off > 0 and self._tried <= self.cfg.window
            self._retry = min(self.cfg.retry_max, 2 * self._retry) if failed_try else self.cfg.retry
            self._plain_left = self._retry
            self.ahead = False
            self.switches_off += 1

    def losing(self) -> bool:
        """W > (1 - margin) h F and W > floor F over the window (never without a fresh
        proposal time): waits that small are a hand-over, not a draft behind."""
        if not self.fresh:
            return False
        fresh = statistics.median(self.fresh)
        hits = sum(1 for h, _ in self.window if h)
        wait = statistics.fmean(w for _, w in self.window)
        saved = hits / len(self.window) * fresh
        return wait > (1.0 - self.cfg.margin) * saved and wait > self.cfg.floor * fresh

    def stats(self) -> dict:
        return {"ahead_switches_off": self.switches_off}
