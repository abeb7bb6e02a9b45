"""The target's rows as the API sees them: mlx-lm's ``logits_processors`` and
``sampler`` callables, and the rows kept for each emitted token's log-probabilities.

A ``RowHook`` is the decoder's ``rows_hook`` (spel_mlx.decoding.loop): a round hands it
the target's logits for [pending] + proposal, and it returns the target's token of each
row.  How that stays exact (docs/api.md, "Samplers and logits processors"):

* logits processors rewrite each row from the tokens before it, as mlx-lm's loop does;
  the built-in rule (greedy, or the coupled/residual rule at a temperature) then runs
  on the rewritten rows, so every token is still the target's own choice;
* a sampler is called row by row, on each row's log-probabilities, only until its token
  differs from the proposal: one call per emitted token, in order, with the inputs an
  autoregressive loop would give it.  Proposals are checked by equality (the draft
  proposes its argmax), so with the same random state the text is mode "ar"'s.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np


class RowHook:
    """Decides the target's tokens of a round's rows; keeps the (processed) rows of the
    last round for ``take``."""

    def __init__(self, sampler=None, processors=()):
        self.sampler, self.processors = sampler, list(processors)
        self.rows = None

    def __call__(self, rows, history, pending, proposal, sample):
        rows = np.asarray(rows, dtype=np.float32)
        if self.sampler is not None:
            return self._sampled(rows, history, pending, proposal), None
        if self.processors:
            rows = np.stack([self._processed(rows[j], history, pending, proposal[:j]) for j in range(len(rows))])
        self.rows = rows
        return sample(rows)

    def _processed(self, row, history, pending, before) -> np.ndarray:
        """One row after the logits processors (mlx-lm's call: every token so far, [1, V])."""
        if not self.processors:
            return row
        tokens = mx.array(list(history) + [pending] + list(before), dtype=mx.int32)
        logits = mx.array(row)[None]
        for proc in self.processors:
            logits = proc(tokens, logits)
        return np.array(logits.astype(mx.float32)).reshape(-1)

    def _sampled(self, rows, history, pending, proposal) -> list:
        """The sampler's token of each row, up to the first that differs from the proposal."""
        tokens, kept = [], []
        for j in range(len(rows)):
            row = self._processed(rows[j], history, pending, proposal[:j])
            kept.append(row)
            logits = mx.array(row)[None]
            token = self.sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
            tokens.append(_token_id(token, rows.shape[1]))
            if j >= len(proposal) or tokens[-1] != proposal[j]:
                break
        self.rows = np.stack(kept)
        return tokens

    def take(self, n: int):
        """The rows of the last round's first n tokens (numpy [n, V]), then forgotten."""
        rows, self.rows = self.rows, None
        return None if rows is None else rows[:n]


def _token_id(token, vocab: int) -> int:
    """A sampler's answer (an mx.array of one id, as mlx-lm's samplers give, or an int)."""
    value = token.item() if isinstance(token, (mx.array, np.ndarray)) and token.size == 1 else token
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or not 0 <= value < vocab:
        raise ValueError(f"sampler returned {token!r}: expected one token id in 0..{vocab - 1} "
                         f"(an int, or an mx.array holding one)")
    return int(value)


def logprobs_of(row) -> mx.array:
    """Log-probabilities [V] of one row of logits (mlx-lm's logits - logsumexp)."""
    logits = mx.array(row)
    return logits - mx.logsumexp(logits, keepdims=True)
