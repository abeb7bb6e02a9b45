"""Training data: token files cached per tokenizer, deterministic batches, held-out
windows, and the mixing of target-generated (on-policy) windows into draft batches.

Batch i is drawn from a generator seeded by (seed, i), so a resumed run sees the same
data in the same order."""
from __future__ import annotations

import os

import numpy as np

from ..atomic import save_npy
from ..tokenizer import encode_documents
from .config import TrainError


def load_tokens(data_dir: str, tokenizer, split: str) -> np.ndarray:
    """Token ids of data_dir/{split}.txt (the end-of-text id where a document ends),
    cached next to it per tokenizer."""
    txt = os.path.join(data_dir, f"{split}.txt")
    if not os.path.exists(txt):
        raise TrainError(f"{txt} not found: run `python -m spel_mlx.corpus --out {data_dir}` first")
    cache = os.path.join(data_dir, f"{split}.{tokenizer.name}.npy")
    src_mtime = max(os.path.getmtime(txt), os.path.getmtime(getattr(tokenizer, "path", txt)))
    if os.path.exists(cache) and os.path.getmtime(cache) >= src_mtime:
        return np.load(cache)
    ids = np.asarray(encode_documents(tokenizer, open(txt, encoding="utf-8").read()), dtype=np.int32)
    save_npy(cache, ids)
    return ids


def batch_at(tokens: np.ndarray, step: int, seed: int, batch: int, seq: int):
    """Batch `step` (deterministic in (seed, step)): x, y int32 [batch, seq]."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq - 1, size=batch)
    idx = starts[:, None] + np.arange(seq + 1)[None, :]
    w = tokens[idx]
    return w[:, :-1], w[:, 1:]


def eval_windows(tokens: np.ndarray, seq: int, max_tokens: int):
    """Non-overlapping held-out windows (fixed, in order)."""
    n = min((len(tokens) - 1) // seq, max(1, max_tokens // seq))
    idx = np.arange(n)[:, None] * seq + np.arange(seq + 1)[None, :]
    w = tokens[idx]
    return w[:, :-1], w[:, 1:]


def load_onpolicy_rows(path: str, seq: int, vocab: int) -> np.ndarray:
    """Target-generated windows int [n, >= seq+1] of token ids < vocab, checked."""
    try:
        rows = np.load(path)
    except (OSError, ValueError) as e:
        raise TrainError(f"{path}: cannot read on-policy windows ({e})") from None
    if rows.ndim != 2 or rows.shape[1] < seq + 1 or \
            rows.min(initial=0) < 0 or rows.max(initial=0) >= vocab:
        raise TrainError(f"{path}: expected int windows [n, >= {seq + 1}] of token ids "
                         f"< {vocab}, got shape {rows.shape}")
    return rows


def mix_onpolicy(x, y, rows: np.ndarray, step: int, seed: int, frac: float):
    """Replace the first round(frac * batch) rows of a batch by target-generated
    windows (deterministic in (seed, step), like batch_at)."""
    n = int(round(frac * x.shape[0]))
    if n <= 0 or rows is None or len(rows) == 0:
        return x, y
    rng = np.random.default_rng([seed, step, 1])
    w = rows[rng.integers(0, len(rows), size=n), :x.shape[1] + 1]
    x, y = x.copy(), y.copy()
    x[:n], y[:n] = w[:, :-1], w[:, 1:]
    return x, y
