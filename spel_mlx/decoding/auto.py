"""``--draft auto``: the n-gram proposal when the context repeats, a model proposer otherwise."""
from __future__ import annotations

from .governor import Governor, GovernorConfig
from .ngram import NgramProposer
from .proposer import Proposer


class AutoProposer(Proposer):
    """n-gram proposal when the context repeats, the fallback (model) proposer otherwise.

    The fallback sits behind its own small governor (`gate`): when its rolling
    acceptance falls below the threshold, rounds without an n-gram match run as
    AR rounds instead of paying a verify batch for proposals that are rejected,
    and the fallback is re-probed after `gate.resume_after` such rounds.
    n-gram proposals are never gated (a miss costs nothing to propose), and set their
    own length (``NgramProposer``: up to its max_k); the fallback proposes at most K."""

    name = "auto"

    def __init__(self, ngram: NgramProposer, fallback: Proposer, gate: GovernorConfig | None = None):
        self.ngram, self.fallback = ngram, fallback
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
    def max_k(self):
        return self.ngram.max_k

    @property
    def forwards(self):
        return self.fallback.forwards

    @property
    def threads(self):
        return self.fallback.threads

    def reset(self):
        self.ngram.reset()
        self.fallback.reset()
        self.reset_counters()

    def sync(self, history):
        self.fallback.sync(history)

    def start_sync(self, history, background: bool = False):
        self.fallback.start_sync(history, background)

    def settle(self):
        self.fallback.settle()

    def propose(self, history, pending, k, params, seed):
        toks, qs = self.ngram.propose(history, pending, k, params, seed)
        if toks:
            self.used_ngram += 1
            self._pending_commit = self.ngram
            return toks, qs
        if not self.gate.drafting:
            self.gated += 1
            self.gate.ar_tokens(1)
            self._pending_commit = None
            return [], None
        self.used_model += 1
        self._pending_commit = self.fallback
        toks, qs = self.fallback.propose(history, pending, min(k, self.ngram.k), params, seed)
        self._proposed = len(toks)
        return toks, qs

    def peek(self, proposal, k, timeout):
        # after an n-gram round, the n-gram's next lookup (if none: a fresh model proposal);
        # after a model round, the n-gram's lookup if it will match, else the continuation
        if self._pending_commit is self.ngram:
            return self.ngram.peek(proposal, k, timeout)
        if self._pending_commit is not self.fallback:
            return None
        nxt = self.fallback.peek(proposal, min(k, self.ngram.k), timeout)
        if nxt is None:
            return None
        copied = self.ngram.index.lookup_after(list(proposal) + [nxt[0]], min(k, self.ngram.length))
        return (nxt[0], copied) if copied else nxt

    def guess(self):
        return self._pending_commit.guess() if self._pending_commit is not None else None

    def commit(self, n: int):
        if self._pending_commit is self.ngram:
            self.ngram.commit(n)
        elif self._pending_commit is not None:
            self._pending_commit.commit(n)
            self.gate.record(n - 1, self._proposed)
        self._pending_commit = None

    def close(self):
        self.fallback.close()

    def extra_stats(self) -> dict:
        return {**self.ngram.extra_stats(), **self.fallback.extra_stats(),
                "auto_model_rounds": self.used_model, "auto_gated_rounds": self.gated,
                "auto_gate_trips": self.gate.trips}
