"""Proposers by name: the ``--draft`` kinds."""
from __future__ import annotations

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


def make_proposer(kind: str, model, weights=None, k: int = 4, threads: int | None = None,
                  strict: bool = False, ngram_n=(2, 4), auto_fallback: str = "c",
                  ahead: bool | str = False, draft_context: int = DRAFT_CONTEXT) -> Proposer:
    """Build a proposer by name.  `weights` (the weights dict) is needed by the C
    draft (threads None = SPEL_DRAFT_THREADS, else 1); "auto" puts the n-gram
    proposer ahead of `auto_fallback`.  `ahead`: the C draft drafts the next round
    during verification (CDraftAheadProposer; greedy): True always, "auto" while that
    pays (ahead.AheadPolicy, starting from whether a core looks free).  `draft_context`:
    the most tokens of a long prompt the C draft reads (0: all)."""
    ring = k + 1
    try:
        checked_draft_context(draft_context)
    except ValueError as e:
        raise DecodeError(str(e)) from None
    if kind == "mlx":
        return MLXProposer(model, "draft", ring=ring, strict=strict)
    if kind == "target":
        return MLXProposer(model, "target", ring=ring, strict=strict)
    if kind == "ngram":
        return NgramProposer(model.cfg.vocab, *ngram_n, k=k)
    if kind == "c":
        from ..native.cdraft import CDraft     # CDraft(...) raises ImportError when it is not built
        if weights is None:
            raise DecodeError("the C draft needs the checkpoint's weights")
        if ahead:
            policy = AheadPolicy(start_ahead=spare_core()) if ahead == "auto" else None
            return CDraftAheadProposer(CDraft(model.cfg, weights, threads=threads, ring=2 * k + 2), policy,
                                       draft_context)
        return CDraftProposer(CDraft(model.cfg, weights, threads=threads, ring=ring), draft_context)
    if kind == "auto":
        fallback = make_proposer(auto_fallback, model, weights, k, threads, strict, ngram_n, ahead=ahead,
                                 draft_context=draft_context)
        return AutoProposer(NgramProposer(model.cfg.vocab, *ngram_n, k=k), fallback)
    raise DecodeError(f"draft {kind!r}: expected one of {', '.join(PROPOSER_KINDS)}")
