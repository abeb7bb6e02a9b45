"""The C ternary/q8 draft (``spel_mlx.native.cdraft.CDraft``) as the proposer:
plainly, or drafting the next round while the target verifies this one."""
from __future__ import annotations

import time

from .proposer import Proposer, wants_qs

# The C draft reads at most this many tokens of a long prompt (0: all of them).  Its
# proposals are verified, so what it reads changes speed, never the output; the shipped
# draft (trained on 256-token windows) agrees more with the target past ~2k tokens when
# it reads the last 1,536 only, and drafts faster (docs/decoding.md, "Long prompts").
DRAFT_CONTEXT = 1536


def checked_draft_context(context) -> int:
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise ValueError(f"draft_context={context!r}: must be an integer >= 0 (0: the whole prompt)")
    return context


class CDraftProposer(Proposer):
    """Proposals through the C ``propose`` (k+1 forwards in one call, no commit): the
    argmax, or for sampling and the repetition penalty the C draft's own coupled
    samples (docs/decoding.md), with the penalty's window given once per proposal."""

    name = "c"

    def __init__(self, cdraft, context: int = DRAFT_CONTEXT):
        self.context = checked_draft_context(context)
        self.cdraft = cdraft
        self.ring = max(2, int(cdraft.ring))
        self.forwards = 0
        self._base = int(cdraft.pos)
        self._sampling = None          # (params, seed) the C draft samples with, None: argmax
        self._prefilling = False       # a catch-up is out on the native thread
        self._shadowing = 0            # ... or an unverified proposal of this many tokens
        self._shadow_done = None       # the tokens of one that finished, not yet taken

    @property
    def threads(self):
        return self.cdraft.threads

    def reset(self):
        self._finish_job()
        self._shadow_done = None
        self.cdraft.reset()
        self._base = int(self.cdraft.pos)
        self.forwards = 0

    @property
    def pos(self):
        return int(self.cdraft.pos) - self._base

    def _skip_far_prompt(self, history):
        """A fresh draft starts `context` tokens before the end of a longer history: the
        positions before are taken as read."""
        limit = self.context
        if limit and self.pos == 0 and len(history) > limit and not self._prefilling:
            self._base -= len(history) - limit

    def start_sync(self, history, background: bool = False):
        """The prompt's prefill on the draft's native thread (the batches ``sync`` feeds,
        the same state); ``sync`` waits for it.  One still running is left to finish.
        `background`: at the lowest priority, so the target's threads never wait for it."""
        if not self._poll():
            return
        self._skip_far_prompt(history)
        if self.pos < len(history) and not self._prefilling:
            self.cdraft.prefill_async(list(history[self.pos:]), background)
            self.forwards += len(history) - self.pos
            self._prefilling = True

    def _poll(self) -> bool:
        """Whether the native thread is free: a finished job is taken, a running one left."""
        if self._prefilling or self._shadowing:
            try:
                tokens = self.cdraft.wait(timeout=0.0)
            except TimeoutError:
                return False
            self._took(tokens)
        return True

    def _took(self, tokens):
        """The end of the native thread's job: a shadow proposal commits its `pending`."""
        if self._shadowing:
            self.cdraft.commit(1)
            self._shadow_done, self._shadowing = [int(t) for t in tokens], 0
        self._prefilling = False

    def _finish_job(self):
        """Wait for the native thread's catch-up or shadow proposal, if one is out."""
        if self._prefilling or self._shadowing:
            self._took(self.cdraft.wait())

    settle = _finish_job

    def sync(self, history):
        self._finish_job()
        self._skip_far_prompt(history)
        while self.pos < len(history):
            chunk = list(history[self.pos:self.pos + self.ring])
            self.cdraft.forward(chunk, logits=False)
            self.cdraft.commit(len(chunk))
            self.forwards += len(chunk)

    def _configure(self, params, seed) -> bool:
        """The C draft samples for sampling params or a penalty (argmax otherwise);
        returns whether it samples."""
        key = None if params.plain_greedy else (params, seed)
        if key != self._sampling:
            if key is None:
                self.cdraft.set_sampling(None)
            else:
                self.cdraft.set_sampling(params.temperature, params.top_p, params.repetition_penalty,
                                         params.top_k, params.window, seed, want_q=wants_qs(params))
            self._sampling = key
        return key is not None

    def _context(self, params, tokens, index):
        """The context before a sampled proposal's pending token (at sequence index `index`)."""
        W = params.window
        self.cdraft.set_context(tokens[-W:] if W else (), index)

    def _qs(self, params, start, k):
        return [self.cdraft.probs(start + j) for j in range(k)] if wants_qs(params) else None

    def _q(self, params, offset):
        return self.cdraft.probs(offset) if wants_qs(params) else None

    def propose(self, history, pending, k, params, seed):
        self.sync(history)
        if self._configure(params, seed):
            self._context(params, history, len(history))
        toks = [int(t) for t in self.cdraft.propose(int(pending), k)]
        self.forwards += k + 1
        return toks, self._qs(params, 0, k)

    def commit(self, n: int):
        self.cdraft.commit(n)

    shadows = True

    def shadow(self, history, pending, k, params, seed) -> list:
        # the batch's row 0 is `pending`, which the AR round commits anyway: committing it
        # leaves the committed state a catch-up starts from
        toks, _ = CDraftProposer.propose(self, history, pending, k, params, seed)
        self.cdraft.commit(1)
        return toks

    shadows_async = True

    def shadow_start(self, history, pending, k, params, seed) -> bool:
        """``shadow`` (its catch-up included) on the native thread at the lowest
        priority, off the critical path; False (nothing started) while the thread is still
        busy.  ``shadow_take`` gives the tokens, the same as ``shadow``'s."""
        if not self._poll():
            return False
        self._skip_far_prompt(history)
        self._shadow_done = None
        if self._configure(params, seed):
            self._context(params, history, len(history))
        behind = list(history[self.pos:])       # the catch-up runs first, in the same job
        self.cdraft.shadow_async(behind, int(pending), k)
        self.forwards += len(behind) + k + 1
        self._shadowing = k
        return True

    def shadow_take(self):
        """The tokens of the proposal ``shadow_start`` began, or None while it runs."""
        self._poll()
        done, self._shadow_done = self._shadow_done, None
        return done

    def close(self):
        try:
            self._finish_job()
        finally:
            self.cdraft.close()


class CDraftAheadProposer(CDraftProposer):
    """The C draft drafting the next round on its own native thread while the target verifies.

    With a round's proposal [p, d_0..d_{K-1}] the draft also guesses g, its own choice
    of the token after d_{K-1} (greedy: its argmax; sampling: its coupled sample there,
    which with coupled noise is the target's token wherever the two distributions agree);
    during the verification it proposes [g, e_0..e_{K-1}] continuing its uncommitted
    batch, as if all K were accepted and the correction were g.  If that happens, the
    commit keeps the continuation and the next proposal costs nothing; otherwise
    committing n+1 drops it.  A fresh proposal runs K forwards on the critical path, not
    K+1: d_{K-1} comes from the head of the K-th, and the forward over d_{K-1} (whose head
    gives g) opens the continuation on the draft's thread.  The tokens are
    CDraftProposer's (the same proposals from the same context and noise); the ring holds
    2K+2.  The thread is the C module's own: a
    Python thread would first wait for the GIL, which the target's pass holds.
    ``draft_s`` (and c) counts only the draft work left on the critical path.
    docs/decoding.md, "Drafting ahead".  `policy` (an ``ahead.AheadPolicy``) decides per
    round whether to start a continuation, from the commit's wait for it and the hits;
    None: always.
    """

    def __init__(self, cdraft, policy=None, context: int = DRAFT_CONTEXT):
        super().__init__(cdraft, context)
        self.policy = policy
        self._round = (False, False, None)     # (started a continuation, hit, fresh proposal s)
        self._running = False
        self._ready = None          # (pending, proposal, guess, qs, guess q) of a kept continuation
        self._k = 0
        self._guess = self._guess_q = None
        self._with_guess = False    # the running continuation starts at d_{K-1}: its first token is g
        self._params = None
        self._peeked = None         # the continuation's tokens, joined early by `peek`
        self._proposal = []         # this round's proposal
        self.hits = self.misses = 0

    def _join(self, wanted: bool = True):
        """The continuation's tokens (None if there is none); not `wanted`: stop it early.
        A catch-up or shadow proposal still out is waited for."""
        if self._peeked is not None:
            ahead, self._peeked = self._peeked, None
            return ahead
        if not self._running:
            self._finish_job()
            return None
        self._running = False
        if not wanted:
            self.cdraft.cancel()
        return self.cdraft.wait()

    def peek(self, proposal, k: int, timeout: float):
        """The continuation drafted during this verification, if it is done within
        `timeout` (sampled: drafted from the context and noise a full acceptance leaves);
        one still running is left to the commit, as before."""
        if not self._running or list(proposal) != self._proposal or k != self._k:
            return None
        try:
            ahead = self.cdraft.wait(timeout)
        except TimeoutError:
            return None
        self._running = False
        self._peeked = ahead or []      # the wait ran beside the verification: the policy sees none
        guess, tokens = self._split(self._peeked)
        if len(tokens) < self._k:
            return None
        return guess, [int(t) for t in tokens[:self._k]]

    def _split(self, ahead):
        """(g, [e_0.., g2]) of a continuation's tokens (g: this round's guess)."""
        if self._with_guess:
            return (ahead[0] if ahead else None), ahead[1:]
        return self._guess, ahead

    def reset(self):
        self._join()
        self._ready = self._guess = self._peeked = None
        self.hits = self.misses = 0
        super().reset()

    def sync(self, history):
        self._join()
        if self.pos < len(history):
            self._ready = None      # a kept continuation does not follow tokens committed without it
        super().sync(history)

    def _end_continuation(self):
        """Take or stop a drafted-ahead continuation still out (the native thread runs one
        job at a time); a catch-up or shadow proposal out is left running."""
        if self._running or self._peeked is not None:
            self._join()

    def start_sync(self, history, background: bool = False):
        self._end_continuation()
        if self.pos < len(history) and self._ready is not None:
            self._ready = None      # its rows are still in the draft's batch: one token fed drops them
            super().sync(history[:self.pos + 1])
        super().start_sync(history, background)

    def propose(self, history, pending, k, params, seed):
        self._join()
        if 2 * k + 2 > self.ring:
            self._ready = None              # a kept continuation is overwritten by the new batch
            return super().propose(history, pending, k, params, seed)
        sampled = self._configure(params, seed)
        ready, self._ready = self._ready, None
        start = (self.policy is None or self.policy.ahead) and \
            int(self.cdraft.pos) + 2 * k + 2 <= self.cdraft.cfg.max_seq   # the continuation's positions fit
        # a kept continuation is valid only right after its round: same pending, same K,
        # and no tokens committed meanwhile without this draft (auto's n-gram rounds)
        fresh_s = None
        split = False
        if ready is not None and ready[0] == int(pending) and len(ready[1]) == k and \
                self.pos == len(history):
            _, proposal, guess, qs, guess_q = ready     # drafted during the last verify
            self.hits += 1
        else:
            if ready is not None:
                self.misses += 1                         # the fresh batch below overwrites it
            # one that opens a continuation leaves the forward over d_{K-1} to it
            split = start and k >= 2
            self.sync(history)
            if sampled:
                self._context(params, history, len(history))
            t0 = time.perf_counter()
            toks = self.cdraft.propose_at(int(pending), k - 1 if split else k, 0, guess=True)
            fresh_s = time.perf_counter() - t0
            proposal, guess = toks[:k], (None if split else toks[k])
            qs, guess_q = self._qs(params, 0, k), (None if split else self._q(params, k))
            self.forwards += k if split else k + 1
        self._k, self._guess, self._guess_q, self._params = k, guess, guess_q, params
        self._proposal = [int(t) for t in proposal]
        self._round = (start, fresh_s is None, fresh_s)
        self._with_guess = split
        if start:
            # the continuation's pending token (d_{K-1} when split, else g) and its sequence index
            first, at = (proposal[-1], len(history) + k) if split else (guess, len(history) + k + 1)
            if sampled:
                W = params.window
                tail = (list(history[-W:]) if W else []) + [int(pending)] + list(proposal[:at - len(history) - 1])
                self._context(params, tail, at)
            self.cdraft.propose_at_async(first, k + 1 if split else k, k if split else k + 1, True)
            self._running = True
        return proposal, qs

    def shadow(self, history, pending, k, params, seed) -> list:
        self._join()
        self._ready = None          # a kept continuation's rows are overwritten by this batch
        return super().shadow(history, pending, k, params, seed)

    def shadow_start(self, history, pending, k, params, seed) -> bool:
        self._end_continuation()
        self._ready = None
        return super().shadow_start(history, pending, k, params, seed)

    def commit(self, n: int):
        t0 = time.perf_counter()
        ahead = self._join(wanted=n == self._k + 1)     # a round that rejected: drop it at once
        if self.policy is not None:
            self.policy.round(*self._round, time.perf_counter() - t0)
        self._round = (False, False, None)
        guess, ahead = self._split(ahead or [])
        if len(ahead) > self._k and n == self._k + 1:
            k, params = self._k, self._params
            qs, guess_q = self._qs(params, k + 1, k), self._q(params, 2 * k + 1)   # before the offsets shift
            self.cdraft.commit_keep(n)                   # keep [g, e_0..e_{K-1}] pending
            self._ready = (guess, ahead[:k], ahead[k], qs, guess_q)
            self.forwards += self._k + 1
        else:
            self.cdraft.commit(n)                        # drops the continuation

    def guess(self):
        if self._with_guess and self._guess is None and (self._running or self._peeked is not None):
            # g is the continuation's first token: wait for it (the commit still gets the rest)
            if self._peeked is None:
                self._running = False
                self._peeked = self.cdraft.wait() or []
            if self._peeked:
                self._guess, self._guess_q = self._peeked[0], self._q(self._params, self._k)
        return None if self._guess is None else (self._guess, self._guess_q)

    def close(self):
        try:
            self._join()
        finally:
            super().close()

    def extra_stats(self) -> dict:
        out = {"ahead_hits": self.hits, "ahead_misses": self.misses}
        if self.policy is not None:
            out.update(self.policy.stats())
        return out
