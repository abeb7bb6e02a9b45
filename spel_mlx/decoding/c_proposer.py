"""The C ternary/q8 draft (``spel_mlx.native.cdraft.CDraft``) as the proposer:
plainly, or drafting the next round while the target verifies this one."""
from __future__ import annotations

from .proposer import Proposer, propose_stepwise


class CDraftProposer(Proposer):
    """Greedy proposals through the C ``propose`` (k+1 forwards in one call); sampling
    and the repetition penalty one forward at a time, continuing the uncommitted batch."""

    name = "c"

    def __init__(self, cdraft):
        self.cdraft = cdraft
        self.ring = max(2, int(getattr(cdraft, "ring", 2)))
        self.forwards = 0
        self._base = int(cdraft.pos)

    @property
    def threads(self):
        return getattr(self.cdraft, "threads", None)

    def reset(self):
        self.cdraft.reset()
        self._base = int(self.cdraft.pos)
        self.forwards = 0

    @property
    def pos(self):
        return int(self.cdraft.pos) - self._base

    def sync(self, history):
        while self.pos < len(history):
            chunk = list(history[self.pos:self.pos + self.ring])
            self.cdraft.forward(chunk, logits=False)
            self.cdraft.commit(len(chunk))
            self.forwards += len(chunk)

    def propose(self, history, pending, k, params, rng):
        self.sync(history)
        if params.greedy and not params.uses_penalty:
            toks = [int(t) for t in self.cdraft.propose(int(pending), k)]
            self.forwards += k + 1
            return toks, None
        tokens, qs = propose_stepwise(lambda tok, j: self.cdraft.forward([tok], start=j)[0],
                                      history, pending, k, params, rng)
        self.forwards += k + 1
        return tokens, qs

    def commit(self, n: int):
        self.cdraft.commit(n)

    def close(self):
        self.cdraft.close()


class CDraftAheadProposer(CDraftProposer):
    """The C draft drafting the next round on its own native thread while the target verifies.

    Plain greedy only (anything else runs as CDraftProposer).  With a round's proposal
    [p, d_0..d_{K-1}] the draft also guesses g, the token after d_{K-1}; during the
    verification it proposes [g, e_0..e_{K-1}] continuing its uncommitted batch, as if
    all K were accepted and the correction were g.  If that happens, the commit keeps
    the continuation and the next proposal costs nothing; otherwise committing n+1
    drops it.  The tokens are CDraftProposer's (the draft is deterministic); the ring
    holds 2K+2.  The thread is the C module's own: a Python thread would first wait for
    the GIL, which the target's pass holds.  ``draft_s`` (and c) counts only the draft
    work left on the critical path.  docs/decoding.md, "Drafting ahead".
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
        return self.cdraft.wait()

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
            toks = self.cdraft.propose_at(int(pending), k, 0, guess=True)
            proposal, guess = toks[:k], toks[k]
            self.forwards += k + 1
        self._k, self._guess = k, guess
        if int(self.cdraft.pos) + 2 * k + 2 <= self.cdraft.cfg.max_seq:   # the continuation's positions fit
            self.cdraft.propose_at_async(guess, k, k + 1, True)
            self._running = True
        return proposal, None

    def commit(self, n: int):
        ahead = self._join()
        if ahead is not None and n == self._k + 1:
            self.cdraft.commit_keep(n)                   # keep [g, e_0..e_{K-1}] pending
            self._ready = (self._guess, ahead[:self._k], ahead[self._k])
            self.forwards += self._k + 1
        else:
            self.cdraft.commit(n)                        # drops the continuation

    def close(self):
        try:
            self._join()
        finally:
            super().close()

    def extra_stats(self) -> dict:
        return {"ahead_hits": self.hits, "ahead_misses": self.misses}
