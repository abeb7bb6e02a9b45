"""Which target layers each rank of a pipeline holds: contiguous slices balanced by
parameter bytes, and the checkpoint tensors each rank therefore reads.

Rank 0 holds the embedding before its layers (and the draft beside them), the last
rank the final norm and LM head after its own; those bytes count towards their
stage.  The split minimizes the largest stage (exact, by dynamic programming over
the contiguous splits), so the rank with the least memory is not the limit sooner
than it has to be.  The draft's tensors on rank 0 are not counted: packed, they
are a small fraction of one target layer's FP32 bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import layout
from ..config import ModelConfig


@dataclass(frozen=True)
class Stage:
    """Rank `rank` of `size`: target layers [start, end) and their parameter bytes."""
    rank: int
    size: int
    start: int
    end: int
    nbytes: int

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def layers(self) -> range:
        return range(self.start, self.end)


def layer_nbytes(cfg: ModelConfig, i: int) -> int:
    return sum(s.nbytes for s in layout.layer_specs(cfg, f"layers.{i}.", cfg.layer_kind(i)))


def _head_nbytes(cfg: ModelConfig) -> int:
    """final_norm and lm_head (the last target_specs entries)."""
    return sum(s.nbytes for s in layout.target_specs(cfg)[-2:])


def split_layers(cfg: ModelConfig, size: int) -> list:
    """The `size` stages of the target, each a non-empty contiguous slice of layers,
    with the largest stage's bytes as small as any contiguous split allows (ties go
    to the split with the earlier boundaries)."""
    L = cfg.n_layers
    if not isinstance(size, int) or not 1 <= size <= L:
        raise ValueError(f"a pipeline of {size} ranks: needs 1..{L} (one target layer per rank at least)")
    w = [layer_nbytes(cfg, i) for i in range(L)]
    w[0] += cfg.vocab * cfg.d_model * 4          # the embedding goes with the first layer
    w[-1] += _head_nbytes(cfg)                   # final norm and LM head with the last
    prefix = [0]
    for x in w:
        prefix.append(prefix[-1] + x)
    # best[p][j]: the smallest largest stage over splits of layers [0, j) into p stages
    INF = float("inf")
    best = [[INF] * (L + 1) for _ in range(size + 1)]
    cut = [[0] * (L + 1) for _ in range(size + 1)]
    best[0][0] = 0
    for p in range(1, size + 1):
        for j in range(p, L - (size - p) + 1):
            for i in range(p - 1, j):
                v = max(best[p - 1][i], prefix[j] - prefix[i])
                if v < best[p][j]:
                    best[p][j], cut[p][j] = v, i
    bounds, j = [], L
    for p in range(size, 0, -1):
        i = cut[p][j]
        bounds.append((i, j))
        j = i
    bounds.reverse()
    return [Stage(r, size, a, b, prefix[b] - prefix[a]) for r, (a, b) in enumerate(bounds)]


SHARED = ("tok_emb.weight", "final_norm.weight", "lm_head.weight")   # the draft's, from the target


def draft_tensor_names(cfg: ModelConfig) -> list:
    """What the C draft reads: its own layers and the tensors it shares with the target."""
    return list(SHARED) + [s.name for s in layout.draft_specs(cfg)]


def stage_tensor_names(cfg: ModelConfig, stage: Stage) -> list:
    """The target tensors `stage` holds, in file order."""
    names = ["tok_emb.weight"] if stage.first else []
    for i in stage.layers:
        names += [s.name for s in layout.layer_specs(cfg, f"layers.{i}.", cfg.layer_kind(i))]
    if stage.last:
        names += list(SHARED[1:])
    return names
