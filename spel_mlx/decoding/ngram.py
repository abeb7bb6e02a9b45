"""Zero-parameter n-gram (prompt-lookup) drafting: the index and its proposer.

Proposal: find the most recent earlier occurrence of the context's last n
tokens (n from `max_n` down to `min_n`) and copy the tokens that followed it.
The context is everything the target has seen plus the pending token, so the
lookup also finds repeats in the generated text itself.  A match d tokens back
says the text repeats with period d, so a proposal longer than d goes on with
the tokens it has just copied.

An index of n-gram -> last end position is kept incrementally, so a lookup is
O(max_n) dictionary probes, not a scan of the context.

Length: a proposal costs nothing to make, only its verify rows, so its length follows
the text: after a round that accepted every proposed token the next may be GROW
longer, after a rejection it is one shorter, never below the decoder's K nor past
``max_k`` (docs/decoding.md, "n-gram proposal length").
"""
from __future__ import annotations

from . import sampling as smp
from .proposer import Proposer, wants_qs

# 16 verify rows: the target's ring holds them already (target.PREFILL_RING)
NGRAM_MAX_K = 15
GROW = 2


class NgramIndex:
    """Incremental map from each n-gram (min_n..max_n) to where it last ended."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not (1 <= min_n <= max_n):
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n (got {min_n}, {max_n})")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list = []
        self._last: dict = {}   # (n-gram tuple) -> index just past its most recent end

    def reset(self):
        self.tokens = []
        self._last = {}

    def extend(self, tokens):
        for t in tokens:
            self.append(int(t))

    def append(self, token: int, replaced: dict | None = None):
        """`replaced`: filled with the earlier entry (or None) of every n-gram it moves."""
        toks = self.tokens
        toks.append(token)
        end = len(toks)
        # Register the n-grams ending *before* the newest token: an n-gram is a
        # usable match only when at least one token follows it.
        for n in range(self.min_n, self.max_n + 1):
            start = end - 1 - n
            if start < 0:
                break
            key = tuple(toks[start:end - 1])
            if replaced is not None and key not in replaced:
                replaced[key] = self._last.get(key)
            self._last[key] = end - 1

    def lookup_after(self, tokens, k: int) -> list:
        """``lookup(k)`` once `tokens` are appended, leaving the index as it was."""
        n0, replaced = len(self.tokens), {}
        try:
            for t in tokens:
                self.append(int(t), replaced)
            return self.lookup(k)
        finally:
            del self.tokens[n0:]
            for key, end in replaced.items():
                if end is None:
                    del self._last[key]
                else:
                    self._last[key] = end

    def lookup(self, k: int) -> list:
        """Up to k tokens that followed the latest earlier occurrence of the longest
        matching suffix; [] when none matches."""
        toks = self.tokens
        L = len(toks)
        for n in range(min(self.max_n, L), self.min_n - 1, -1):
            pos = self._last.get(tuple(toks[L - n:]))
            if pos is not None:
                return periodic(toks[pos:pos + k], L - pos, k)
        return []


def periodic(copied: list, period: int, k: int) -> list:
    """`copied` (the tokens after a match `period` back, at most `period` of them)
    extended to k tokens with that period."""
    out = list(copied)
    while len(out) < k:
        out.append(out[len(out) - period])
    return out


def propose_ngram(context, k: int, min_n: int = 2, max_n: int = 4) -> list:
    """Stateless reference lookup (scans the context; used by tests)."""
    L = len(context)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = list(context[L - n:])
        for start in range(L - n - 1, -1, -1):
            if list(context[start:start + n]) == suffix:
                return periodic(context[start + n:start + n + k], L - start - n, k)
    return []


class NgramProposer(Proposer):
    """Prompt-lookup proposals; deterministic, so q is a point mass.  No match is an
    empty proposal: the round runs as an AR round.  ``k``: the decoder's K, the first
    and the least proposal length; ``max_k``: the longest (None: always k)."""

    name = "ngram"

    def __init__(self, vocab: int, min_n: int = 2, max_n: int = 4, k: int = 4, max_k: int | None = NGRAM_MAX_K):
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k={k!r}: must be an integer >= 1")
        if max_k is not None and (not isinstance(max_k, int) or max_k < 1):
            raise ValueError(f"max_k={max_k!r}: must be an integer >= 1 or None")
        self.vocab = vocab
        self.index = NgramIndex(min_n, max_n)
        self.k = k
        self.max_k = None if max_k is None or max_k <= k else max_k
        self.forwards = 0
        self.reset()

    def reset(self):
        self.index.reset()
        self.hits = self.lookups = 0
        self.length = self.k        # the next proposal's length
        self.longest = 0
        self._proposed = 0

    def _sync(self, history, pending):
        toks = self.index.tokens
        if len(toks) < len(history):
            self.index.extend(history[len(toks):])
        if len(toks) == len(history):
            self.index.append(int(pending))

    def propose(self, history, pending, k, params, seed):
        self._sync(history, pending)
        self.lookups += 1
        toks = self.index.lookup(min(k, self.length))
        if toks:
            self.hits += 1
        self._proposed = len(toks)
        self.longest = max(self.longest, len(toks))
        qs = [smp.one_hot(t, self.vocab) for t in toks] if wants_qs(params) else None
        return list(toks), qs

    def commit(self, n: int):
        if self.max_k is None or not self._proposed:
            return
        if n - 1 == self._proposed:       # every proposed token accepted
            self.length = min(self.max_k, self.length + GROW)
        else:
            self.length = max(self.k, self.length - 1)
        self._proposed = 0

    def peek(self, proposal, k, timeout):
        """Its lookup once this round's proposal and the token the same match puts after
        it (the guess) are committed, at the length a full acceptance leaves."""
        m = len(proposal)
        if not m or m != self._proposed:
            return None
        longer = self.index.lookup(m + 1)     # the same match, one token further
        if longer[:m] != list(proposal):
            return None
        guess = longer[m]
        length = self.length if self.max_k is None else min(self.max_k, self.length + GROW)
        nxt = self.index.lookup_after(list(proposal) + [guess], min(k, length))
        return (guess, nxt) if nxt else None

    def extra_stats(self) -> dict:
        return {"ngram_hits": self.hits, "ngram_lookups": self.lookups, "ngram_longest": self.longest}
