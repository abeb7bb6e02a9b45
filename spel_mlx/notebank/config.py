"""NoteBank settings and its error type."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


class NoteBankError(ValueError):
    """Bad NoteBank input: a wrong shape, an unknown option, an out-of-range value."""


RANKERS = ("summed", "votes")
QUERY_SOURCES = ("q", "k")


@dataclass(frozen=True)
class NoteBankConfig:
    chunk: int = 128            # writer chunk length in tokens
    span: int = 16              # note span length in tokens (shorter when the chunk is)
    notes_per_chunk: int = 2    # spans selected per chunk (fewer if they do not fit)
    coords: int = 16            # projected coordinates per channel, stored as BF16
    seed: int = 0x5E1          # seeds the fixed sparse projection
    query_positions: int = 4    # Q: query vectors come from the last Q positions
    top_r: int = 2              # R: notes returned by addressing
    ranker: str = "summed"      # "summed" (default) or "votes" (diagnostic)
    query_source: str = "k"     # which captured vector addresses notes: the query's k or q
    channel_top: float = 1.0    # a position's score: mean distinctiveness of its most
                                # distinctive channels (this fraction of C; 1.0 = all)

    def validate(self) -> "NoteBankConfig":
        for name in ("chunk", "span", "notes_per_chunk", "coords", "query_positions", "top_r"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise NoteBankError(f"NoteBank {name}={v!r}: must be a positive integer")
        if self.ranker not in RANKERS:
            raise NoteBankError(f"NoteBank ranker={self.ranker!r}: expected one of {RANKERS}")
        if self.query_source not in QUERY_SOURCES:
            raise NoteBankError(f"NoteBank query_source={self.query_source!r}: "
                                f"expected one of {QUERY_SOURCES}")
        if not (isinstance(self.channel_top, (int, float)) and 0.0 < self.channel_top <= 1.0):
            raise NoteBankError(f"NoteBank channel_top={self.channel_top!r}: must be in (0, 1]")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise NoteBankError(f"NoteBank seed={self.seed!r}: must be a non-negative integer")
        return self

    def replace(self, **kw) -> "NoteBankConfig":
        return dataclasses.replace(self, **kw).validate()
