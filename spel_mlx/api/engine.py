"""The API's one meeting point with the decoding engine (SPEC 5): settings checked
before any work, a proposer per setting (cached on the LoadedModel), one decoding call
reported round by round -- which emitted tokens were accepted draft proposals and which
was the target's own token (its correction, or the token of an AR round)."""
from __future__ import annotations

import time
from dataclasses import dataclass

# re-exported (SamplingParams, GREEDY, Proposer, checked_prompt, DEFAULT_ACCEPT): the API reaches decoding only here
from ..decoding import (GREEDY, MODES, PROPOSER_KINDS, DecodeError, DecodeOptions, GovernorConfig,  # noqa: F401
                        Proposer, SamplingParams, SpeculativeDecoder)
from ..decoding.c_proposer import DRAFT_CONTEXT, checked_draft_context
from ..decoding import governor_store
from ..decoding.factory import DraftOptions, c_draft_ring, make_proposer
from ..decoding.mlx_proposer import MLXProposer
from ..decoding.loop import MAX_K, checked_prompt  # noqa: F401
from ..decoding.sampling import DEFAULT_ACCEPT, SamplingError  # noqa: F401
from ..model.backends import device_scope
from ..native import clib
from .loading import LoadedModel
from .warm import c_draft_plan, take_draft

DRAFTS = PROPOSER_KINDS
MAX_DRAFT_THREADS = 6
MAX_CACHED_DRAFTS = 4
SettingsError = (DecodeError, SamplingError)


@dataclass(frozen=True)
class DecodeSettings:
    mode: str = "spec"                 # see MODES; forced and oracle are benchmark-only
    draft: object = None               # a name of DRAFTS, a Proposer, a LoadedModel, or None: the default
    k: int | None = None               # proposals per round (None: the config's spec_k)
    strict: bool = False
    draft_threads: int | None = None   # C draft workers (None: SPEL_DRAFT_THREADS, else 1)
    draft_ahead: str = "auto"          # the C draft drafts the next round during verification
    draft_context: int = DRAFT_CONTEXT   # the most tokens of a long prompt the C draft reads (0: all)
    governor: GovernorConfig | None = None
    forced_alpha: float | None = None


@dataclass
class Round:
    tokens: list        # emitted this round (trimmed by a stop token or max_tokens)
    accepted: int       # the leading `accepted` tokens are draft proposals the target accepted
    proposed: int       # draft proposals verified this round (0: an AR round)
    rows: object = None  # the target's logits of each token (numpy [n, V]) where a RowHook kept them


class Cancelled(Exception):
    """Raised from the round hook to stop a call between rounds."""


def check(settings: DecodeSettings, cfg) -> None:
    """Every setting error before any work (DecodeError naming the setting)."""
    if settings.mode not in MODES:
        raise DecodeError(f"mode={settings.mode!r}: expected one of {', '.join(MODES)}")
    k = cfg.spec_k if settings.k is None else settings.k
    if isinstance(k, bool) or not isinstance(k, int) or not (1 <= k <= MAX_K):
        raise DecodeError(f"k={k!r}: must be an integer in 1..{MAX_K}")
    kind = settings.draft
    if not (kind is None or isinstance(kind, (Proposer, LoadedModel)) or (isinstance(kind, str) and kind in DRAFTS)):
        raise DecodeError(f"draft={kind!r}: expected one of {', '.join(DRAFTS)}")
    if settings.governor is not None and not isinstance(settings.governor, GovernorConfig):
        raise DecodeError(f"governor={settings.governor!r}: a GovernorConfig (e.g. GovernorConfig(policy='cost'))")
    if not isinstance(settings.strict, bool):
        raise DecodeError(f"strict={settings.strict!r}: True or False")
    if settings.mode == "oracle" and kind not in (None, "target"):
        raise DecodeError(f"draft={kind!r} conflicts with mode oracle, which drafts with the full target")
    if kind == "c" and not clib.available():
        raise DecodeError("draft='c': the C draft module is not built (reinstall with "
                          "`pip install -e .` or use draft='mlx')")
    t = settings.draft_threads
    if t is not None and (isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= MAX_DRAFT_THREADS):
        raise DecodeError(f"draft_threads={t!r}: must be an integer in 1..{MAX_DRAFT_THREADS}")
    if not isinstance(settings.draft_ahead, str) or settings.draft_ahead not in ("auto", "on", "off"):
        raise DecodeError(f"draft_ahead={settings.draft_ahead!r}: expected auto, on or off")
    try:
        checked_draft_context(settings.draft_context)
    except ValueError as e:
        raise DecodeError(str(e)) from None
    if settings.mode == "forced" and not (isinstance(settings.forced_alpha, (int, float))
                                          and not isinstance(settings.forced_alpha, bool)
                                          and 0.0 <= settings.forced_alpha <= 1.0):
        raise DecodeError(f"forced_alpha={settings.forced_alpha!r}: mode forced needs one in [0, 1]")


def default_draft(mode: str, params) -> str:
    """The draft when none is asked for: for plain greedy `spec`, n-gram proposals where
    the text repeats and the C draft elsewhere (``auto``: greedy text loops, and a copied
    repeat is verified 15 tokens at a time); otherwise the C draft (sampled text repeats
    less: there ``auto`` measured slower).  The MLX draft where the C one is not built.
    docs/decoding.md, "The default draft"."""
    model_draft = "c" if clib.available() else "mlx"
    plain_greedy = params is not None and params.plain_greedy
    return "auto" if mode == "spec" and plain_greedy else model_draft


def _proposer(loaded, settings: DecodeSettings, k: int, params):
    """The proposer for these settings: built once per setting, then reused (the
    engine resets it at the start of every call)."""
    kind = settings.draft
    if settings.mode == "ar":
        return None
    if isinstance(kind, Proposer):
        return kind                                           # a ready proposer (placement)
    if isinstance(kind, LoadedModel):                         # another model: its whole stack drafts
        key = ("model", id(kind.model), k, settings.strict)
        if key not in loaded.drafts:
            loaded.drafts[key] = MLXProposer(kind.model, "target", ring=k + 1, strict=settings.strict)
        return _cached(loaded.drafts, key)
    if settings.mode == "oracle":
        kind = "target"
    if kind is None:
        kind = default_draft(settings.mode, params)
    threads, ahead = c_draft_plan(settings.draft_threads, settings.draft_ahead)
    ahead = ahead if kind in ("c", "auto") else False
    key = (kind, k, threads, ahead, settings.strict, settings.draft_context)
    if key not in loaded.drafts:
        fallback = "c" if clib.available() else "mlx"
        uses_c = kind == "c" or (kind == "auto" and fallback == "c")
        loaded.drafts[key] = make_proposer(kind, loaded.model, loaded.weights, k=k,
                                           options=DraftOptions(threads=threads, strict=settings.strict,
                                                                auto_fallback=fallback,
                                                                ahead=ahead, draft_context=settings.draft_context),
                                           cdraft=take_draft(loaded, threads, c_draft_ring(k, ahead)) if uses_c
                                           else None)
    return _cached(loaded.drafts, key)


def _cached(cache, key):
    """The proposer under `key`, now the most recently used; the oldest beyond
    MAX_CACHED_DRAFTS are closed."""
    cache.move_to_end(key)
    while len(cache) > MAX_CACHED_DRAFTS:
        cache.popitem(last=False)[1].close()
    return cache[key]


def _recall_governor(loaded, proposer, k: int, params):
    """The governor store's key for this call (None: nothing to keep); a proposer's first
    call in this process starts from what an earlier process on this machine learned."""
    if proposer is None or loaded.pipeline is not None or not governor_store.enabled():
        return None
    sampled = params is not None and not params.greedy
    key = governor_store.key(loaded.source, proposer.name, k, sampled, loaded.device)
    if proposer.governor_memory is None:
        proposer.governor_memory = governor_store.recall(key)
    return key


class Decoding:
    """One decoding call.  `stats` is the engine's statistics dict, current after
    every round (and after an interrupt).  `rows_hook`: a RowHook deciding the target's
    tokens on the host (api/rows.py); `cache`: a PromptCache or PrefixCache the call
    starts from and leaves its state in."""

    def __init__(self, loaded, settings: DecodeSettings, params, rows_hook=None, cache=None):
        self.loaded, self.settings, self.params = loaded, settings, params
        self.rows_hook, self.cache = rows_hook, cache
        self.decoder = None
        self._t0 = 0.0

    @property
    def stats(self) -> dict:
        return self.decoder.stats.to_dict() if self.decoder is not None else {}

    def running(self) -> dict:
        """alpha, tokens/round and tok/s so far (tok/s over the decode time, prefill excluded)."""
        st = self.decoder.stats
        dt = time.perf_counter() - self._t0 - st.prefill_s
        return {"alpha": st.alpha, "tokens_per_round": st.tokens_per_round,
                "tok_s": st.tokens / dt if dt > 0 else 0.0, "rounds": st.rounds,
                "prompt_tps": st.prompt_tokens / st.prefill_s if st.prefill_s > 0 else 0.0}

    def run(self, prompt: list, max_tokens: int, on_round, should_stop=None, calibrate: bool = False,
            stop_tokens=()):
        """Decode; `on_round(Round)` after every round.  Returns the emitted tokens.
        `should_stop()` is asked after every round: True ends the call (Cancelled);
        the target emitting one of `stop_tokens` ends it after that token.  The caller
        holds the model (LoadedModel.hold); the target runs on its device (on this thread)."""
        s, loaded = self.settings, self.loaded
        k = loaded.cfg.spec_k if s.k is None else s.k
        with device_scope(loaded.device):
            proposer = _proposer(loaded, s, k, self.params)
            store = _recall_governor(loaded, proposer, k, self.params)
            runner = loaded.pipeline.runner if loaded.pipeline is not None else None
            if self.cache is not None:
                runner = self.cache.runner(prompt)
            self.decoder = SpeculativeDecoder(loaded.model, proposer, s.mode, k=k, params=self.params,
                                              options=DecodeOptions(strict=s.strict, governor=s.governor,
                                                                    forced_alpha=s.forced_alpha, runner=runner,
                                                                    rows_hook=self.rows_hook))
            self._t0 = time.perf_counter()

            def hook(r):
                rows = self.rows_hook.take(len(r.emitted)) if self.rows_hook is not None else None
                on_round(Round(list(r.emitted), len(r.accepted_tokens), len(r.proposed), rows))
                if should_stop is not None and should_stop():
                    raise Cancelled

            ok = False
            try:
                out = self.decoder.generate(prompt, max_tokens, on_round=hook, calibrate=calibrate,
                                            stop_tokens=stop_tokens)
                ok = True
                return out
            except Cancelled:      # between rounds: the state is whole
                ok = True
                raise
            finally:
                if store is not None:
                    governor_store.remember(store, proposer.governor_memory)
                if self.cache is not None:
                    self.cache.settle(self.decoder, prompt, ok)

    @property
    def cached_tokens(self) -> int:
        """Positions this call restored from a prompt cache instead of prefilling them."""
        return getattr(self.decoder.target, "kept", 0) if self.decoder is not None and self.cache is not None else 0

    @property
    def draft_threads(self):
        """Worker threads of the C draft in use, else None."""
        proposer = self.decoder.proposer if self.decoder is not None else None
        return proposer.threads if proposer is not None else None
