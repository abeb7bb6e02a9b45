"""Statistics of one decoding call (the ``--stats`` JSON) and the cost-model figures c, v."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodeStats:
    mode: str = "ar"
    draft: str = "none"
    k: int = 0
    strict: bool = False
    prompt_tokens: int = 0
    tokens: int = 0
    rounds: int = 0
    spec_rounds: int = 0
    ar_rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    governor_trips: int = 0
    governor_resumes: int = 0
    draft_forwards: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    ar_s: float = 0.0
    decode_s: float = 0.0
    ar_token_s: float | None = None   # reference target AR-token time (measured or calibrated)
    stop_reason: str = ""
    kv_cache: str = "float32"         # the target's K/V cache dtype
    extra: dict = field(default_factory=dict)

    @property
    def alpha(self):
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_round(self):
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def tok_s(self):
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def c(self):
        # draft_s times the proposal calls only: k proposals + 1 state-covering forward per
        # round (draft_forwards also counts untimed catch-up forwards, so it is not used here)
        timed_forwards = self.proposed + self.spec_rounds
        if not self.ar_token_s or not timed_forwards:
            return None
        return (self.draft_s / timed_forwards) / self.ar_token_s

    @property
    def v(self):
        if not self.ar_token_s or not self.spec_rounds:
            return None
        return (self.verify_s / self.spec_rounds) / self.ar_token_s

    def to_dict(self) -> dict:
        def r(x, nd=6):
            return None if x is None else round(float(x), nd)
        out = {
            "mode": self.mode, "draft": self.draft, "k": self.k, "strict": self.strict,
            "prompt_tokens": self.prompt_tokens, "tokens": self.tokens, "rounds": self.rounds,
            "spec_rounds": self.spec_rounds, "ar_rounds": self.ar_rounds,
            "proposed": self.proposed, "accepted": self.accepted, "alpha": r(self.alpha, 4),
            "tokens_per_round": r(self.tokens_per_round, 4),
            "governor_trips": self.governor_trips, "governor_resumes": self.governor_resumes,
            "draft_forwards": self.draft_forwards,
            "prefill_s": r(self.prefill_s), "draft_s": r(self.draft_s), "verify_s": r(self.verify_s),
            "ar_s": r(self.ar_s), "decode_s": r(self.decode_s),
            "ar_token_s": r(self.ar_token_s, 8), "c": r(self.c, 4), "v": r(self.v, 4),
            "tok_s": r(self.tok_s, 2), "stop_reason": self.stop_reason, "kv_cache": self.kv_cache,
        }
        out.update(self.extra)
        return out
