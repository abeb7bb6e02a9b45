"""The training controller: learning rate, plateau and instability handling, and a
convergence estimate.

Linear warm-up then cosine decay; plateau detection on the held-out loss (LR scaled by
``plateau_factor`` after ``plateau_patience`` evaluations without a gain); gradient-norm
instability detection (non-finite or > spike_factor x the running mean: the update is
skipped and reported; otherwise clipped to ``clip``); a convergence estimate from the
loss trajectory (slope per doubling of steps and a projected final loss)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from .config import TrainConfig

@dataclass
class Controller:
    """LR schedule, plateau and instability detection, convergence estimate."""
    lr_scale: float = 1.0
    best_eval: float = float("inf")
    bad_evals: int = 0
    gnorm_mean: float = 0.0
    gnorm_count: int = 0
    skipped: int = 0
    consecutive_skips: int = 0
    plateau_events: list = field(default_factory=list)
    history: list = field(default_factory=list)   # [step, smoothed train loss]
    loss_ema: float = 0.0

    def lr(self, tc: TrainConfig, step: int) -> float:
        if step < tc.warmup:
            f = (step + 1) / tc.warmup
        else:
            p = min(1.0, (step - tc.warmup) / max(1, tc.steps - tc.warmup))
            f = tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p))
        return tc.lr * f * self.lr_scale

    def spike_threshold(self, tc: TrainConfig) -> float:
        # Only trust the running mean after a few steps; before that only non-finite norms skip.
        return tc.spike_factor * self.gnorm_mean if self.gnorm_count >= 20 else float("inf")

    def observe_step(self, tc: TrainConfig, step: int, loss: float, gnorm: float, ok: bool) -> str:
        msg = ""
        if ok:
            self.consecutive_skips = 0
            k = min(self.gnorm_count + 1, 50)
            self.gnorm_mean += (min(gnorm, tc.clip * 10) - self.gnorm_mean) / k
            self.gnorm_count += 1
            self.loss_ema = loss if self.loss_ema == 0 else 0.95 * self.loss_ema + 0.05 * loss
        else:
            self.skipped += 1
            self.consecutive_skips += 1
            msg = f"instability: step {step} gradient norm {gnorm:.3g} (mean {self.gnorm_mean:.3g}); update skipped"
            if self.consecutive_skips >= 3:
                self.lr_scale *= tc.plateau_factor
                self.consecutive_skips = 0
                msg += f"; 3 in a row, LR scale -> {self.lr_scale:.3g}"
        return msg

    def observe_eval(self, tc: TrainConfig, step: int, loss: float) -> str:
        """loss: held-out CE (target) or KL(target||draft) (draft). A gain must exceed
        plateau_min_delta nats (target) or that fraction of the best KL (draft: KL is ~0.1)."""
        delta = tc.plateau_min_delta if tc.mode == "target" else tc.plateau_min_delta * self.best_eval
        if loss < self.best_eval - (delta if math.isfinite(delta) else 0.0):
            self.best_eval, self.bad_evals = loss, 0
            return ""
        self.best_eval = min(self.best_eval, loss)
        self.bad_evals += 1
        if self.bad_evals >= tc.plateau_patience:
            self.lr_scale *= tc.plateau_factor
            self.bad_evals = 0
            self.plateau_events.append(step)
            return f"plateau: no held-out gain in {tc.plateau_patience} evals; LR scale -> {self.lr_scale:.3g}"
        return ""

    def convergence(self, total_steps: int) -> dict:
        """Fit loss ~ c + b*ln(step) on the last half of the trajectory."""
        h = [(s, l) for s, l in self.history if s > 0]
        if len(h) < 6:
            return {}
        h = h[len(h) // 2:]
        x = np.log([s for s, _ in h])
        y = np.array([l for _, l in h])
        b, c = np.polyfit(x, y, 1)
        last = h[-1][0]
        per_doubling = b * math.log(2)
        proj = c + b * math.log(max(total_steps, last))
        return {"slope_per_doubling": float(per_doubling), "projected_final": float(proj),
                "state": "converged" if per_doubling > -0.01 else "improving"}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

