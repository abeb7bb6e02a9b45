"""A checked generation request (``options.prepare`` makes one) and its run: one
``RoundResponse`` per speculative round, telling which tokens came from the draft,
then a closing one.  ``Request.run`` decodes on the calling thread; ``Request.stream``
on the process's generation thread (stream.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from ..platform import huge_pages
from . import engine
from .rows import logprobs_of
from .stream import stream_rounds
from .text import Detokenizer, StopStrings

# the engine's stop reasons as OpenAI finish reasons
FINISH = {"max_tokens": "length", "max_seq": "length", "stop_token": "stop", "end_of_text": "stop",
          "stop_string": "stop",
          "cancelled": "cancelled", "interrupted": "cancelled"}


@dataclass
class RoundResponse:
    """One round's output, or the closing response (``finish_reason`` set, ``stats``
    the engine's statistics, ``text`` whatever was held back, often "")."""

    text: str                      # new text
    tokens: list                   # the tokens that produced it
    from_draft: list               # per token: an accepted draft proposal (True) or the target's token
    token_text: list               # per token: the text it added ("" while a UTF-8 sequence is open)
    round: int                     # rounds decoded so far
    proposed: int                  # draft proposals verified in this round
    prompt_tokens: int
    generation_tokens: int         # tokens output so far
    tok_s: float                   # so far: decode tokens/s (prefill excluded)
    alpha: float                   # so far: accepted / proposed
    tokens_per_round: float        # so far
    finish_reason: str | None = None   # last response only: "stop", "length" or "cancelled"
    stats: dict = field(default_factory=dict)
    prompt_tps: float = 0.0        # prompt tokens / prefill seconds
    peak_memory: float = 0.0       # GB, MLX's peak so far (mx.get_peak_memory)
    rows: object = field(default=None, repr=False)   # per token: the target's logits (see `logprobs`)
    cached_tokens: int = 0         # context positions restored from a prompt cache, not prefilled

    @property
    def logprobs(self) -> list | None:
        """Per token: the target's log-probabilities [V] (mx.array), or None where the
        rows stayed on the device (plain greedy; logprobs=True asks for them)."""
        return None if self.rows is None else [logprobs_of(r) for r in self.rows]


class Request:
    """A validated generation request; `run` decodes it.  `prompt` is the whole context
    (a prompt cache's tokens, then the `given` new ones)."""

    def __init__(self, model, tokenizer, prompt, max_tokens, stop, settings, params, rows_hook=None,
                 cache=None, given=None, progress=None, logprobs=True):
        self.model, self.tokenizer = model, tokenizer
        self.prompt, self.max_tokens, self.stop, self.params = prompt, max_tokens, stop, params
        self.given = len(prompt) if given is None else given
        self.progress, self.logprobs = progress, logprobs
        self.decoding = engine.Decoding(model, settings, params, rows_hook=rows_hook, cache=cache)
        self._final: dict | None = None

    @property
    def stats(self) -> dict:
        """The statistics: the engine's, current after every round (and after an
        interrupt); once the call ended, those of its closing response."""
        return self._final if self._final is not None else self.decoding.stats

    def run(self, on_response=None, should_stop=None, calibrate: bool = False,
            announced: bool = False) -> RoundResponse:
        """Decode on this thread; `on_response(RoundResponse)` after every round and
        once at the end; `should_stop()` is asked after every round (True: cancel).
        Returns the closing response.  `announced`: the caller already counts as waiting
        for the model (LoadedModel.hold: a stream counts itself when it is submitted)."""
        with self.model.hold(announced):
            return self._run(on_response, should_stop, calibrate)

    def _run(self, on_response, should_stop, calibrate) -> RoundResponse:
        detok = Detokenizer(self.tokenizer, self.prompt)
        stops = StopStrings(self.stop)
        out = []                   # the tokens given out so far
        self._final = None
        state = {"round": 0, "prefilled": False}

        def respond(pieces, proposed, finish=None, stats=None):
            # a piece: [token, text, from the draft, its logits row]; token None: text held to the end
            real = [p for p in pieces if p[0] is not None]
            out.extend(p[0] for p in real)
            rows = [p[3] for p in real]
            run = self.decoding.running() if self.decoding.decoder else {}
            r = RoundResponse(
                "".join(p[1] for p in pieces), [p[0] for p in real], [p[2] for p in real],
                [p[1] for p in real], state["round"], proposed, self.given, len(out),
                run.get("tok_s", 0.0), run.get("alpha", 0.0), run.get("tokens_per_round", 0.0),
                finish, stats or {}, run.get("prompt_tps", 0.0), mx.get_peak_memory() / 1e9,
                rows if rows and all(row is not None for row in rows) else None, self.decoding.cached_tokens)
            if on_response is not None:
                on_response(r)
            return r

        def prefilled():
            if not state["prefilled"] and self.progress is not None:
                self.progress(self.given, self.given)
            state["prefilled"] = True

        def on_round(rnd: engine.Round):
            prefilled()
            state["round"] += 1
            if state["round"] == 1:
                huge_pages.release_soon()   # a load's layouts waited for this first token
            rows = rnd.rows if self.logprobs else None
            pieces = [[t, detok.push(t), i < rnd.accepted, None if rows is None else rows[i]]
                      for i, t in enumerate(rnd.tokens)]
            respond(stops.feed(pieces), rnd.proposed)
            if stops.hit:
                raise engine.Cancelled("stop_string")

        if self.progress is not None:
            self.progress(0, self.given)
        reason = None
        eot = getattr(self.tokenizer, "eot_id", None)
        try:
            self.decoding.run(self.prompt, self.max_tokens, on_round, should_stop=should_stop,
                              calibrate=calibrate, stop_tokens=() if eot is None else (eot,))
        except engine.Cancelled as e:
            reason = e.args[0] if e.args else "cancelled"
        prefilled()
        pieces = []
        if not stops.hit:
            tail = detok.flush()
            pieces = stops.feed([[None, tail, False, None]] if tail else []) + stops.flush()
            reason = "stop_string" if stops.hit else reason
        stats = self.decoding.stats
        stats["stop_reason"] = reason or stats["stop_reason"]
        if stats["stop_reason"] == "stop_token":      # the only stop token is the end of text
            stats["stop_reason"] = "end_of_text"
        if reason == "stop_string":
            stats["tokens"] = len(out) + sum(p[0] is not None for p in pieces)
        stats["cached_tokens"] = self.decoding.cached_tokens
        self._final = stats
        return respond(pieces, 0, FINISH[stats["stop_reason"]], stats)

    def stream(self):
        """The responses as an iterator, decoded on the process's generation thread;
        closing it stops the decoding after the current round."""
        return stream_rounds(self)
