"""Streaming text out of token rounds (incremental detokenization)."""
from __future__ import annotations


class TextStream:
    """Incremental detokenization.  Each round decodes only the tokens not yet
    printed, after a few already-printed ones (so a leading SentencePiece space
    survives); text ending in an incomplete UTF-8 sequence is held back until
    the next round completes it.  O(tokens) overall, not O(tokens^2)."""

    ANCHOR = 8

    def __init__(self, tokenizer, context, out, enabled: bool):
        self.tok, self.out, self.enabled = tokenizer, out, enabled
        self.context = list(context[-self.ANCHOR:])
        self.anchor = list(self.context)
        self.unprinted: list = []
        self.tokens: list = []

    def _decode_after(self, anchor, toks) -> str:
        base = self.tok.decode(anchor)
        full = self.tok.decode(anchor + toks)
        return full[len(base):] if full.startswith(base) else self.tok.decode(toks)

    def text(self) -> str:
        return self._decode_after(self.context, self.tokens)

    def push(self, tokens):
        self.tokens.extend(tokens)
        if not self.enabled:
            return
        self.unprinted.extend(tokens)
        new = self._decode_after(self.anchor, self.unprinted)
        if not new or new.endswith("\ufffd"):
            return
        self.out.write(new)
        self.out.flush()
        self.anchor = (self.anchor + self.unprinted)[-self.ANCHOR:]
        self.unprinted = []

    def finish(self):
        if self.enabled:
            if self.unprinted:
                self.out.write(self._decode_after(self.anchor, self.unprinted))
        else:
            self.out.write(self.text())
        self.out.write("\n")
        self.out.flush()
