"""``generate`` and ``stream_generate``: text from a loaded model, one response per
speculative round, telling which tokens came from the draft.

    from spel_mlx import load, generate, stream_generate
    model, tokenizer = load()
    print(generate(model, tokenizer, "Elizabeth was", max_tokens=64, seed=2))

Both first build a `Request` (`prepare`): every bad argument is a GenerationError
naming the parameter, raised before any work.  `Request.run` decodes on the calling
thread; `stream_generate` runs it on a thread of its own and yields as rounds finish
(closing the iterator stops the decoding after the current round).
"""
from __future__ import annotations

import queue
import sys
import threading
from dataclasses import dataclass, field

from . import engine
from .text import Detokenizer, StopStrings

# Sampling defaults for the shipped model: small models loop under pure greedy, so a
# light temperature / nucleus / repetition penalty reads better.  The penalty applies
# identically to draft and target, so sampling stays lossless.
DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 0.95
DEFAULT_REPETITION_PENALTY = 1.1
DEFAULT_MAX_TOKENS = 256
# the engine's stop reasons as OpenAI finish reasons
FINISH = {"max_tokens": "length", "max_seq": "length", "stop_token": "stop", "end_of_text": "stop",
          "stop_string": "stop",
          "cancelled": "cancelled", "interrupted": "cancelled"}


class GenerationError(ValueError):
    """A bad argument; `param` names it (as the HTTP server reports it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class GenerationResponse:
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


def _param_of(message: str) -> str | None:
    """The engine's setting errors read "name=value: ..."."""
    head = message.split("=", 1)[0]
    return head if head.isidentifier() else None


class Request:
    """A validated generation request; `run` decodes it."""

    def __init__(self, model, tokenizer, prompt, max_tokens, stop, settings, params):
        self.model, self.tokenizer = model, tokenizer
        self.prompt, self.max_tokens, self.stop, self.params = prompt, max_tokens, stop, params
        self.decoding = engine.Decoding(model, settings, params)
        self._final: dict | None = None

    @property
    def stats(self) -> dict:
        """The statistics: the engine's, current after every round (and after an
        interrupt); once the call ended, those of its closing response."""
        return self._final if self._final is not None else self.decoding.stats

    def run(self, on_response=None, should_stop=None, calibrate: bool = False) -> GenerationResponse:
        """Decode on this thread; `on_response(GenerationResponse)` after every round and
        once at the end; `should_stop()` is asked after every round (True: cancel).
        Returns the closing response."""
        detok = Detokenizer(self.tokenizer, self.prompt)
        stops = StopStrings(self.stop)
        out = []                   # the tokens given out so far
        self._final = None
        state = {"round": 0}

        def respond(pieces, proposed, finish=None, stats=None):
            real = [p for p in pieces if p[0] is not None]      # token None: text held back to the end
            out.extend(p[0] for p in real)
            run = self.decoding.running() if self.decoding.decoder else {}
            r = GenerationResponse(
                "".join(p[1] for p in pieces), [p[0] for p in real], [p[2] for p in real],
                [p[1] for p in real], state["round"], proposed, len(self.prompt), len(out),
                run.get("tok_s", 0.0), run.get("alpha", 0.0), run.get("tokens_per_round", 0.0),
                finish, stats or {})
            if on_response is not None:
                on_response(r)
            return r

        def on_round(rnd: engine.Round):
            state["round"] += 1
            pieces = [[t, detok.push(t), i < rnd.accepted] for i, t in enumerate(rnd.tokens)]
            respond(stops.feed(pieces), rnd.proposed)
            if stops.hit:
                raise engine.Cancelled("stop_string")

        reason = None
        eot = getattr(self.tokenizer, "eot_id", None)
        try:
            self.decoding.run(self.prompt, self.max_tokens, on_round, should_stop=should_stop,
                              calibrate=calibrate, stop_tokens=() if eot is None else (eot,))
        except engine.Cancelled as e:
            reason = e.args[0] if e.args else "cancelled"
        pieces = []
        if not stops.hit:
            tail = detok.flush()
            pieces = stops.feed([[None, tail, False]] if tail else []) + stops.flush()
            reason = "stop_string" if stops.hit else reason
        stats = self.decoding.stats
        stats["stop_reason"] = reason or stats["stop_reason"]
        if stats["stop_reason"] == "stop_token":      # the only stop token is the end of text
            stats["stop_reason"] = "end_of_text"
        if reason == "stop_string":
            stats["tokens"] = len(out) + sum(p[0] is not None for p in pieces)
        self._final = stats
        return respond(pieces, 0, FINISH[stats["stop_reason"]], stats)

    def stream(self):
        """The responses as an iterator, decoded on the process's generation thread;
        closing it stops the decoding after the current round."""
        return _stream(self)


def prepare(model, tokenizer, prompt, max_tokens: int = DEFAULT_MAX_TOKENS, *,
            temperature: float = DEFAULT_TEMPERATURE, top_p: float = DEFAULT_TOP_P, top_k: int = 0,
            repetition_penalty: float | None = None, seed: int | None = None,
            accept: str = engine.DEFAULT_ACCEPT, stop=None,
            mode: str = "spec", draft=None, k: int | None = None, governor=None,
            strict: bool = False, draft_threads: int | None = None, draft_ahead: str = "auto",
            draft_context: int = engine.DRAFT_CONTEXT, forced_alpha: float | None = None) -> Request:
    """A checked Request (see `stream_generate` for the arguments)."""
    cfg = model.cfg
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    else:
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise GenerationError("prompt: a string or a list of token ids", "prompt") from None
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise GenerationError(f"max_tokens={max_tokens!r}: must be an integer >= 0", "max_tokens")
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) and s for s in stop):
        raise GenerationError(f"stop={stop!r}: a string or a list of non-empty strings", "stop")
    if repetition_penalty is None:  # temperature 0 alone means exact greedy
        repetition_penalty = 1.0 if temperature == 0 else DEFAULT_REPETITION_PENALTY
    params = engine.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                   repetition_penalty=repetition_penalty, seed=seed, accept=accept)
    settings = engine.DecodeSettings(mode=mode, draft=draft, k=k, strict=strict, draft_threads=draft_threads,
                                     draft_ahead=draft_ahead, draft_context=draft_context, governor=governor,
                                     forced_alpha=forced_alpha)
    try:
        params.validate()
        engine.check(settings, cfg)
    except engine.SettingsError as e:
        raise GenerationError(str(e), _param_of(str(e))) from None
    try:
        engine.checked_prompt(ids, 0, cfg)
    except engine.SettingsError as e:
        raise GenerationError(str(e), "prompt") from None
    return Request(model, tokenizer, ids, max_tokens, stop, settings, params)


def stream_generate(model, tokenizer, prompt, max_tokens: int = DEFAULT_MAX_TOKENS, **options):
    """Yield a GenerationResponse per speculative round, then a closing one.

    prompt: a string or token ids.  Sampling: temperature (0 = exact greedy; default
    0.7), top_p (0.95), top_k (0 = off), repetition_penalty (1.1 when sampling, 1.0 at
    temperature 0), seed (same seed, same text), accept ("coupled", the default: the
    text of mode "ar" for the seed; or "residual": the lossless rule of sampled
    speculation), stop (strings that end the output,
    not included).  Decoding: mode ("spec", "ar", "governed"), draft ("c", "mlx",
    "ngram", "auto"; default "auto" for greedy spec, else the C draft when built), k
    (proposals per round),
    governor (a GovernorConfig), strict, draft_threads, draft_ahead ("auto", "on",
    "off"), draft_context (the most tokens of a long prompt the C draft reads; 0: all).
    Arguments are checked now; decoding starts at the first `next`."""
    return prepare(model, tokenizer, prompt, max_tokens, **options).stream()


class _GenerationThread:
    """The thread `stream_generate` decodes on: one for the process, started on first
    use, never ending.  MLX keeps its compiled graphs per thread and frees them when a
    thread ends, which needs the GIL: a thread ending while the interpreter shuts down
    aborts the process, and a new thread per call would recompile."""

    _lock = threading.Lock()
    _jobs: queue.SimpleQueue | None = None

    @classmethod
    def submit(cls, job):
        with cls._lock:
            if cls._jobs is None:
                cls._jobs = queue.SimpleQueue()
                threading.Thread(target=cls._serve, args=(cls._jobs,), name="spel-generate",
                                 daemon=True).start()
        cls._jobs.put(job)

    @staticmethod
    def _serve(jobs):
        while True:
            jobs.get()()


def _stream(request: Request):
    responses: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()
    end = object()

    def job():
        try:
            if not stop.is_set():
                request.run(on_response=responses.put, should_stop=stop.is_set)
        except BaseException as e:  # handed to the consumer, raised there
            responses.put(e)
        finally:
            responses.put(end)

    _GenerationThread.submit(job)
    try:
        while (item := responses.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while item is not end:     # the job may still run: wait until it has let go of the model
            item = responses.get()


def generate(model, tokenizer, prompt, max_tokens: int = DEFAULT_MAX_TOKENS, *, verbose: bool = False,
             **options) -> str:
    """The generated text (arguments as `stream_generate`); verbose prints it as it
    comes, then the statistics."""
    request = prepare(model, tokenizer, prompt, max_tokens, **options)
    parts = []

    def collect(r: GenerationResponse):
        parts.append(r.text)
        if verbose:
            print(r.text, end="", flush=True)

    last = request.run(on_response=collect)
    if verbose:
        st = last.stats
        print(f"\n{st['tokens']} tokens, {st['tok_s']:.1f} tok/s, alpha {st['alpha']:.3f}, "
              f"{st['tokens_per_round']:.2f} tokens/round, {last.finish_reason}", file=sys.stderr)
    return "".join(parts)
