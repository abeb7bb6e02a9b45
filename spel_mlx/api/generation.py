"""``generate`` and ``stream_generate``, as mlx-lm's: text from a loaded model, one
response per token, each saying whether the draft proposed it.

    from spel_mlx import load, generate, stream_generate
    model, tokenizer = load()
    print(generate(model, tokenizer, "Elizabeth was", max_tokens=64, seed=2))
    for r in stream_generate(model, tokenizer, "It is a truth", max_tokens=32):
        print(r.text, end="")

Both first check every argument (options.prepare: a GenerationError naming the
parameter, before any work).  ``stream_generate(..., rounds=True)`` gives one
RoundResponse per speculative round instead (request.py).  docs/api.md lists what
differs from mlx-lm and why.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import GenerationError
from .options import DEFAULT_MAX_TOKENS, prepare
from .request import RoundResponse
from .rows import logprobs_of


@dataclass
class GenerationResponse:
    """One token, as mlx-lm's GenerationResponse (its fields, in its order), plus the
    round it came in and, on the last response, the engine's statistics."""

    text: str                      # the text this token adds ("" while a UTF-8 sequence is open)
    token: int | None              # None only when the call gave no token at all
    from_draft: bool               # an accepted draft proposal (False: the target's own token)
    prompt_tokens: int             # tokens of the prompt given (after a prompt cache's)
    prompt_tps: float              # prompt tokens / prefill seconds
    generation_tokens: int         # tokens so far, this one included
    generation_tps: float          # decode tokens/s so far (prefill excluded)
    peak_memory: float             # GB, MLX's peak so far
    finish_reason: str | None = None   # last response only: "stop", "length" or "cancelled"
    round: int = 0                 # the speculative round that gave it (1-based)
    stats: dict = field(default_factory=dict)   # last response only: the engine's statistics
    row: object = field(default=None, repr=False)

    @property
    def logprobs(self):
        """The target's log-probabilities [V] (mx.array) where the token was chosen, None
        where the rows stayed on the device (plain greedy: pass logprobs=True)."""
        return None if self.row is None else logprobs_of(self.row)


def per_token(rounds):
    """GenerationResponses from an iterator of RoundResponses: one per token, the last
    carrying the finish reason and any text held back to the end (as mlx-lm's last
    response carries its final token)."""
    held = None
    try:
        for r in rounds:
            rows = r.rows if r.rows is not None else [None] * len(r.tokens)
            first = r.generation_tokens - len(r.tokens)
            for i, token in enumerate(r.tokens):
                if held is not None:
                    yield held
                held = GenerationResponse(r.token_text[i], token, r.from_draft[i], r.prompt_tokens, r.prompt_tps,
                                          first + i + 1, r.tok_s, r.peak_memory, round=r.round, row=rows[i])
            if r.finish_reason is None:
                continue
            if held is None:      # nothing generated (max_tokens 0, a stop string at once)
                held = GenerationResponse("", None, False, r.prompt_tokens, r.prompt_tps, 0, 0.0, r.peak_memory)
            held.text += r.text[len("".join(r.token_text)):]
            held.finish_reason, held.stats = r.finish_reason, r.stats
            held.generation_tps, held.peak_memory = r.tok_s, r.peak_memory
            yield held
            held = None
    finally:
        rounds.close()


def stream_generate(model, tokenizer, prompt, max_tokens: int = DEFAULT_MAX_TOKENS, draft_model=None,
                    stream=None, *, rounds: bool = False, **options):
    """Yield a GenerationResponse per token (mlx-lm's argument order and fields); the
    last has ``finish_reason`` set.  ``rounds=True``: a RoundResponse per speculative
    round, then a closing one.

    prompt: a string or token ids.  max_tokens: -1 for no limit (up to max_seq).
    draft_model: a model from load() (its whole stack drafts), a draft name, or None
    (spel's own draft).  mlx-lm's keywords: sampler, logits_processors, num_draft_tokens
    (= k), prompt_cache (make_prompt_cache), prompt_progress_callback; the rest of
    generate_step's where they change nothing (docs/api.md).

    spel's sampling keywords (not with a sampler or logits_processors): temperature (0 =
    exact greedy; default 0.7), top_p (0.95), top_k (0 = off), repetition_penalty (1.1
    when sampling, 1.0 at temperature 0), seed (same seed, same text), accept ("coupled",
    the default: the text of mode "ar" for the seed; or "residual": the lossless rule of
    sampled speculation).  stop: strings that end the output, not included.  logprobs:
    None (given where the rows reach the host: sampling, a sampler), True, False.
    Decoding: mode ("spec", "ar", "governed"), draft ("c", "mlx", "ngram", "auto";
    default "auto" for greedy spec, else the C draft when built), k (proposals per
    round), governor (a GovernorConfig), strict, draft_threads, draft_ahead ("auto",
    "on", "off"), draft_context (the most tokens of a long prompt the C draft reads; 0: all).

    Arguments are checked now; decoding starts at the first `next`, on the process's
    generation thread; closing (or dropping) the iterator stops it after the current round."""
    if not isinstance(rounds, bool):
        raise GenerationError(f"rounds={rounds!r}: True or False", "rounds")
    responses = prepare(model, tokenizer, prompt, max_tokens, draft_model=draft_model, stream=stream,
                        **options).stream()
    return responses if rounds else per_token(responses)


def generate(model, tokenizer, prompt, verbose: bool = False, **options) -> str:
    """The generated text (keywords as `stream_generate`'s, max_tokens among them);
    verbose prints it as it comes, then the statistics, as mlx-lm's does."""
    if not isinstance(verbose, bool):
        raise GenerationError(f"verbose={verbose!r}: True or False (generate's fourth argument is verbose, "
                              "as in mlx-lm: pass max_tokens by name)", "verbose")
    request = prepare(model, tokenizer, prompt, **options)
    parts = []

    def collect(r: RoundResponse):
        parts.append(r.text)
        if verbose:
            print(r.text, end="", flush=True)

    if verbose:
        print("=" * 10)
    last = request.run(on_response=collect)
    if verbose:
        st = last.stats
        print("\n" + "=" * 10)
        print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {last.generation_tokens} tokens, {last.tok_s:.3f} tokens-per-sec")
        print(f"Peak memory: {last.peak_memory:.3f} GB")
        print(f"Speculation: alpha {st['alpha']:.3f}, {st['tokens_per_round']:.2f} tokens/round, "
              f"{st['rounds']} rounds, finish {last.finish_reason}")
    return "".join(parts)
