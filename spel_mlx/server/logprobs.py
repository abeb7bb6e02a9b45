"""The target's log-probabilities of the tokens a request emits (`logprobs`,
`top_logprobs`), by a scoring pass of its own.

The decoding reads only what it needs of the target's rows: greedy rounds take the
argmax on the device and never bring the logits to the host.  Rather than thread the
logits through every kind of round, a Scorer runs the same target model over the
emitted tokens with a decoding state of its own, a response's tokens at a time, on the
decoding thread (docs/server.md, "Log-probabilities").  Each row is log_softmax of the
model's logits (float64), before temperature, top-p and the repetition penalty, as
mlx_lm.server and llama.cpp report them."""
from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..decoding.target import TargetRunner
from ..model.backends import device_scope

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass
class Alternative:
    token: int
    text: str
    bytes: list
    logprob: float

    def chat(self) -> dict:
        return {"token": self.text, "logprob": self.logprob, "bytes": self.bytes}


@dataclass
class TokenLogprob(Alternative):
    top: list      # Alternative, most likely first

    def chat(self) -> dict:
        return {**super().chat(), "top_logprobs": [t.chat() for t in self.top]}


def piece(tokenizer, token: int) -> tuple[str, list]:
    """A token's own text and bytes (a byte-fallback piece is its byte)."""
    p = tokenizer.id_to_piece(token)
    m = _BYTE_PIECE.fullmatch(p)
    if m:
        b = [int(m.group(1), 16)]
        return bytes(b).decode("utf-8", errors="replace"), b
    text = p.replace("\u2581", " ")
    return text, list(text.encode("utf-8"))


class Scorer:
    """Log-probabilities of one request's tokens after its prompt; reused across
    requests (its state keeps the buffers it grew)."""

    def __init__(self, loaded, tokenizer):
        self.loaded, self.tokenizer = loaded, tokenizer
        self.runner = None
        self.pending = None

    def start(self, prompt: list, max_tokens: int):
        with device_scope(self.loaded.device):
            if self.runner is None:
                self.runner = TargetRunner(self.loaded.model, ring=self.loaded.cfg.spec_k + 1)
            self.runner.reset()
            self.runner.reserve(len(prompt) + max_tokens)
            self.runner.prefill(prompt[:-1])
        self.pending = prompt[-1]

    def score(self, tokens: list, top: int) -> list[TokenLogprob]:
        """TokenLogprob of each of `tokens` (the ones after those scored so far), with
        `top` alternatives."""
        if not tokens:
            return []
        seq, rows = [self.pending] + tokens[:-1], []
        with device_scope(self.loaded.device):
            for i in range(0, len(seq), self.runner.ring):
                chunk = seq[i:i + self.runner.ring]
                logits = self.runner.verify(chunk)
                mx.eval(logits)
                self.runner.commit(len(chunk))
                rows.append(np.array(logits, dtype=np.float64))
        self.pending = tokens[-1]
        logits = np.concatenate(rows)
        logp = logits - logits.max(axis=1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
        out = []
        for row, token in zip(logp, tokens):
            best = np.argsort(-row, kind="stable")[:top] if top else []
            out.append(TokenLogprob(token, *piece(self.tokenizer, token), float(row[token]),
                                    [Alternative(int(t), *piece(self.tokenizer, int(t)), float(row[t])) for t in best]))
        return out
