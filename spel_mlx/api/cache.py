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
"""
from __future__ import annotations

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
