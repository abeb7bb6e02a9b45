"""Speculative decoding engine (SPEC 5): deferred-correction rounds, governor,
forced acceptance, lossless speculative sampling.

A round starts with a pending token p (decided, emitted, not yet consumed by the
target).  The draft proposes d_0..d_{k-1} from p; the target verifies
[p, d_0..d_{k-1}] in ONE batch; n = longest prefix with d_j == t_j; d_0..d_{n-1}
and the correction t_n are emitted; t_n becomes the next pending token; target
and draft commit n+1 positions (ring index / KV position only).

`ar` mode is the same loop with k = 0, so every mode shares one code path and
one stopping rule -- which is what makes "spec == ar token for token" a
property of the arithmetic, not of two implementations agreeing.

Draft engines implement a small protocol (see `DraftEngine`); adapters exist
for the C ternary draft, the FP32 MLX draft layers, the full target used as its
own draft (oracle), the n-gram drafter, and n-gram-then-model (auto).
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from . import sampling as smp
from .ngram import NgramIndex

import mlx.core as mx  # noqa: E402  (after the package import: BLAS first)
import numpy as np  # noqa: E402

MODES = ("ar", "spec", "governed", "forced", "oracle")
MAX_K = 16
# Ring slots of the MLX states: at least K+1 (one verify batch), and at least 16 so
# prompts prefill in 16-token batches (measured 1.7x faster prefill than 5-token
# chunks on the 8-layer pilot; a slot is one S [H,hd,hd] per GDN layer).
PREFILL_RING = 16


class DecodeError(ValueError):
    """Bad decoding request (empty prompt, prompt past max_seq, K out of range...)."""


def _ids(tokens) -> list:
    return [int(t) for t in tokens]


# ---------------------------------------------------------------------------
# target runner

class TargetRunner:
    """The MLX target model plus its decoding state, with a position counter."""

    def __init__(self, model, ring: int, strict: bool = False):
        self.model = model
        self.cfg = model.cfg
        self.strict = strict
        self.ring = max(2, ring, PREFILL_RING)
        self.state = model.new_state("target", ring=self.ring)
        self.pos = 0

    def reset(self):
        self.state = self.model.new_state("target", ring=self.ring)
        self.pos = 0

    def prefill(self, tokens):
        """Commit `tokens` (chunks of at most `ring`, so strict prefill is exact too)."""
        for i in range(0, len(tokens), self.ring):
            chunk = tokens[i:i + self.ring]
            logits = self.model.forward(_ids(chunk), self.state, strict=self.strict, stack="target")
            mx.eval(logits)
            self.state.commit(len(chunk))
            self.pos += len(chunk)

    def verify(self, tokens) -> mx.array:
        """Logits [M, V] for `tokens` at pos..pos+M-1, nothing committed."""
        return self.model.forward(_ids(tokens), self.state, strict=self.strict, stack="target")

    def commit(self, n: int):
        self.state.commit(n)
        self.pos += n


# ---------------------------------------------------------------------------
# draft engines

class DraftEngine:
    """Protocol of a draft.

    `propose(history, pending, k, params, rng)` -> (tokens, qs): up to k proposals
    continuing history + [pending]; `qs` is None for greedy params, otherwise the
    list of draft distributions the proposals were drawn from.  A stateful draft
    runs k+1 forwards ([pending, d_0..d_{k-1}]) and keeps them uncommitted;
    `commit(n)` then keeps the first n of those positions.  `history` is what
    the target has committed; a draft that fell behind (governor AR rounds,
    auto mode) catches up from it before proposing.
    """

    name = "draft"
    forwards = 0      # draft token-forwards run (for the cost figure c)
    last_used = None  # the engine whose proposal is pending a commit (auto)

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


class ModelDraft(DraftEngine):
    """An MLX stack as the draft: the FP32 draft layers (stack="draft") or the
    whole target (stack="target": the oracle).  Proposals are k+1 single-token
    forwards chained through the ring without committing (the state counts
    them as pending); `commit(n)` keeps the first n (indices only)."""

    def __init__(self, model, stack: str = "draft", ring: int = 5, strict: bool = False):
        self.model, self.stack, self.strict = model, stack, strict
        self.ring = max(2, ring, PREFILL_RING)
        self.name = "mlx" if stack == "draft" else "target"
        self.reset()

    def reset(self):
        self.state = self.model.new_state(self.stack, ring=self.ring)
        self.pos = 0
        self.forwards = 0

    def _forward(self, tokens):
        return self.model.forward(_ids(tokens), self.state, strict=self.strict, stack=self.stack)

    def sync(self, history):
        while self.pos < len(history):
            chunk = history[self.pos:self.pos + self.ring]
            mx.eval(self._forward(chunk))
            self.state.commit(len(chunk))
            self.pos += len(chunk)
            self.forwards += len(chunk)

    def propose(self, history, pending, k, params, rng):
        self.sync(history)
        greedy = params.greedy
        plain = greedy and not params.uses_penalty
        ctx = None if plain else list(history) + [pending]
        tokens, qs = [], (None if greedy else [])
        tok = pending
        for j in range(k + 1):
            logits = self._forward([tok])[-1]
            if j == k:
                mx.eval(logits)  # the state must cover d_{k-1}; its logits are unused
                break
            if plain:
                tok = int(mx.argmax(logits).item())
            elif greedy:
                tok = smp.greedy_token(np.array(logits), ctx, params)
            else:
                q = smp.probabilities(np.array(logits), ctx, params)
                tok = smp.draw(q, rng)
                qs.append(q)
            if ctx is not None:
                ctx.append(tok)
            tokens.append(tok)
        self.forwards += k + 1
        return tokens, qs

    def commit(self, n: int):
        self.state.commit(n)
        self.pos += n


class CDraftEngine(DraftEngine):
    """The C ternary/q8 draft (spel_mlx.draft.CDraft)."""

    name = "c"

    def __init__(self, cdraft):
        self.d = cdraft
        self.ring = max(2, int(getattr(cdraft, "ring", 2)))
        self.forwards = 0
        self._base = int(cdraft.pos)

    def reset(self):
        self.d.reset()
        self._base = int(self.d.pos)
        self.forwards = 0

    @property
    def pos(self):
        return int(self.d.pos) - self._base

    def sync(self, history):
        while self.pos < len(history):
            chunk = list(history[self.pos:self.pos + self.ring])
            self.d.forward(chunk, logits=False)
            self.d.commit(len(chunk))
            self.forwards += len(chunk)

    def propose(self, history, pending, k, params, rng):
        self.sync(history)
        if params.greedy and not params.uses_penalty:
            toks = [int(t) for t in self.d.propose(int(pending), k)]
            self.forwards += k + 1
            return toks, None
        # Sampling / penalty: one forward per token, each continuing the
        # uncommitted batch (start=j), so the draft state covers all k+1.
        ctx = list(history) + [pending]
        tokens, qs = [], (None if params.greedy else [])
        tok = int(pending)
        for j in range(k + 1):
            logits = self.d.forward([tok], start=j)[0]
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
        self.forwards += k + 1
        return tokens, qs

    def commit(self, n: int):
        self.d.commit(n)

    def close(self):
        self.d.close()


class PipelinedCDraft(CDraftEngine):
    """The C draft drafting the next round on a second core while the target verifies.

    Plain greedy only (anything else runs as CDraftEngine).  A round's proposal
    [p, d_0..d_{K-1}] also yields the draft's guess g at the token after d_{K-1}.
    While the target verifies that batch, the draft's native thread proposes
    [g, e_0..e_{K-1}] (and its guess) continuing the draft's uncommitted batch, as
    if all K proposals were accepted and the target's correction were g.  When
    exactly that happens, the commit keeps the continuation and the next round's
    proposal costs nothing; otherwise committing n+1 drops it.  The proposals are
    the same tokens CDraftEngine would make (the draft is deterministic), so the
    output is too; only the critical path changes.  The draft's ring must hold
    2K+2 positions.  The thread is the C module's own (propose_at_async): a
    Python thread would first need the GIL, which the target's pass holds while
    it schedules its nodes, and started 0.5-0.9 ms late.  ``draft_s`` (and c)
    counts only the draft work left on the critical path.
    """

    def __init__(self, cdraft):
        super().__init__(cdraft)
        self._running = False
        self._ready = None          # (expected pending, proposal, guess) of a kept continuation
        self._k = 0
        self._guess = None
        self.hits = self.misses = 0

    def _join(self):
        if not self._running:
            return None
        self._running = False
        return self.d.wait()

    def reset(self):
        self._join()
        self._ready = None
        self.hits = self.misses = 0
        super().reset()

    def propose(self, history, pending, k, params, rng):
        self._join()
        if not (params.greedy and not params.uses_penalty) or 2 * k + 2 > self.ring:
            self._ready = None              # a kept continuation is overwritten by the new batch
            return super().propose(history, pending, k, params, rng)
        ready, self._ready = self._ready, None
        # a kept continuation is valid only right after its round: same pending, same K,
        # and no tokens committed meanwhile without this draft (auto's n-gram rounds)
        if ready is not None and ready[0] == int(pending) and len(ready[1]) == k and \
                self.pos == len(history):
            proposal, guess = ready[1], ready[2]         # drafted during the last verify
            self.hits += 1
        else:
            if ready is not None:
                self.misses += 1                         # the fresh batch below overwrites it
            self.sync(history)
            toks = self.d.propose_at(int(pending), k, 0, guess=True)
            proposal, guess = toks[:k], toks[k]
            self.forwards += k + 1
        self._k, self._guess = k, guess
        if int(self.d.pos) + 2 * k + 2 <= self.d.cfg.max_seq:   # the continuation's positions fit
            self.d.propose_at_async(guess, k, k + 1, True)
            self._running = True
        return proposal, None

    def commit(self, n: int):
        ahead = self._join()
        if ahead is not None and n == self._k + 1:
            self.d.commit_keep(n)                        # keep [g, e_0..e_{K-1}] pending
            self._ready = (self._guess, ahead[:self._k], ahead[self._k])
            self.forwards += self._k + 1
        else:
            self.d.commit(n)                             # drops the continuation

    def close(self):
        try:
            self._join()
        finally:
            super().close()


class NgramDraft(DraftEngine):
    """Prompt-lookup proposals; deterministic, so q is a point mass."""

    name = "ngram"

    def __init__(self, vocab: int, min_n: int = 2, max_n: int = 4):
        self.vocab = vocab
        self.index = NgramIndex(min_n, max_n)
        self.forwards = 0
        self.hits = 0
        self.lookups = 0

    def reset(self):
        self.index.reset()
        self.hits = self.lookups = 0

    def _sync(self, history, pending):
        toks = self.index.tokens
        if len(toks) < len(history):
            self.index.extend(history[len(toks):])
        if len(toks) == len(history):
            self.index.append(int(pending))

    def propose(self, history, pending, k, params, rng):
        self._sync(history, pending)
        self.lookups += 1
        toks = self.index.lookup(k)
        if toks:
            self.hits += 1
        qs = None if params.greedy else [smp.one_hot(t, self.vocab) for t in toks]
        return list(toks), qs


class AutoDraft(DraftEngine):
    """n-gram proposal when the context repeats, the model draft otherwise.

    The model draft sits behind its own small governor (`gate`): when its rolling
    acceptance falls below the threshold, rounds without an n-gram match run as
    AR rounds instead of paying a verify batch for proposals that are rejected,
    and the model draft is re-probed after `gate.resume_after` such rounds.
    n-gram proposals are never gated (a miss costs nothing to propose)."""

    name = "auto"

    def __init__(self, ngram: NgramDraft, model_draft: DraftEngine, gate: "GovernorConfig | None" = None):
        self.ngram, self.model_draft = ngram, model_draft
        self.gate_cfg = gate or GovernorConfig(window=8, alpha_threshold=0.3, min_rounds=4,
                                               zero_accept_trip=False, resume_after=32)
        self.reset_counters()
        self._pending_commit = None
        self._proposed = 0

    def reset_counters(self):
        self.used_ngram = 0
        self.used_model = 0
        self.gated = 0
        self.gate = Governor(self.gate_cfg)

    @property
    def forwards(self):
        return self.model_draft.forwards

    def reset(self):
        self.ngram.reset()
        self.model_draft.reset()
        self.reset_counters()

    def sync(self, history):
        self.model_draft.sync(history)

    def propose(self, history, pending, k, params, rng):
        toks, qs = self.ngram.propose(history, pending, k, params, rng)
        if toks:
            self.used_ngram += 1
            self._pending_commit = None
            return toks, qs
        if not self.gate.drafting:
            self.gated += 1
            self.gate.ar_tokens(1)
            self._pending_commit = None
            return [], None
        self.used_model += 1
        self._pending_commit = self.model_draft
        toks, qs = self.model_draft.propose(history, pending, k, params, rng)
        self._proposed = len(toks)
        return toks, qs

    def commit(self, n: int):
        if self._pending_commit is not None:
            self._pending_commit.commit(n)
            self.gate.record(n - 1, self._proposed)
        self._pending_commit = None

    def close(self):
        self.model_draft.close()


# ---------------------------------------------------------------------------
# governor

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


# ---------------------------------------------------------------------------
# statistics

@dataclass
class DecodeStats:
    mode: str = "ar"
    draft: str = "none"
    k: int = 0
    strict: bool = False
    prompt_tokens: int = 0
    tokens: int = 0
    rounds: int = 0
    spec_rounds: int = 0
    ar_rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    governor_trips: int = 0
    governor_resumes: int = 0
    draft_forwards: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    ar_s: float = 0.0
    decode_s: float = 0.0
    ar_token_s: float | None = None   # reference target AR-token time (measured or calibrated)
    stop_reason: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def alpha(self):
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_round(self):
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def tok_s(self):
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def c(self):
        # draft_s times the proposal calls only: k proposals + 1 state-covering forward per
        # round (draft_forwards also counts untimed catch-up forwards, so it is not used here)
        timed_forwards = self.proposed + self.spec_rounds
        if not self.ar_token_s or not timed_forwards:
            return None
        return (self.draft_s / timed_forwards) / self.ar_token_s

    @property
    def v(self):
        if not self.ar_token_s or not self.spec_rounds:
            return None
        return (self.verify_s / self.spec_rounds) / self.ar_token_s

    def to_dict(self) -> dict:
        def r(x, nd=6):
            return None if x is None else round(float(x), nd)
        out = {
            "mode": self.mode, "draft": self.draft, "k": self.k, "strict": self.strict,
            "prompt_tokens": self.prompt_tokens, "tokens": self.tokens, "rounds": self.rounds,
            "spec_rounds": self.spec_rounds, "ar_rounds": self.ar_rounds,
            "proposed": self.proposed, "accepted": self.accepted, "alpha": r(self.alpha, 4),
            "tokens_per_round": r(self.tokens_per_round, 4),
            "governor_trips": self.governor_trips, "governor_resumes": self.governor_resumes,
            "draft_forwards": self.draft_forwards,
            "prefill_s": r(self.prefill_s), "draft_s": r(self.draft_s), "verify_s": r(self.verify_s),
            "ar_s": r(self.ar_s), "decode_s": r(self.decode_s),
            "ar_token_s": r(self.ar_token_s, 8), "c": r(self.c, 4), "v": r(self.v, 4),
            "tok_s": r(self.tok_s, 2), "stop_reason": self.stop_reason,
        }
        out.update(self.extra)
        return out


# ---------------------------------------------------------------------------
# the decoder

class SpeculativeDecoder:
    """One target, an optional draft, a mode.  `generate` may be called repeatedly;
    each call starts from a fresh state."""

    def __init__(self, model, draft: DraftEngine | None = None, mode: str = "spec", k: int = 4,
                 strict: bool = False, params: smp.SamplingParams = smp.GREEDY,
                 governor: GovernorConfig | None = None, forced_alpha: float | None = None):
        if mode not in MODES:
            raise DecodeError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        if not isinstance(k, int) or not (1 <= k <= MAX_K):
            raise DecodeError(f"K={k!r}: must be an integer in 1..{MAX_K}")
        if mode in ("spec", "governed", "forced", "oracle") and draft is None:
            raise DecodeError(f"mode {mode!r} needs a draft engine")
        if mode == "forced":
            if forced_alpha is None or not (0.0 <= forced_alpha <= 1.0):
                raise DecodeError(f"forced alpha {forced_alpha!r}: must be in [0, 1]")
        self.model, self.cfg = model, model.cfg
        self.draft = draft if mode != "ar" else None
        self.mode, self.k, self.strict = mode, k, strict
        self.params = params.validate()
        self.governor_cfg = governor or GovernorConfig()
        self.forced_alpha = forced_alpha
        self.target = TargetRunner(model, ring=k + 1, strict=strict)
        self.stats = DecodeStats()
        self.output: list = []

    def close(self):
        if self.draft is not None:
            self.draft.close()

    # -- helpers -----------------------------------------------------------
    def _calibrate_ar(self, pending, reps: int = 5) -> float:
        """Median time of single-token target forwards, uncommitted (state unchanged);
        the first call is a warm-up (it may compile the step)."""
        times = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            mx.eval(self.target.verify([pending]))
            if i:
                times.append(time.perf_counter() - t0)
            self.target.state.discard()
        return float(np.median(times))

    def generate(self, prompt, max_tokens: int, on_tokens=None, stop_tokens=(),
                 calibrate: bool = False):
        """Decode up to `max_tokens` tokens after `prompt`; returns the emitted tokens.

        `on_tokens(list)` is called with each round's emitted tokens (streaming).
        The statistics of the call are in `self.stats` (kept current, so they are
        valid after an interrupt too)."""
        prompt = [int(t) for t in prompt]
        V, max_seq = self.cfg.vocab, self.cfg.max_seq
        if not prompt:
            raise DecodeError("the prompt is empty: at least one token is needed")
        if len(prompt) > max_seq:
            raise DecodeError(f"the prompt has {len(prompt)} tokens, longer than max_seq={max_seq}")
        bad = [t for t in prompt if not (0 <= t < V)]
        if bad:
            raise DecodeError(f"prompt token {bad[0]} is outside the vocabulary (0..{V - 1})")
        if max_tokens < 0:
            raise DecodeError(f"max_tokens={max_tokens}: must be >= 0")
        params, mode, K = self.params, self.mode, self.k
        greedy = params.greedy
        plain = greedy and not params.uses_penalty
        stop_set = set(int(t) for t in stop_tokens)
        rng = smp.make_rng(params.seed)
        gov = Governor(self.governor_cfg) if mode == "governed" else None
        draft = self.draft
        st = self.stats = DecodeStats(mode=mode, draft=(draft.name if draft else "none"),
                                      k=(K if draft else 0), strict=self.strict,
                                      prompt_tokens=len(prompt))
        out = self.output = []

        t0 = time.perf_counter()
        self.target.reset()
        history = prompt[:-1]          # committed in the target
        pending = prompt[-1]
        self.target.prefill(history)
        if draft is not None:
            draft.reset()
            draft.sync(history)
        st.prefill_s = time.perf_counter() - t0
        if calibrate and max_tokens > 0:
            st.ar_token_s = self._calibrate_ar(pending)
        forced_acc = 0.0
        t_dec = time.perf_counter()
        try:
            while len(out) < max_tokens:
                pos = self.target.pos
                if pos >= max_seq:
                    st.stop_reason = "max_seq"
                    break
                remaining = max_tokens - len(out)
                k_eff = min(K, max_seq - 1 - pos) if draft is not None else 0
                if mode != "forced":  # forced keeps K fixed so its ratio is exact
                    k_eff = min(k_eff, remaining - 1)
                drafting = k_eff > 0 and (gov is None or gov.drafting)
                # 1. draft
                proposal, qs = [], None
                if drafting:
                    ta = time.perf_counter()
                    proposal, qs = draft.propose(history, pending, k_eff, params, rng)
                    st.draft_s += time.perf_counter() - ta
                    st.draft_forwards = draft.forwards
                # 2. verify [pending, d_0..d_{k-1}] in one batch
                batch = [pending] + proposal
                ta = time.perf_counter()
                logits = self.target.verify(batch)
                if plain:
                    targ = mx.argmax(logits, axis=-1).tolist()
                    rows = None
                else:
                    rows = np.array(logits)
                    targ = None
                dt = time.perf_counter() - ta
                m = len(proposal)
                if m:
                    st.verify_s += dt
                    st.spec_rounds += 1
                else:
                    st.ar_s += dt
                    st.ar_rounds += 1
                # 3. accept
                if greedy:
                    if targ is None:
                        ctx = history + [pending]
                        targ = []
                        for j in range(m + 1):
                            targ.append(smp.greedy_token(rows[j], ctx, params))
                            if j < m:
                                ctx.append(proposal[j])
                    n = 0
                    while n < m and proposal[n] == targ[n]:
                        n += 1
                    if mode == "forced" and m:
                        n = self._forced_n(m, forced_acc)
                        forced_acc += self.forced_alpha * m - n
                    correction = targ[n]
                else:
                    n, correction = self._sample_round(rows, history, pending, proposal, qs, rng,
                                                       forced=(mode == "forced"), acc=forced_acc)
                    if mode == "forced" and m:
                        forced_acc += self.forced_alpha * m - n
                # 4. commit n+1 in target and draft
                self.target.commit(n + 1)
                if m:
                    draft.commit(n + 1)
                    st.proposed += m
                    st.accepted += n
                    if gov is not None:
                        gov.record(n, m)
                elif gov is not None and not gov.drafting:
                    gov.ar_tokens(1)
                st.rounds += 1
                history.extend(batch[:n + 1])
                emitted = proposal[:n] + [correction]
                stop = False
                if stop_set:
                    for i, t in enumerate(emitted):
                        if t in stop_set:
                            emitted = emitted[:i + 1]
                            stop = True
                            break
                emitted = emitted[:max_tokens - len(out)]
                out.extend(emitted)
                st.tokens = len(out)
                pending = correction
                if gov is not None:
                    st.governor_trips, st.governor_resumes = gov.trips, gov.resumes
                if on_tokens is not None:
                    on_tokens(emitted)
                if stop:
                    st.stop_reason = "stop_token"
                    break
            else:
                st.stop_reason = "max_tokens"
        except KeyboardInterrupt:
            st.stop_reason = "interrupted"
            raise
        finally:
            st.decode_s = time.perf_counter() - t_dec
            if draft is not None:
                st.draft_forwards = draft.forwards
                if isinstance(draft, (NgramDraft, AutoDraft)):
                    ng = draft if isinstance(draft, NgramDraft) else draft.ngram
                    st.extra["ngram_hits"] = ng.hits
                    st.extra["ngram_lookups"] = ng.lookups
                ahead = draft.model_draft if isinstance(draft, AutoDraft) else draft
                if isinstance(ahead, PipelinedCDraft):
                    st.extra["ahead_hits"], st.extra["ahead_misses"] = ahead.hits, ahead.misses
                if isinstance(draft, AutoDraft):
                    st.extra["auto_model_rounds"] = draft.used_model
                    st.extra["auto_gated_rounds"] = draft.gated
                    st.extra["auto_gate_trips"] = draft.gate.trips
            if st.ar_rounds and st.ar_token_s is None:
                st.ar_token_s = st.ar_s / st.ar_rounds
        return out

    def _forced_n(self, m: int, acc: float) -> int:
        """Accepted count that keeps the running accepted/proposed at forced_alpha."""
        return max(0, min(m, int(math.floor(acc + self.forced_alpha * m + 1e-9))))

    def _sample_round(self, rows, history, pending, proposal, qs, rng, forced=False, acc=0.0):
        params = self.params
        ctx = history + [pending]
        m = len(proposal)
        if forced and m:
            n = self._forced_n(m, acc)
            for j in range(n):
                ctx.append(proposal[j])
            return n, smp.draw(smp.probabilities(rows[n], ctx, params), rng)
        for j in range(m):
            p = smp.probabilities(rows[j], ctx, params)
            ok, tok = smp.accept_or_resample(p, qs[j], proposal[j], rng)
            if not ok:
                return j, tok
            ctx.append(proposal[j])
        return m, smp.draw(smp.probabilities(rows[m], ctx, params), rng)


# ---------------------------------------------------------------------------
# construction helpers

DRAFT_KINDS = ("c", "mlx", "ngram", "auto", "target")


def default_draft_threads() -> int:
    """C draft threads when none are given (SPEL_DRAFT_THREADS, else 1)."""
    from .draft import _threads_from_env
    try:
        return _threads_from_env(None)
    except ValueError:
        return 1


def make_draft(kind: str, model, weights=None, k: int = 4, threads: int | None = None,
               strict: bool = False,
               ngram_n=(2, 4), auto_fallback: str = "c", pipeline: bool = False) -> DraftEngine:
    """Build a draft engine by name.  `weights` (the weights dict) is needed by the
    C draft (threads None = SPEL_DRAFT_THREADS, else 1); "auto" puts the n-gram
    drafter ahead of `auto_fallback`.  `pipeline`: the C draft drafts the next round
    during verification (PipelinedCDraft; greedy)."""
    ring = k + 1
    if kind == "mlx":
        return ModelDraft(model, "draft", ring=ring, strict=strict)
    if kind == "target":
        return ModelDraft(model, "target", ring=ring, strict=strict)
    if kind == "ngram":
        return NgramDraft(model.cfg.vocab, *ngram_n)
    if kind == "c":
        from .draft import CDraft  # the C module; ImportError if not built
        if weights is None:
            raise DecodeError("the C draft needs the checkpoint's weights")
        if pipeline:
            return PipelinedCDraft(CDraft(model.cfg, weights, threads=threads, ring=2 * k + 2))
        return CDraftEngine(CDraft(model.cfg, weights, threads=threads, ring=ring))
    if kind == "auto":
        fallback = make_draft(auto_fallback, model, weights, k, threads, strict, ngram_n, pipeline=pipeline)
        return AutoDraft(NgramDraft(model.cfg.vocab, *ngram_n), fallback)
    raise DecodeError(f"draft {kind!r}: expected one of {', '.join(DRAFT_KINDS)}")
