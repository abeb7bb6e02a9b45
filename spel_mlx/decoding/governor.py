"""The governor (SPEC 5): suspends drafting for the rest of a call when the rolling
acceptance falls below a threshold or a round accepts nothing; resumption is opt-in."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class GovernorConfig:
    window: int = 8              # rounds in the rolling accepted/proposed ratio
    alpha_threshold: float = 0.3  # trip when the window's ratio falls below this
    min_rounds: int = 4          # rounds before the ratio test applies
    zero_accept_trip: bool = True  # trip on a round that accepts nothing
    zero_accept_grace: int = 0   # opt-in: the zero-accept trip waits for this many rounds
    resume_after: int = 0        # opt-in: re-probe drafting after this many AR tokens (0 = never)


class Governor:
    """SPEC 5 governor: suspends drafting when the rolling acceptance ratio
    falls below the threshold or a round accepts zero proposals."""

    def __init__(self, cfg: GovernorConfig | None = None):
        self.cfg = cfg or GovernorConfig()
        self.reset()

    def reset(self):
        self.window = deque(maxlen=max(1, self.cfg.window))
        self.drafting = True
        self.trips = 0
        self.resumes = 0
        self._ar_tokens = 0

    def record(self, accepted: int, proposed: int):
        if proposed <= 0:
            return
        self.window.append((accepted, proposed))
        trip = (self.cfg.zero_accept_trip and accepted == 0
                and len(self.window) > self.cfg.zero_accept_grace)
        if not trip and len(self.window) >= min(self.cfg.min_rounds, self.window.maxlen):
            a = sum(x for x, _ in self.window)
            p = sum(y for _, y in self.window)
            trip = a / p < self.cfg.alpha_threshold
        if trip:
            self.drafting = False
            self.trips += 1
            self._ar_tokens = 0

    def ar_tokens(self, n: int):
        if self.drafting or self.cfg.resume_after <= 0:
            return
        self._ar_tokens += n
        if self._ar_tokens >= self.cfg.resume_after:
            self.drafting = True
            self.resumes += 1
            self.window.clear()
