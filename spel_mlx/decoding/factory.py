"""Proposers by name: the ``--draft`` kinds."""
from __future__ import annotations

from dataclasses import dataclass

from .ahead import AheadPolicy, spare_core
from .auto import AutoProposer
from .c_proposer import DRAFT_CONTEXT, CDraftAheadProposer, CDraftProposer, checked_draft_context
from .loop import DecodeError
from .mlx_proposer import MLXProposer
from .ngram import NgramProposer
from .proposer import Proposer
from ..settings import setting

PROPOSER_KINDS = ("c", "mlx", "ngram", "auto", "target")


def default_draft_threads() -> int:
    """C draft threads when none are given (SPEL_DRAFT_THREADS, else 1)."""
    return setting("SPEL_DRAFT_THREADS") or 1


@dataclass(frozen=True)
class DraftOptions:
    """How `make_proposer` builds a draft beyond its kind and length.

    `threads`: the C draft's workers (None: SPEL_DRAFT_THREADS, else 1); `strict`: the
    MLX drafts' strict path; `ngram_n`: the n-gram lookup's (min, max) n; `auto_fallback`:
    the model proposer "auto" puts behind the n-gram one; `ahead`: the C draft drafts
    the next round during verification (CDraftAheadProposer; greedy): True always,
    "auto" while that pays (ahead.AheadPolicy, starting from whether a core looks free);
    `draft_context`: the most tokens of a long prompt the C draft reads (0: all)."""
    threads: int | None = None
    strict: bool = False
    ngram_n: tuple = (2, 4)
    auto_fallback: str = "c"
    ahead: bool | str = False
    draft_context: int = DRAFT_CONTEXT


def c_draft_ring(k: int, ahead) -> int:
    """Ring slots of a C draft proposing k tokens a round: a drafting-ahead one holds two rounds."""
    return 2 * k + 2 if ahead else k + 1


def make_proposer(kind: str, model, weights=None, k: int = 4, options: DraftOptions = DraftOptions(),
                  cdraft=None) -> Proposer:
    """Build a proposer by name (PROPOSER_KINDS).  `weights` (the weights dict) is needed
    by the C draft; `options`: DraftOptions; `cdraft`: a C draft built beforehand for
    these options (its ring must be the one they need), used instead of a new one."""
    o = options
    ring = k + 1
    try:
        checked_draft_context(o.draft_context)
    except ValueError as e:
        raise DecodeError(str(e)) from None
    if kind == "mlx":
        return MLXProposer(model, "draft", ring=ring, strict=o.strict)
    if kind == "target":
        return MLXProposer(model, "target", ring=ring, strict=o.strict)
    if kind == "ngram":
        return NgramProposer(model.cfg.vocab, *o.ngram_n, k=k)
    if kind == "c":
        from ..native.cdraft import CDraft     # CDraft(...) raises ImportError when it is not built
        if weights is None:
            raise DecodeError("the C draft needs the checkpoint's weights")
        ring = c_draft_ring(k, o.ahead)
        if cdraft is not None and (cdraft.ring != ring or cdraft.cfg != model.cfg):
            raise DecodeError(f"the prepared C draft (ring {cdraft.ring}) does not fit these options (ring {ring})")
        draft = cdraft if cdraft is not None else CDraft(model.cfg, weights, threads=o.threads, ring=ring)
        if o.ahead:
            policy = AheadPolicy(start_ahead=spare_core()) if o.ahead == "auto" else None
            return CDraftAheadProposer(draft, policy, o.draft_context)
        return CDraftProposer(draft, o.draft_context)
    if kind == "auto":
        fallback = make_proposer(o.auto_fallback, model, weights, k, o, cdraft)
        return AutoProposer(NgramProposer(model.cfg.vocab, *o.ngram_n, k=k), fallback)
    raise DecodeError(f"draft {kind!r}: expected one of {', '.join(PROPOSER_KINDS)}")
