"""What a `SpeculativeDecoder.generate` call carries from round to round (`Call`) and
what each round reports (`RoundResult`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Call:
    """One `generate` call's state, which its rounds share: the committed history (it
    grows), the output so far, where to stop and whom to tell, the governor and the
    call's noise seed."""
    history: list
    out: list
    max_tokens: int
    stop_set: set
    on_tokens: object = None     # on_tokens(emitted) after every round
    on_round: object = None      # on_round(RoundResult) after every round
    gov: object = None           # the call's governor (None: every round drafts)
    seed: int = 0

    def room(self) -> int:
        return self.max_tokens - len(self.out)

    def emit(self, tokens: list) -> tuple:
        """The round's tokens cut after a stop token and to the room left, appended to
        the output: (emitted, whether a stop token ended the call)."""
        cut = next((i for i, t in enumerate(tokens) if t in self.stop_set), None)
        emitted, stop = (tokens[:self.room()], False) if cut is None else (tokens[:cut + 1][:self.room()], True)
        self.out.extend(emitted)
        return emitted, stop

    def report(self, emitted: list, result: RoundResult):
        if self.on_tokens is not None:
            self.on_tokens(emitted)
        if self.on_round is not None:
            self.on_round(result)


@dataclass(frozen=True)
class RoundResult:
    """What one round decided, as ``generate(on_round=...)`` reports it."""
    proposed: tuple     # d_0..d_{m-1} from the proposer (empty in an AR round)
    accepted: int       # n: how many of them the target accepted
    correction: int     # t_n: the target's token after them, the next pending token
    emitted: tuple      # proposed[:n] + (correction,), cut at a stop token or max_tokens

    @property
    def accepted_tokens(self) -> tuple:
        """The emitted tokens that came from the proposer."""
        return self.emitted[:self.accepted]

    @property
    def target_tokens(self) -> tuple:
        """The emitted token the target decided itself: the correction, or () when cut."""
        return self.emitted[self.accepted:]
