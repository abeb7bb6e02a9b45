"""Governors (SPEC 5): when a round drafts and when it runs autoregressively.

``Governor`` is the original's rule: suspend drafting for the rest of a call when
the rolling acceptance falls below a threshold or a round accepts nothing
(resumption opt-in).  ``CostGovernor`` is the default of ``spec``: it drafts while
the rolling acceptance beats the break-even acceptance of the cost model, from
round times it measures itself, and re-probes with exponential back-off.

Both see every round through ``round(accepted, proposed, seconds, timed)`` (proposed 0:
an AR round; timed False: the round built a pass shape, so its time is not the mode's)
and answer ``drafting`` for the next one.  Greedy output does not
depend on either: a governor only chooses which rounds verify proposals.

Shadow probes: where the draft can propose without being verified (``enable_shadow``),
the cost governor decides whether to draft -- at a call's start and after each back-off
until the call has drafted -- from proposals compared with the AR tokens that follow
them.  With greedy decoding and coupled sampling a proposal's accepted prefix is exactly
the prefix those tokens match, so a probe measures the acceptance a verification would,
without paying one.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

POLICIES = ("cost", "original", "off")


@dataclass
class GovernorConfig:
    policy: str | None = None    # cost | original | off (raw); None: cost for spec, original for governed
    window: int = 8              # drafting rounds in the rolling acceptance (both policies)
    # the original's rule
    alpha_threshold: float = 0.3  # trip when the window's ratio falls below this
    min_rounds: int = 4          # rounds before the ratio test applies
    zero_accept_trip: bool = True  # trip on a round that accepts nothing
    zero_accept_grace: int = 0   # opt-in: the zero-accept trip waits for this many rounds
    resume_after: int = 0        # opt-in: re-probe drafting after this many AR tokens (0 = never)
    # the cost model's (docs/decoding.md, "Cost-model governor": chosen on recorded traces)
    margin: float = 0.2          # suspend below (1 - margin) of AR speed: noise and regression
    prior_rounds: float = 2.0    # pseudo-rounds at the call's acceptance in the window's
    prior_alpha: float = 0.5     # one pseudo-round at this in the call's acceptance
    first_rounds: int = 2        # drafting rounds of a call before it may trip
    ar_first: int = 2            # AR rounds a call starts with when it has no AR time yet
    ar_samples: int = 8          # AR round times kept (their robust mean is the AR reference)
    ar_refresh: int = 64         # drafting rounds before an AR round refreshes the reference
    backoff: int = 16            # AR tokens before the first re-probe
    backoff_growth: int = 4      # its factor per probe that trips within a window
    backoff_max: int = 512
    carry_backoff: int = 64      # AR tokens of a back-off that may carry into the next call
    # shadow probes (a draft that proposes without verification)
    shadow: bool = True          # probe that way where the proposer can (False: drafting rounds)
    shadow_rounds: int = 3       # unverified proposals a probe compares with the AR tokens
    enter_gain: float = 0.05     # drafting resumes only where the expected speed is 1 + this of AR
    prior_cost: float = 2.0      # (k+1)c + v, AR tokens, before a drafting round has measured it
    recheck_after: int = 3       # failed probes in a row after which the prior stands in again

    def policy_for(self, mode: str, params=None) -> str:
        """The policy a mode runs: the configured one, else the original's for governed;
        for spec the cost model's, unless the sampled output depends on where rounds
        start (the residual rule: a timed governor would make seeded runs irreproducible)."""
        if self.policy is not None:
            if self.policy not in POLICIES:
                raise ValueError(f"governor policy {self.policy!r}: expected one of {', '.join(POLICIES)}")
            return self.policy
        if mode == "governed":
            return "original"
        return "off" if rounds_change_output(params) else "cost"


def rounds_change_output(params) -> bool:
    """Whether the emitted tokens depend on which rounds draft: only when sampling with a
    rule whose draws follow the round structure (greedy and coupled sampling do not)."""
    return params is not None and not params.greedy and params.accept != "coupled"


@dataclass
class GovernorMemory:
    """What a call's cost governor leaves the next call with the same draft: its AR round
    time (the next call then needs no AR rounds to start) and, when the call showed the
    draft useless (``useless``), the back-off it ended in (at most ``carry_backoff`` AR
    tokens) and the acceptance behind that verdict (accepted, proposed), so the next
    probe is judged on it.  A verdict no round of a call tested passes on unchanged.
    ``cost``: the last measured drafting round's (k+1)c + v, what a shadow probe's
    verdict weighs its acceptance against (None: not measured, prior_cost)."""
    ar_seconds: float | None = None
    useless: bool = False
    backoff_left: int = 0
    failures: int = 0
    accepted: int = 0
    proposed: int = 0
    cost: float | None = None


def make_governor(cfg: GovernorConfig, mode: str, params=None, memory: GovernorMemory | None = None):
    """The governor of one call in `mode` (None: every round drafts); `memory`: what the
    last call's governor left (``Governor.memory()``)."""
    if mode not in ("spec", "governed"):
        return None
    policy = cfg.policy_for(mode, params)
    if policy == "off":
        return None
    return Governor(cfg) if policy == "original" else CostGovernor(cfg, memory)


class Governor:
    """SPEC 5 governor: suspends drafting when the rolling acceptance ratio
    falls below the threshold or a round accepts zero proposals."""

    policy = "original"
    ar_seconds = None

    def __init__(self, cfg: GovernorConfig | None = None):
        self.cfg = cfg or GovernorConfig()
        self.reset()

    def reset(self):
        self.window = deque(maxlen=max(1, self.cfg.window))
        self.drafting = True
        self.trips = 0
        self.resumes = 0
        self._ar_tokens = 0

    def round(self, accepted: int, proposed: int, seconds: float, timed: bool = True):
        if proposed:
            self.record(accepted, proposed)
        else:
            self.ar_tokens(1)

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

    def ar_rounds_due(self) -> int:
        """AR rounds it asks for before the next drafting round: none (it re-probes by
        round count, not by the cost model's AR stretches)."""
        return 0

    def stats(self) -> dict:
        return {"governor": self.policy}

    def memory(self) -> GovernorMemory:
        return GovernorMemory()       # the original's rule starts every call afresh


def robust_mean(times) -> float:
    """The mean of round times, each capped at 4x their median: what throughput sees
    (a busy machine preempts long rounds more often, so a median would favour short
    AR rounds), without letting one stalled round decide."""
    cap = 4.0 * statistics.median(times)
    return statistics.fmean(min(t, cap) for t in times)


class CostGovernor:
    """Drafts while drafting pays by the cost model, measured on this call's rounds.

    SPEC 5: a round of k proposals costs (k+1)c + v AR tokens and emits 1 + alpha*k, so
    drafting pays while alpha > alpha* = ((k+1)c + v - 1) / k.  Here (k+1)c + v is the
    window's mean drafting-round time over the median AR round time (so c is the
    draft's share left on the critical path: with drafting ahead, none on a hit), and
    alpha the window's accepted/proposed shrunk towards the call's own (`prior_rounds`
    pseudo-rounds; the call's in turn starts from one round at `prior_alpha`), so an
    unlucky round of a good draft does not trip it and a useless draft trips in a round
    or two.  It suspends below (1 - margin) of AR speed, runs `backoff` AR tokens, then
    re-probes with a cleared window; a probe that trips within a window multiplies the
    back-off by `backoff_growth` (up to backoff_max), one that lasts resets it.  A call
    without an AR round time starts with `ar_first` AR rounds; an AR round refreshes the
    reference every `ar_refresh` drafting rounds, and at once when a drafting round
    measures cheaper than it (a busy machine can leave a stale, inflated AR time).
    A call that ends suspended after a failed re-probe, with the call's acceptance below
    break-even, leaves its back-off (capped) to the next call (``memory``): a useless
    draft is then probed about once per call instead of three or four times.
    """

    policy = "cost"

    def __init__(self, cfg: GovernorConfig | None = None, memory: GovernorMemory | None = None):
        self.cfg = cfg or GovernorConfig()
        memory = memory or GovernorMemory()
        self.window = deque(maxlen=max(1, self.cfg.window))
        ar_seconds = memory.ar_seconds
        self.ar_times = deque([ar_seconds] if ar_seconds else [], maxlen=max(1, self.cfg.ar_samples))
        self.trips = self.resumes = 0
        self._carried = memory.useless and bool(self.ar_times)
        self.suspended = self._carried and memory.backoff_left > 0
        self.break_even = None       # alpha* of the last drafting round
        self.cost = memory.cost      # its (k+1)c + v, AR tokens (an earlier call's until measured)
        self.alpha_estimate = None
        self._failures = memory.failures if self._carried else 0   # probes in a row that tripped within a window
        self._since_resume = 0       # drafting rounds since the last (re)start
        self._ar_left = min(memory.backoff_left, self.cfg.carry_backoff) if self._carried else 0   # AR tokens before the next probe
        self._accepted = self._proposed = self._spec_rounds = 0   # this call's totals
        if self._carried:       # a probe of a draft found useless: judged at once, on its record
            self._accepted, self._proposed = memory.accepted, memory.proposed
            self._spec_rounds = self.cfg.first_rounds
        self._ar_needed = 1 if self.ar_times else max(1, self.cfg.ar_first)
        self._since_ar = 0           # drafting rounds since the last AR round
        self._fresh = memory.ar_seconds is None    # no earlier call: nothing known of the draft
        self.shadow = False          # probes are unverified proposals (enable_shadow)
        self.probing = False         # a shadow probe is under way: AR rounds until it decides
        self._probe = [0, 0, 0]      # its rounds, accepted, proposed
        self._shadow_verdict = None  # the last probe's: True drafting pays, False it does not
        self.shadow_probes = 0
        self.shadow_accepted = self.shadow_proposed = 0

    def enable_shadow(self):
        """Probe with unverified proposals (the decoder calls this where its proposer can
        make them): a fresh call, and one carrying a useless verdict, start with a probe
        instead of drafting rounds, and so does every back-off until the call has drafted.
        Once it has, drafting rounds re-probe, as without: they measure the round cost
        that a shadow probe's verdict can only assume (near break-even the two disagree)."""
        if not self.cfg.shadow:
            return
        self.shadow = True
        if self._fresh or (self._carried and not self.suspended):
            self._start_probe()

    def _start_probe(self):
        self.probing = True
        self._probe = [0, 0, 0]

    @property
    def drafting(self) -> bool:
        if self.suspended or self.probing or self._since_ar >= self.cfg.ar_refresh:
            return False
        return len(self.ar_times) >= self._ar_needed

    @property
    def ar_seconds(self):
        return robust_mean(self.ar_times) if self.ar_times else None

    def ar_rounds_due(self) -> int:
        """AR rounds in a row before the governor can draft again (0 while it drafts):
        the rest of a back-off, the AR rounds that time a call's start, or one refresh."""
        if self.suspended:
            return max(1, self._ar_left)
        if self.probing:
            return 1 << 16          # until the probe decides
        if self.drafting:
            return 0
        return max(1, self._ar_needed - len(self.ar_times))

    def round(self, accepted: int, proposed: int, seconds: float, timed: bool = True):
        """`timed` False: the round's time was not the mode's own (it built a pass shape):
        its acceptance counts, its time does not."""
        if proposed <= 0:
            if timed:
                self.ar_times.append(seconds)
            self._since_ar = 0
            if self.suspended:
                self._ar_left -= 1
                if self._ar_left <= 0:
                    self.suspended = False
                    if self.shadow and self.break_even is None:
                        # nothing drafted this call yet: a probe that verifies nothing
                        self._start_probe()
                    else:
                        self._resume()
            return
        if not timed:
            self._accepted += accepted
            self._proposed += proposed
            return
        self.window.append((accepted, proposed, seconds))
        self._spec_rounds += 1
        self._accepted += accepted
        self._proposed += proposed
        self._since_resume += 1
        self._since_ar += 1
        if not self.ar_times or self._spec_rounds < self.cfg.first_rounds:
            return
        if self.losing():
            self._suspend()
        elif self.cost < 1.0:
            # a drafting round does an AR round's work and more: the AR reference is stale
            self.ar_times.clear()
            self._ar_needed = max(1, self.cfg.ar_first)

    def _backoff(self, grown: int) -> int:
        """AR tokens before the next probe, after `grown` growths."""
        return min(self.cfg.backoff_max, self.cfg.backoff * self.cfg.backoff_growth ** min(grown, 16))

    def _resume(self):
        self.resumes += 1
        self.window.clear()
        self._since_resume = 0

    def shadow_round(self, accepted: int, proposed: int):
        """An unverified proposal of `proposed` tokens whose first `accepted` the AR tokens
        after it matched.  After ``shadow_rounds`` of them the probe decides: drafting
        resumes where the expected speed, (1 + alpha k) / cost, reaches 1 + enter_gain of
        AR, else a back-off grown per probe that failed in a row.  alpha: the probe's
        accepted / proposed, shrunk towards the call's record by prior_rounds pseudo-rounds
        as the drafting window's estimate is (a call's first probe has no record).  cost:
        the last measured drafting round's, this call's or an earlier one's, else
        prior_cost, and prior_cost again after recheck_after failed probes in a row, so a
        cost measured high at a busy moment is measured again.  Entering above 1 and
        leaving below 1 - margin is the hysteresis that keeps a draft near break-even from
        flipping every few rounds."""
        if not self.probing or proposed <= 0:
            return
        self._probe[0] += 1
        self._probe[1] += accepted
        self._probe[2] += proposed
        self._accepted += accepted
        self._proposed += proposed
        self.shadow_accepted += accepted
        self.shadow_proposed += proposed
        rounds, acc, prop = self._probe
        if rounds < self.cfg.shadow_rounds:
            return
        self.probing = False
        self.shadow_probes += 1
        k, alpha = prop / rounds, acc / prop
        before = self._proposed - prop          # the call's record before this probe
        if before > 0:
            prior = self.cfg.prior_rounds * k
            alpha = (acc + prior * (self._accepted - acc) / before) / (prop + prior)
        stale = self.cost is None or self._failures >= self.cfg.recheck_after
        cost = self.cfg.prior_cost if stale else self.cost
        if (1.0 + alpha * k) / cost >= 1.0 + self.cfg.enter_gain:
            self._shadow_verdict = True
            self._failures = 0
            self._resume()
            return
        self._shadow_verdict = False
        self._failures += 1
        self._ar_left = self._backoff(self._failures - 1)
        self.suspended = True

    def losing(self) -> bool:
        """Whether the window's acceptance is below the break-even of its measured cost."""
        rounds = len(self.window)
        self.cost = cost = robust_mean([s for _, _, s in self.window]) / self.ar_seconds   # (k+1)c + v
        proposed = sum(p for _, p, _ in self.window)
        k = proposed / rounds
        accepted = sum(a for a, _, _ in self.window)
        call_alpha = (self._accepted + k * self.cfg.prior_alpha) / (self._proposed + k)
        prior = self.cfg.prior_rounds * k
        self.break_even = (cost * (1.0 - self.cfg.margin) - 1.0) / k
        self.alpha_estimate = (accepted + prior * call_alpha) / (proposed + prior)
        return self.alpha_estimate < self.break_even

    def _suspend(self):
        failed_probe = (self.trips or self._carried) and self._since_resume <= self.window.maxlen
        self._failures = self._failures + 1 if failed_probe else 0
        self._ar_left = self._backoff(self._failures)
        self.suspended = True
        self.trips += 1

    def memory(self) -> GovernorMemory:
        untested = self._carried and self.break_even is None and self._shadow_verdict is None
        useless = untested or (self.suspended and self._failures > 0 and self.break_even is not None
                               and self._accepted < self.break_even * self._proposed) or \
            (self._shadow_verdict is False and (self.suspended or self.probing))
        if not useless:
            return GovernorMemory(self.ar_seconds, cost=self.cost)
        return GovernorMemory(self.ar_seconds, useless=True, backoff_left=self._ar_left if self.suspended else 0,
                              failures=self._failures, accepted=self._accepted, proposed=self._proposed,
                              cost=self.cost)

    def stats(self) -> dict:
        r = (lambda x: None if x is None else round(float(x), 4))
        out = {"governor": self.policy, "break_even_alpha": r(self.break_even),
               "governor_alpha": r(self.alpha_estimate)}
        if self.shadow:
            out.update(shadow_probes=self.shadow_probes, shadow_accepted=self.shadow_accepted,
                       shadow_proposed=self.shadow_proposed)
        return out
