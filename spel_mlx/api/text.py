"""Text out of tokens as they are decoded: per-token text, and stop strings."""
from __future__ import annotations


class Detokenizer:
    """Incremental detokenization, one token at a time.  A token's text is what
    decoding it after a few earlier tokens adds (so a leading SentencePiece space
    survives); a token ending in an incomplete UTF-8 sequence adds "" and its text
    comes with the token that completes it.  O(tokens) overall."""

    ANCHOR = 8

    def __init__(self, tokenizer, context):
        self.tok = tokenizer
        self.anchor = list(context[-self.ANCHOR:])
        self.unprinted: list = []

    def _after(self, anchor, toks) -> str:
        base = self.tok.decode(anchor)
        full = self.tok.decode(anchor + toks)
        return full[len(base):] if full.startswith(base) else self.tok.decode(toks)

    def push(self, token: int) -> str:
        self.unprinted.append(int(token))
        new = self._after(self.anchor, self.unprinted)
        if not new or new.endswith("\ufffd"):
            return ""
        self.anchor = (self.anchor + self.unprinted)[-self.ANCHOR:]
        self.unprinted = []
        return new

    def flush(self) -> str:
        """The text of tokens still held back (an incomplete sequence stays as U+FFFD)."""
        new = self._after(self.anchor, self.unprinted) if self.unprinted else ""
        self.unprinted = []
        return new


class StopStrings:
    """OpenAI-style stop strings over a stream of (token, text) pieces: the output ends
    before the first occurrence of any stop string, which is not included.  Pieces
    whose text could be the start of a stop string are held back until the next
    pieces decide; a piece straddling a stop string keeps its text up to it."""

    def __init__(self, stops=()):
        self.stops = [s for s in stops if s]
        self.held: list = []        # pieces [token, text, ...] not released yet (the rest rides along)
        self.hit = False

    def feed(self, pieces: list) -> list:
        """Pieces that are final now; after a hit (`self.hit`) nothing more comes out."""
        if self.hit:
            return []
        self.held.extend(pieces)
        if not self.stops:
            out, self.held = self.held, []
            return out
        text = "".join(p[1] for p in self.held)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            return self._release(cut, partial=True)
        keep = max((n for s in self.stops for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:n])), default=0)
        return self._release(len(text) - keep, partial=False)

    def flush(self) -> list:
        out, self.held = ([] if self.hit else self.held), []
        return out

    def _release(self, upto: int, partial: bool) -> list:
        """The held pieces whose text lies before `upto` (cut at it when partial)."""
        out, at = [], 0
        while self.held:
            token, text, *rest = self.held[0]
            if at + len(text) <= upto or (not text and at < upto):
                out.append(self.held.pop(0))
            elif partial and at < upto:
                out.append([token, text[:upto - at], *rest])
                self.held.pop(0)
            else:
                break
            at += len(text)
        if partial:
            self.held = []
        return out
