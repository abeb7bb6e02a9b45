"""The golden footer (SPELV001 in a SPELW001 file, ``golden.*`` tensors in a folder):
n tokens fed one per position from a reset state, and the target / quantized-draft
logits at each position."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .rules import CheckpointError, check_golden_count

FOOTER_MAGIC = b"SPELV001"


@dataclass
class Golden:
    """The golden footer: tokens fed one per position from reset, and the
    target / quantized-draft logits at each position."""
    tokens: np.ndarray          # uint32 [n]
    target_logits: np.ndarray   # float32 [n, V]
    draft_logits: np.ndarray    # float32 [n, V]

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])

    def check(self, cfg, path="<golden>"):
        """The readers' rules for a footer of ``cfg`` (before writing one)."""
        t = np.asarray(self.tokens)
        if t.ndim != 1:
            raise CheckpointError(path, f"golden tokens must be a 1-D array, got shape {t.shape}", field="golden.tokens")
        n, vocab = t.shape[0], cfg.vocab
        check_golden_count(n, cfg, path)
        if t.dtype.kind not in "iu" or int(t.min()) < 0 or int(t.max()) >= vocab:
            raise CheckpointError(path, f"golden tokens must be integers in 0..{vocab - 1}", field="golden.tokens")
        for name, a in (("golden.target_logits", self.target_logits), ("golden.draft_logits", self.draft_logits)):
            a = np.asarray(a)
            if a.shape != (n, vocab) or a.dtype.kind != "f":
                raise CheckpointError(path, f"{name} must be float [{n}, {vocab}], got {a.dtype} {list(a.shape)}",
                                      field=name)


def footer_nbytes(n: int, vocab: int) -> int:
    """Bytes of a SPELV001 footer: magic, u32 n, u32 tokens[n], two f32 [n, V]."""
    return 8 + 4 + 4 * n + 2 * 4 * n * vocab
