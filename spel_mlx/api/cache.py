"""mlx-lm's ``prompt_cache`` for a spel model: a chat's next turn starts from the state
the last turn left, instead of prefilling the whole conversation again.

    cache = make_prompt_cache(model)
    generate(model, tokenizer, "Who is Mr. Darcy?", prompt_cache=cache)
    generate(model, tokenizer, " And his friend?", prompt_cache=cache)   # only the new tokens

As in mlx-lm, a call's prompt is what comes after the cache's tokens: the context is
every earlier prompt and every generated token (also those a stop string cut from the
text).  The target's committed state is kept between calls (its KV rows and the GDN
state at the last committed position); the next call prefills only what follows.  The
recurrent state cannot be rolled back past its ring, so a context that does not extend
the state's tokens (a call that ended inside a round on a stop token, a failed call)
starts afresh: the same tokens, a whole prefill.  The draft re-reads the context each
call (its state is cheap to rebuild: the C draft reads at most ``draft_context`` tokens).

The server's cache, ``make_prefix_cache`` (a PrefixCache): many conversations, each
call's prompt the whole context; the target states saved at known positions, the most
recently used kept, a call resuming from the longest one its tokens begin with.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import mlx.core as mx

from ..decoding.target import TargetRunner
from .errors import GenerationError
from .loading import LoadedModel


class CachedTarget(TargetRunner):
    """A TargetRunner whose committed state outlives a call: the next call's ``reset``
    and ``prefill`` keep the positions whose tokens it already holds (`held`)."""

    def __init__(self, model, ring: int, strict: bool):
        super().__init__(model, ring=ring, strict=strict, batches=2)   # room for a pass built ahead
        self.key = (ring, strict)
        self.held: list = []       # the tokens of the committed positions [0, pos)
        self.keep = 0              # positions the coming call keeps
        self.kept = 0              # ... and the last call kept

    def expect(self, prompt: list):
        """Before a call on `prompt`: keep the held positions if they start its history."""
        n = len(self.held)
        ok = n and n < len(prompt) and prompt[:n] == self.held and self.pos == n and not self.state.pending
        self.keep = self.kept = n if ok else 0

    def reset(self):
        if not self.keep:
            super().reset()

    def prefill(self, tokens):
        super().prefill(tokens[self.keep:])

    def settle(self, history, ok: bool):
        """After a call: what the state now holds (nothing reusable after a failure)."""
        self.held = list(history) if ok and self.pos == len(history) and not self.state.pending else []
        self.keep = 0


class PromptCache:
    """A conversation's context with one model: its tokens so far (``tokens``) and the
    target state that covers them (built on the first call)."""

    def __init__(self, loaded):
        self.loaded = loaded
        self.tokens: list = []
        self.target: CachedTarget | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def runner(self, prompt: list):
        """The decoder's ``runner(ring, strict)`` for a call on `prompt` (the whole context)."""
        def make(ring: int, strict: bool) -> CachedTarget:
            if self.target is None or self.target.key != (ring, strict):
                self.target = CachedTarget(self.loaded.model, ring, strict)
            self.target.expect(prompt)
            return self.target
        return make

    def settle(self, decoder, prompt: list, ok: bool):
        """After a call: the context grows by what it generated; the state says what it holds."""
        self.tokens = list(prompt) + list(decoder.output)
        if self.target is not None:
            self.target.settle(decoder.call.history if getattr(decoder, "call", None) else [], ok)

    @property
    def reused(self) -> int:
        """Positions the last call took from the cache instead of prefilling them."""
        return self.target.kept if self.target is not None else 0


def make_prompt_cache(model, max_kv_size=None) -> PromptCache:
    """An empty prompt cache for `model` (a model from ``load``); mlx-lm's signature.
    max_kv_size: only None (the KV caches grow with use, up to max_seq)."""
    if not isinstance(model, LoadedModel):
        raise GenerationError(f"model: a model from spel_mlx.load(), not {type(model).__name__}", "model")
    if max_kv_size is not None:
        raise GenerationError("max_kv_size: not supported (no rotating KV cache; the caches grow with use, "
                              "up to max_seq)", "max_kv_size")
    return PromptCache(model)


class _PrefixTarget(TargetRunner):
    """A TargetRunner that starts a call from a PrefixCache entry (``kept`` positions
    restored instead of prefilled) and gives the cache the states it can reuse."""

    def __init__(self, model, ring: int, strict: bool, cache: "PrefixCache"):
        super().__init__(model, ring=ring, strict=strict, batches=2)   # room for a pass built ahead
        self.key, self.cache = (ring, strict), cache
        self.start = None          # (positions, Snapshot) the coming call restores
        self.kept = 0              # positions the last call restored
        # Fast passes may round differently with the batch they run in; where every pass
        # size gives each row the bits of a single step (strict, or ops whose rows are
        # independent: spel_model.rows_independent), the state at any position is the
        # one a call without the cache reaches; else only at whole prefill batches from 0.
        independent = getattr(model, "rows_independent", lambda stack, m: False)
        self.exact_anywhere = strict or all(independent("target", m) for m in range(1, self.ring + 1))

    def reset(self):
        super().reset()
        self.kept = 0
        if self.start is not None:
            self.kept, snap = self.start
            self.state.restore(snap)
            self.pos = self.kept

    def prefill(self, tokens):
        stop = len(tokens) if self.exact_anywhere else len(tokens) // self.ring * self.ring
        if stop > self.kept:
            super().prefill(tokens[self.kept:stop])
            self.cache.store(self.key, tokens[:stop], self.state.snapshot())
        super().prefill(tokens[max(stop, self.kept):])


class PrefixCache:
    """The server's prompt cache: target states saved at known token positions, the
    `size` most recently used (0: off).  A call whose context begins with an entry's
    tokens (an earlier prompt, or prompt + completion where rows are independent of
    their batch) restores that state and prefills only the rest, with the tokens a call
    without the cache gives.
    Calls run one at a time (LoadedModel.hold); `lock` guards the entries against the
    threads that read the counts."""

    def __init__(self, loaded, size: int):
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise GenerationError(f"size={size!r}: an integer >= 0 (0: no cache)", "size")
        self.loaded, self.size = loaded, size
        self.entries: OrderedDict = OrderedDict()    # (ring, strict, tokens) -> Snapshot
        self.lock = threading.Lock()
        self.hits = self.misses = 0
        self.target: _PrefixTarget | None = None     # reused while calls share its pass shape

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        """The bytes the entries hold (their KV rows and GDN states)."""
        with self.lock:
            return sum(_snapshot_bytes(s) for s in self.entries.values())

    def lookup(self, key, history: list):
        """(positions, Snapshot) of the longest entry whose tokens begin `history`, or None."""
        best = None
        with self.lock:
            for k in self.entries:
                n = len(k[2])
                if k[:2] == key and n <= len(history) and (best is None or n > len(best[2])) \
                        and tuple(history[:n]) == k[2]:
                    best = k
            if best is None:
                self.misses += 1
                return None
            self.hits += 1
            self.entries.move_to_end(best)
            return len(best[2]), self.entries[best]

    def store(self, key, tokens: list, snap):
        if not self.size or not tokens:
            return
        # own copies: the committed slot may be a row of a whole batch's stacked states
        snap.gdn = {i: (S * 1.0, tail * 1.0) for i, (S, tail) in snap.gdn.items()}
        mx.eval([a for p in snap.gdn.values() for a in p])
        with self.lock:
            self.entries[(*key, tuple(tokens))] = snap
            self.entries.move_to_end((*key, tuple(tokens)))
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)

    def runner(self, prompt: list):
        """The decoder's ``runner(ring, strict)`` for a call on `prompt`."""
        def make(ring: int, strict: bool) -> _PrefixTarget:
            # one state at a time (its GDN ring alone is 2 x ring slots of every layer's S)
            target = self.target
            if target is None or target.key != (ring, strict):
                target = self.target = _PrefixTarget(self.loaded.model, ring, strict, self)
            target.start = self.lookup((ring, strict), prompt[:-1]) if self.size else None
            return target
        return make

    def settle(self, decoder, prompt: list, ok: bool):
        """After a call: the state after prompt + completion is an entry too, where exact."""
        target = getattr(decoder, "target", None)
        if not isinstance(target, _PrefixTarget):
            return
        target.start = None
        history = decoder.call.history if getattr(decoder, "call", None) else []
        if ok and target.exact_anywhere and target.pos == len(history) and not target.state.pending:
            self.store(target.key, history, target.state.snapshot())


def _snapshot_bytes(snap) -> int:
    return sum(a.nbytes for p in list(snap.gdn.values()) + list(snap.kv.values()) if p for a in p)


def make_prefix_cache(model, size: int = 8) -> PrefixCache:
    """A PrefixCache of `size` entries for `model` (a model from ``load``)."""
    if not isinstance(model, LoadedModel):
        raise GenerationError(f"model: a model from spel_mlx.load(), not {type(model).__name__}", "model")
    return PrefixCache(model, size)
