"""The speculative round (SPEC 5): deferred corrections, modes, stopping rules.

A round starts with a pending token p (decided, emitted, not yet consumed by the
target).  The proposer proposes d_0..d_{k-1} from p; the target verifies
[p, d_0..d_{k-1}] in ONE batch; n = longest prefix with d_j == t_j; d_0..d_{n-1}
and the correction t_n are emitted; t_n becomes the next pending token; target
and proposer commit n+1 positions (ring index / KV position only).

`ar` mode is the same loop with k = 0, so every mode shares one code path and
one stopping rule -- which is what makes "spec == ar token for token" a
property of the arithmetic, not of two implementations agreeing.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import noise
from . import sampling as smp
from .call import Call, RoundResult
from .governor import GovernorConfig, make_governor
from .proposer import Proposer
from .shadow import ShadowProbe
from .stats import DecodeStats
from .target import TargetRunner

MODES = ("ar", "spec", "governed", "forced", "oracle")
MAX_K = 16
# reading a verification's rows blocked this long: it was still running, so its duration
# is known (a round waits for the draft's continuation only until the verification's
# usual end less a build, so that building the next verification from it ends in time)
STILL_RUNNING_S = 50e-6
FOLLOW_EVERY = 16   # tokens: the draft catches up on the governor's AR rounds in the background
                    # (over the last 2 * FOLLOW_EVERY before the next probe)


class DecodeError(ValueError):
    """Bad decoding request (empty prompt, prompt past max_seq, K out of range...)."""


def checked_prompt(prompt, max_tokens: int, cfg) -> list:
    """The prompt as ints; DecodeError when it is empty, longer than max_seq or outside
    the vocabulary, or max_tokens < 0."""
    prompt = [int(t) for t in prompt]
    V, max_seq = cfg.vocab, cfg.max_seq
    if not prompt:
        raise DecodeError("the prompt is empty: at least one token is needed")
    if len(prompt) > max_seq:
        raise DecodeError(f"the prompt has {len(prompt)} tokens, longer than max_seq={max_seq}")
    bad = [t for t in prompt if not (0 <= t < V)]
    if bad:
        raise DecodeError(f"prompt token {bad[0]} is outside the vocabulary (0..{V - 1})")
    if max_tokens < 0:
        raise DecodeError(f"max_tokens={max_tokens}: must be >= 0")
    return prompt


@dataclass(frozen=True)
class DecodeOptions:
    """How a SpeculativeDecoder decodes beyond its mode, K and sampling: `strict` (the
    bit-exact verification path), `governor` (GovernorConfig; None: the default),
    `forced_alpha` (mode forced's acceptance), `runner(ring, strict)`: the target side
    when it is not the model in this process (a pipeline across processes,
    spel_mlx.distributed; TargetRunner's interface), `rows_hook`: see _sample_rows."""
    strict: bool = False
    governor: GovernorConfig | None = None
    forced_alpha: float | None = None
    runner: object = None
    rows_hook: object = None


class SpeculativeDecoder:
    """One target, an optional proposer, a mode.  `generate` may be called repeatedly;
    each call starts from a fresh state."""

    def __init__(self, model, proposer: Proposer | None = None, mode: str = "spec", k: int = 4,
                 params: smp.SamplingParams = smp.GREEDY, options: DecodeOptions = DecodeOptions()):
        strict, governor, forced_alpha, runner = options.strict, options.governor, options.forced_alpha, options.runner
        if mode not in MODES:
            raise DecodeError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        if not isinstance(k, int) or not (1 <= k <= MAX_K):
            raise DecodeError(f"K={k!r}: must be an integer in 1..{MAX_K}")
        if mode in ("spec", "governed", "forced", "oracle") and proposer is None:
            raise DecodeError(f"mode {mode!r} needs a draft engine")
        if mode == "forced":
            if forced_alpha is None or not (0.0 <= forced_alpha <= 1.0):
                raise DecodeError(f"forced alpha {forced_alpha!r}: must be in [0, 1]")
        self.model, self.cfg = model, model.cfg
        self.proposer = proposer if mode != "ar" else None
        self.mode, self.k, self.strict = mode, k, strict
        self.params = params.validate()
        # with a rows_hook every round reads its rows on the host (_sample_rows)
        self.rows_hook, self.argmax = options.rows_hook, self.params.plain_greedy and options.rows_hook is None
        self.governor_cfg = governor or GovernorConfig()
        self.forced_alpha = forced_alpha
        ring = self._longest() + 1
        # greedy spec may build a round's verification during the one before: room for two
        self.target = (TargetRunner(model, ring=ring, strict=strict, batches=2 if self.proposer else 1)
                       if runner is None else runner(ring, strict))
        self.stats = DecodeStats()
        self.output: list = []
        # `ar` builds each pass while the one before runs, and `spec` the next verification
        # from the draft's prediction (False: one round at a time; the tests compare the two)
        self.lookahead = True
        self._forced_carry = 0.0
        self._built = None      # the next round's verification, built during this one
        self._next = None       # ... and started: the pass the next round reads

    def close(self):
        if self.proposer is not None:
            self.proposer.close()

    def generate(self, prompt, max_tokens: int, on_tokens=None, stop_tokens=(),
                 calibrate: bool = False, on_round=None):
        """Decode up to `max_tokens` tokens after `prompt`; returns the emitted tokens.

        `on_tokens(list)` is called with each round's emitted tokens (streaming);
        `on_round(RoundResult)` with the round's decision (which emitted tokens the
        proposer drafted, which the target corrected).  The statistics of the call are
        in `self.stats` (kept current, so they are valid after an interrupt too)."""
        prompt = checked_prompt(prompt, max_tokens, self.cfg)
        max_seq = self.cfg.max_seq
        seed = self.seed = noise.seed64(self.params.seed)    # this call's noise stream
        proposer = self.proposer
        gov = make_governor(self.governor_cfg, self.mode, self.params,
                            proposer.governor_memory if proposer is not None else None)
        if hasattr(gov, "enable_shadow") and getattr(proposer, "shadows", False) and self._looks_ahead():
            gov.enable_shadow()     # its probes are proposals compared with the AR rounds' tokens
        st = self.stats = DecodeStats(mode=self.mode, draft=(proposer.name if proposer else "none"),
                                      k=(self.k if proposer else 0), strict=self.strict,
                                      prompt_tokens=len(prompt),
                                      kv_cache=self.target.kv_cache)
        out = self.output = []
        call = self.call = Call(prompt[:-1], out, max_tokens, set(int(t) for t in stop_tokens), on_tokens, on_round,
                                gov, seed)

        t0 = time.perf_counter()
        self.target.reset()
        self.target.reserve(len(prompt) + max_tokens)
        history = call.history         # committed in the target
        pending = prompt[-1]
        if proposer is not None:
            proposer.reset()
            proposer.start_sync(history)   # the C draft prefills on its own thread meanwhile
        self.target.prefill(history)
        if proposer is not None:
            proposer.sync(history)
        st.prefill_s = time.perf_counter() - t0
        if calibrate and max_tokens > 0:
            st.ar_token_s = self._calibrate_ar(pending)
        self._forced_carry = 0.0
        t_dec = time.perf_counter()
        try:
            if proposer is None and self._looks_ahead():     # `ar`
                count = min(max_tokens, max_seq - self.target.pos)
                _, stop = self._ar_ahead(call, pending, count)
                st.stop_reason = ("stop_token" if stop else "max_tokens" if len(out) >= max_tokens
                                  else "max_seq")
            else:
                st.stop_reason = self._rounds(call, pending)
        except KeyboardInterrupt:
            st.stop_reason = "interrupted"
            raise
        finally:
            st.decode_s = time.perf_counter() - t_dec
            if proposer is not None:
                st.draft_forwards = proposer.forwards
                st.extra.update(proposer.extra_stats())
            if gov is not None:
                st.extra.update(gov.stats())
                if proposer is not None:   # the API builds a decoder per call around a cached proposer
                    proposer.governor_memory = gov.memory()
            if st.ar_rounds and st.ar_token_s is None:
                st.ar_token_s = st.ar_s / st.ar_rounds
            # the caller's callbacks usually reach back to whoever holds this decoder: kept,
            # they would make a cycle that holds the call's state (ring, KV caches) until a
            # garbage collection, and the next call would take fresh memory
            call.on_tokens = call.on_round = None
        return out

    # -- the rounds of a call ----------------------------------------------------------
    def _rounds(self, call: Call, pending) -> str:
        """Round after round (SPEC 5) until max_tokens, a stop token or max_seq; returns
        the stop reason.  The call's history grows by the committed tokens."""
        self._built = self._next = None
        self._verify_times, self._build_times = deque(maxlen=16), deque([0.0], maxlen=16)
        try:
            return self._round_loop(call, pending)
        finally:
            self._drop_next()
            if self.proposer is not None:
                self.proposer.settle()

    def _drop_next(self):
        for built in (self._built, self._next):
            if built is not None:
                self.target.drop_built(built)
        self._built = self._next = None

    def _round_loop(self, call: Call, pending) -> str:
        st, max_seq = self.stats, self.cfg.max_seq
        history, gov, seed = call.history, call.gov, call.seed
        behind = False              # rounds the governor skipped left the proposer behind
        while call.room() > 0:
            pos = self.target.pos
            if pos >= max_seq:
                return "max_seq"
            t_round = time.perf_counter()
            built = self._passes_built()
            k = self._round_k(pos, call.room())
            stretch = self._ar_stretch(gov, k, call.room())
            if stretch:         # the governor's AR rounds, looking ahead
                self._drop_next()
                behind = True
                pending, stop = self._ar_ahead(call, pending, stretch, follow=True, k=k)
                if stop:
                    return "stop_token"
                continue
            proposal, qs = [], None
            resumed = False
            if k > 0 and (gov is None or gov.drafting):
                if behind:      # the catch-up is the probe's cost, not the round's
                    t_round += self._catch_up(history)
                    behind, resumed = False, True
                proposal, qs = self._propose(history, pending, k, seed)
            else:
                behind = behind or k > 0
            n, correction = self._verify(history, pending, proposal, qs, seed)
            self._commit(n, len(proposal))
            history.extend(([pending] + proposal)[:n + 1])
            if gov is not None:
                # a round that built a pass shape (a longer n-gram proposal, a new
                # attention window) paid for tracing it, and the first drafting round
                # after AR rounds proposes afresh after a stretch of single-row passes:
                # their times say nothing of the mode (docs/decoding.md, "Cost-model governor")
                gov.round(n, len(proposal), time.perf_counter() - t_round,
                          timed=self._passes_built() == built and not resumed)
            ahead, self._built = self._built, None
            if ahead is not None:   # it accepted everything and its guess: the next round
                if gov is None or gov.drafting:    # verifies `ahead` (if it proposes it)
                    self.target.start_built(ahead)
                    self._next = ahead
                else:
                    self.target.drop_built(ahead)
            emitted, stop = call.emit(proposal[:n] + [correction])
            st.tokens = len(call.out)
            pending = correction
            if gov is not None:
                st.governor_trips, st.governor_resumes = gov.trips, gov.resumes
            call.report(emitted, RoundResult(tuple(proposal), n, correction, tuple(emitted)))
            if stop:
                return "stop_token"
        return "max_tokens"

    # -- AR rounds with the next pass built ahead ----------------------------------------
    def _looks_ahead(self) -> bool:
        """AR rounds on a target that builds each pass before the token it reads is
        known: from the lazy argmax, or (sampling, a penalty) from host token ids."""
        if not self.lookahead:
            return False
        return self.target.looks_ahead if self.argmax else self.target.looks_ahead_sampled

    def _ar_stretch(self, gov, k: int, remaining: int) -> int:
        """AR rounds to run looking ahead: the ones the governor asks for before it drafts
        again (its back-off, the AR rounds that time a call's start)."""
        if k <= 0 or gov is None or not self._looks_ahead():
            return 0
        n = min(gov.ar_rounds_due(), remaining, self.cfg.max_seq - self.target.pos)
        return n if n >= 2 else 0

    def _ar_ahead(self, call: Call, pending, count, follow=False, k=0):
        """`count` AR rounds through TargetRunner.ar_tokens (each step's pass built while
        the one before runs): the tokens (`_decide`'s) and state of one verification per
        round; `follow`: the governor's AR rounds, each timed and reported to it as its
        own round, the proposer catching up meanwhile and making the governor's shadow
        probes of `k` proposals; they end early when the governor turns to drafting.
        Returns (the next pending token, whether a stop token ended it)."""
        history, gov = call.history, call.gov if follow else None
        last = [pending]       # the token of the row `pick` reads

        def pick(row):
            return self._sample_rows(row[None, :], history, last[0], [])[0][0]

        st = self.stats
        probe = (ShadowProbe(gov, self.proposer, lambda n: min(k, self._round_k(n, call.room())), st,
                             self.params, self.seed) if getattr(gov, "shadow", False) and k > 0 else None)
        steps = self.target.ar_tokens(pending, count, None if self.argmax else pick)
        try:
            while True:
                ta, built = time.perf_counter(), self._passes_built()
                token = next(steps, None)
                if token is None:
                    return pending, False
                st.ar_s += time.perf_counter() - ta
                st.ar_rounds += 1
                st.rounds += 1
                history.append(pending)
                emitted, stop = call.emit([token])
                st.tokens = len(call.out)
                pending = last[0] = token
                call.report(emitted, RoundResult((), 0, token, tuple(emitted)))
                if gov is not None:   # the round's whole time, as a drafting round's is timed
                    gov.round(0, 0, time.perf_counter() - ta, timed=self._passes_built() == built)
                    st.governor_trips, st.governor_resumes = gov.trips, gov.resumes
                if stop:
                    return pending, True
                if probe is not None and gov.probing:
                    probe.after_round(history, pending)
                elif follow and len(history) % FOLLOW_EVERY == 0 and gov.ar_rounds_due() <= 2 * FOLLOW_EVERY:
                    # only near the next probe: the draft's work on the other core slows this one's steps
                    self.proposer.start_sync(history, background=True)
                if gov is not None and gov.drafting:
                    return pending, False
        finally:
            steps.close()

    # -- the steps of a round ------------------------------------------------
    def _passes_built(self) -> int:
        """The model's pass shapes built so far (0 where the target runs elsewhere)."""
        return self.target.passes_built

    def _longest(self) -> int:
        """The most proposals a round may ask for: K, or more where the proposer sets
        its own length (the n-gram draft); forced rounds keep K so their ratio is exact."""
        if self.proposer is None or self.mode == "forced" or not self.proposer.max_k:
            return self.k
        return max(self.k, self.proposer.max_k)

    def _round_k(self, pos: int, remaining: int) -> int:
        """Proposals this round: at most `_longest`, fewer near max_seq or the end of
        the request."""
        if self.proposer is None:
            return 0
        k = min(self._longest(), self.cfg.max_seq - 1 - pos)
        if self.mode != "forced":
            k = min(k, remaining - 1)
        return k

    def _catch_up(self, history) -> float:
        """Bring the proposer up to the committed history (timed as draft work)."""
        ta = time.perf_counter()
        self.proposer.sync(history)
        dt = time.perf_counter() - ta
        self.stats.draft_s += dt
        return dt

    def _propose(self, history, pending, k, seed):
        """Step 1 (timed as draft work)."""
        ta = time.perf_counter()
        proposal, qs = self.proposer.propose(history, pending, k, self.params, seed)
        self.stats.draft_s += time.perf_counter() - ta
        self.stats.draft_forwards = self.proposer.forwards
        return proposal, qs

    def _verify(self, history, pending, proposal, qs, seed):
        """Steps 2 and 3: one target batch over [pending] + proposal; (n, correction).

        The target's token of each row: the argmax, or (sampling, or a penalty) the
        coupled sample of the row's distribution at its sequence index, all rows in one
        step (sampling.sample_rows).  Coupled rule and greedy: n is the longest prefix
        where the proposal equals those tokens.  Residual rule: sampling.residual_round,
        the target's own sample after an all-accepted round."""
        n, correction = self._decide(history, pending, proposal, qs, seed)
        if self._built is not None and not (n == len(proposal) and correction == self._built.tokens[0]):
            self.target.drop_built(self._built)     # never ran: the state is as it was
            self._built = None
        return n, correction

    def _decide(self, history, pending, proposal, qs, seed):
        params, st = self.params, self.stats
        m = len(proposal)
        ta = time.perf_counter()
        argmax = self.argmax
        if self._next is not None or self._builds_ahead(m):
            out = self._verify_ahead(pending, proposal, argmax)
            targ, rows = (out, None) if argmax else (None, out)
        else:
            targ, rows = self.target.verify_rows([pending] + proposal, argmax=argmax)
        dt = time.perf_counter() - ta
        if m:
            st.verify_s += dt
            st.spec_rounds += 1
        else:
            st.ar_s += dt
            st.ar_rounds += 1
        probs = None
        if rows is not None:
            residual = params.accept == "residual" and not params.greedy and m and self.mode != "forced"
            targ, probs = self._sample_rows(rows, history, pending, proposal, want_probs=bool(residual))
        if self.mode == "forced" and m:
            n = self._forced_n(m)
            return n, targ[n]
        if probs is not None:
            n, fix = smp.residual_round(probs, qs, proposal, seed, len(history) + 1)
            guess = self.proposer.guess() if fix is None else None
            if guess is not None and guess[1] is not None:
                # all accepted: the draft's guess past them is one more proposal, for row m
                _, fix = smp.residual_round(probs[m:], [guess[1]], [guess[0]], seed, len(history) + 1 + m)
                fix = guess[0] if fix is None else fix
            return n, (targ[n] if fix is None else fix)
        n = 0
        while n < m and proposal[n] == targ[n]:
            n += 1
        return n, targ[n]

    def _sample_rows(self, rows, history, pending, proposal, want_probs=False):
        """(tokens, probs) of the rows [M, V] over [pending] + proposal after `history`; a
        rows_hook(rows, history, pending, proposal, sample) decides instead (on the host)."""
        W = self.params.window
        ctx = (history[-W:] if W else []) + [pending]

        def sample(rows):
            return smp.sample_rows(rows, ctx + proposal, len(ctx), self.params, (self.seed, len(history) + 1), want_probs)
        return sample(rows) if self.rows_hook is None else self.rows_hook(rows, history, pending, proposal, sample)

    def _builds_ahead(self, m: int) -> bool:
        """Whether a round of m proposals builds the next verification ahead."""
        return (m > 0 and self.lookahead and self.mode in ("spec", "governed")
                and self.target.build_next is not None)

    def _verify_ahead(self, pending, proposal, argmax: bool):
        """The target's argmax of each row (a list), or its logits (numpy [M, V]), with the
        next round's verification built while this one runs: from the proposer's
        prediction (a drafted-ahead continuation, the n-gram's next lookup) if it is there
        in time (by the verification's usual duration less a build's); `_verify` keeps it
        (`_built`) only if this round accepts everything and its last token is the
        prediction's first.  A verification built in the round before is used when this
        round's tokens are its tokens (else dropped)."""
        tokens = [pending] + proposal
        built, self._next = self._next, None
        if built is not None and built.tokens != tokens:
            self.target.drop_built(built)
            built = None
        if built is not None:
            rows, started = built.out, built.started
            self.stats.extra["built_ahead"] = self.stats.extra.get("built_ahead", 0) + 1
        else:
            started = time.perf_counter()
            rows = self.target.verify_started(tokens, argmax)
        timeout = self._peek_timeout(started) if self._builds_ahead(len(proposal)) else None
        nxt, k_next = None, 0
        if timeout is not None:
            k_next = self._round_k(self.target.pos + len(tokens), self.call.room() - len(tokens))
            nxt = self.proposer.peek(proposal, k_next, timeout) if k_next > 0 else None
        if nxt is not None and 0 < len(nxt[1]) <= k_next:
            t_build = time.perf_counter()
            self._built = self.target.build_next([nxt[0]] + list(nxt[1]), argmax)
            self._build_times.append(time.perf_counter() - t_build)
        t_read = time.perf_counter()
        out = rows.tolist() if argmax else np.array(rows)
        t_end = time.perf_counter()
        if t_end - t_read > STILL_RUNNING_S:      # it ended just now: its duration
            self._verify_times.append(t_end - started)
        return out

    def _peek_timeout(self, started: float):
        """How long a round waits for the draft's continuation: until the verification
        started at `started` usually ends, less a build (None before one is measured)."""
        if not self._verify_times:
            return None
        until = started + statistics.median(self._verify_times) - statistics.median(self._build_times)
        return max(0.0, until - time.perf_counter())

    def _forced_n(self, m: int) -> int:
        """Forced acceptance (benchmark only): the accepted count that keeps the running
        accepted/proposed at forced_alpha, by error diffusion."""
        n = max(0, min(m, int(math.floor(self._forced_carry + self.forced_alpha * m + 1e-9))))
        self._forced_carry += self.forced_alpha * m - n
        return n

    def _commit(self, n: int, m: int):
        """Step 4: n+1 positions in target and proposer (a verification built ahead stays
        pending in the target)."""
        st = self.stats
        (self.target.commit_keep if self._built is not None else self.target.commit)(n + 1)
        if m:
            self.proposer.commit(n + 1)
            st.proposed += m
            st.accepted += n
        st.rounds += 1

    def _calibrate_ar(self, pending, reps: int = 5) -> float:
        """Median time of single-token target forwards, uncommitted (state unchanged);
        the first call is a warm-up (it may compile the step)."""
        times = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            mx.eval(self.target.verify([pending]))
            if i:
                times.append(time.perf_counter() - t0)
            self.target.discard()
        return float(np.median(times))
