"""``prepare``: a generation request's arguments checked before any work, every bad one
a GenerationError naming it -- spel's own keywords and the ones mlx-lm's
``generate_step`` takes (docs/api.md lists what each does here)."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import engine
from .cache import PrefixCache, PromptCache
from .errors import GenerationError
from .loading import LoadedModel
from .request import Request
from .rows import RowHook

# Sampling defaults for the shipped model: small models loop under pure greedy, so a
# light temperature / nucleus / repetition penalty reads better.  The penalty applies
# identically to draft and target, so sampling stays lossless.
DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 0.95
DEFAULT_REPETITION_PENALTY = 1.1
DEFAULT_MAX_TOKENS = 256
# spel's sampling keywords: with mlx-lm's sampler or logits_processors, those decide instead
SAMPLING = ("temperature", "top_p", "top_k", "repetition_penalty", "seed", "accept")


def _param_of(message: str) -> str | None:
    """The engine's setting errors read "name=value: ..."."""
    head = message.split("=", 1)[0]
    return head if head.isidentifier() else None


def prompt_ids(prompt, tokenizer) -> list:
    """Token ids of a prompt: a string, or token ids (a list, tuple, or 1-D integer
    array).  Floats, strings, bools and bytes are not token ids."""
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise GenerationError(f"prompt: character {e.start} ({prompt[e.start]!r}) is a lone surrogate, "
                                  "not text", "prompt") from None
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise GenerationError("prompt: bytes are not a prompt (decode them to a string, or give token ids "
                              "as a list of ints)", "prompt")
    if isinstance(prompt, (mx.array, np.ndarray)):
        ids = np.array(prompt)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise GenerationError(f"prompt: an array of token ids must be 1-D and integer, not {ids.dtype} "
                                  f"of shape {ids.shape}", "prompt")
        return ids.tolist()
    try:
        ids = list(prompt)
    except TypeError:
        raise GenerationError(f"prompt: a string or a list of token ids, not {type(prompt).__name__}",
                              "prompt") from None
    for i, t in enumerate(ids):
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise GenerationError(f"prompt: token {i} is {t!r} ({type(t).__name__}), not an integer id", "prompt")
    return [int(t) for t in ids]


def _mlx_lm_sampling(sampler, logits_processors, given: dict):
    """A RowHook for mlx-lm's callables (None without them); spel's sampling keywords
    must then be left out (the sampler decides, greedy without one, as in mlx-lm)."""
    if sampler is None and logits_processors is None:
        return None
    for name in SAMPLING:
        if given[name] is not None:
            raise GenerationError(f"{name}={given[name]!r}: not with sampler/logits_processors (those decide "
                                  "the target's tokens; make the sampler with the temperature you want)", name)
    if sampler is not None and not callable(sampler):
        raise GenerationError(f"sampler={sampler!r}: a callable, logprobs [1, V] -> token id", "sampler")
    procs = logits_processors if logits_processors is not None else []
    if isinstance(procs, (str, bytes)) or not isinstance(procs, (list, tuple)) or not all(map(callable, procs)):
        raise GenerationError(f"logits_processors={logits_processors!r}: a list of callables "
                              "(tokens, logits) -> logits", "logits_processors")
    return RowHook(sampler, procs)


def _sampling_params(given: dict):
    """SamplingParams from spel's keywords (None: the default)."""
    temperature = DEFAULT_TEMPERATURE if given["temperature"] is None else given["temperature"]
    penalty = given["repetition_penalty"]
    if penalty is None:      # temperature 0 alone means exact greedy
        penalty = 1.0 if temperature == 0 else DEFAULT_REPETITION_PENALTY
    return engine.SamplingParams(temperature=temperature, top_p=DEFAULT_TOP_P if given["top_p"] is None else given["top_p"],
                                 top_k=0 if given["top_k"] is None else given["top_k"], repetition_penalty=penalty,
                                 seed=given["seed"], accept=given["accept"] or engine.DEFAULT_ACCEPT)


def _draft(draft, draft_model, k, num_draft_tokens, model):
    """(draft, k) from spel's draft/k or mlx-lm's draft_model/num_draft_tokens."""
    if draft_model is not None:
        if draft is not None:
            raise GenerationError("draft_model: give draft or draft_model, not both", "draft_model")
        if isinstance(draft_model, LoadedModel) and draft_model.cfg.vocab != model.cfg.vocab:
            raise GenerationError(f"draft_model: its vocabulary has {draft_model.cfg.vocab} tokens, the "
                                  f"target's {model.cfg.vocab}", "draft_model")
        if not (isinstance(draft_model, (LoadedModel, engine.Proposer))
                or isinstance(draft_model, str) and draft_model in engine.DRAFTS):
            raise GenerationError(f"draft_model={draft_model!r}: a model from load(), or a draft name "
                                  f"({', '.join(engine.DRAFTS)})", "draft_model")
        draft = draft_model
    if num_draft_tokens is not None:
        if k is not None:
            raise GenerationError("num_draft_tokens: give k or num_draft_tokens, not both", "num_draft_tokens")
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int):
            raise GenerationError(f"num_draft_tokens={num_draft_tokens!r}: an integer in 1..{engine.MAX_K}",
                                  "num_draft_tokens")
        k = num_draft_tokens
    return draft, k


def _unsupported(stream, max_kv_size, kv_bits, input_embeddings, prefill_step_size, progress):
    """mlx-lm keywords that have no counterpart here: accepted only where they change nothing."""
    for name, value, why in (
            ("stream", stream, "the target runs where load(placement=...) put it"),
            ("max_kv_size", max_kv_size, "the KV caches grow with use, up to max_seq; there is no rotating cache"),
            ("kv_bits", kv_bits, "no quantized KV cache; load(kv_cache='float16') halves its bytes"),
            ("input_embeddings", input_embeddings, "prompts are token ids")):
        if value is not None:
            raise GenerationError(f"{name}: not supported ({why}; docs/api.md)", name)
    if prefill_step_size is not None and (isinstance(prefill_step_size, bool) or not isinstance(prefill_step_size, int)
                                          or prefill_step_size < 1):
        raise GenerationError(f"prefill_step_size={prefill_step_size!r}: an integer >= 1", "prefill_step_size")
    if progress is not None and not callable(progress):
        raise GenerationError("prompt_progress_callback: a callable (processed, total)", "prompt_progress_callback")


def prepare(model, tokenizer, prompt, max_tokens: int = DEFAULT_MAX_TOKENS, *,
            temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
            repetition_penalty: float | None = None, seed: int | None = None, accept: str | None = None,
            stop=None, mode: str = "spec", draft=None, k: int | None = None, governor=None,
            strict: bool = False, draft_threads: int | None = None, draft_ahead: str = "auto",
            draft_context: int = engine.DRAFT_CONTEXT, forced_alpha: float | None = None,
            sampler=None, logits_processors=None, draft_model=None, num_draft_tokens: int | None = None,
            prompt_cache: PromptCache | None = None, prefix_cache: PrefixCache | None = None,
            prompt_progress_callback=None, logprobs: bool | None = None,
            stream=None, max_kv_size=None, kv_bits=None, kv_group_size: int = 64, quantized_kv_start: int = 0,
            prefill_step_size: int | None = None, input_embeddings=None, **unknown):
    """A checked Request (see `stream_generate` for the arguments)."""
    if unknown:
        name = next(iter(unknown))
        raise GenerationError(f"{name}: no such argument (docs/api.md lists them)", name)
    if not isinstance(model, LoadedModel):
        raise GenerationError(f"model: a model from spel_mlx.load(), not {type(model).__name__}", "model")
    cfg = model.cfg
    ids = prompt_ids(prompt, tokenizer)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < -1:
        raise GenerationError(f"max_tokens={max_tokens!r}: an integer >= 0, or -1 for no limit (up to "
                              "max_seq)", "max_tokens")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop)):
        raise GenerationError(f"stop={stop!r}: a string or a list of non-empty strings", "stop")
    _unsupported(stream, max_kv_size, kv_bits, input_embeddings, prefill_step_size, prompt_progress_callback)
    if logprobs not in (None, True, False):
        raise GenerationError(f"logprobs={logprobs!r}: True, False or None", "logprobs")
    given = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "repetition_penalty": repetition_penalty,
             "seed": seed, "accept": accept}
    hook = _mlx_lm_sampling(sampler, logits_processors, given)
    params = engine.GREEDY if hook is not None else _sampling_params(given)
    if hook is None and (logprobs or (logprobs is None and not params.plain_greedy)):
        hook = RowHook()         # the rows reach the host anyway (sampling), or logprobs=True asked for them
    draft, k = _draft(draft, draft_model, k, num_draft_tokens, model)
    settings = engine.DecodeSettings(mode=mode, draft=draft, k=k, strict=strict, draft_threads=draft_threads,
                                     draft_ahead=draft_ahead, draft_context=draft_context, governor=governor,
                                     forced_alpha=forced_alpha)
    try:
        params.validate()
        engine.check(settings, cfg)
    except engine.SettingsError as e:
        raise GenerationError(str(e), _param_of(str(e))) from None
    if hook is not None and hook.sampler is not None and mode in ("forced", "oracle"):
        raise GenerationError(f"sampler: not with mode {mode!r} (a benchmark mode)", "sampler")
    if prompt_cache is not None:
        if not isinstance(prompt_cache, PromptCache) or prompt_cache.loaded is not model:
            raise GenerationError("prompt_cache: one made by make_prompt_cache(model) for this model", "prompt_cache")
        if model.pipeline is not None:
            raise GenerationError("prompt_cache: not with a pipeline across processes", "prompt_cache")
    if prefix_cache is not None:
        if not isinstance(prefix_cache, PrefixCache) or prefix_cache.loaded is not model:
            raise GenerationError("prefix_cache: one made by make_prefix_cache(model) for this model", "prefix_cache")
        if prompt_cache is not None:
            raise GenerationError("prefix_cache: give prompt_cache or prefix_cache, not both", "prefix_cache")
        if model.pipeline is not None:
            raise GenerationError("prefix_cache: not with a pipeline across processes", "prefix_cache")
    context = ids if prompt_cache is None else prompt_cache.tokens + ids
    try:
        engine.checked_prompt(context, 0, cfg)
    except engine.SettingsError as e:
        held = f" (after the prompt cache's {len(prompt_cache.tokens)} tokens)" if prompt_cache else ""
        raise GenerationError(f"{e}{held}", "prompt") from None
    if max_tokens == -1:
        max_tokens = cfg.max_seq
    return Request(model, tokenizer, context, max_tokens, stop or [], settings, params, rows_hook=hook,
                   cache=prompt_cache if prefix_cache is None else prefix_cache, given=len(ids), progress=prompt_progress_callback,
                   logprobs=logprobs is not False)
