"""Placement calibration: measure c and v for each way to place target and draft here,
and rank them by the cost model (SPEC 5) -- the engine behind ``--placement auto``.

A placement is the device of the MLX target (GPU or CPU) and the draft's engine and
device: the C ternary/q8 draft on CPU cores (1..6 threads), or the MLX FP32 draft
layers on the CPU or GPU. For each available one, a short calibration times, on the
real model:

- one AR target token (a single-token forward, not committed),
- one K+1 verification batch (fast mode) -> ``v = verify / AR``,
- one draft token (C ``step`` or an MLX draft-stack forward) -> ``c = draft / AR``,

and projects ``speedup(alpha) = (1 + alpha*K) / ((K+1)*c + v)``. The numerator does not
depend on the placement, so the ranking (smallest ``(K+1)*c + v`` first) is the same at
every alpha; ``alpha`` only sets the projected figure reported beside it.

    from spel_mlx.decoding.placement import calibrate_placement
    ranked = calibrate_placement(model, weights, k=4)
    best = ranked[0]          # best.target_device, best.draft, best.draft_device, best.threads
    stats["placement"] = best.to_dict()

Placements this machine lacks (no GPU) are returned too, after the available ones,
with ``available=False`` and the reason, so a report can say "not available".
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, replace

import mlx.core as mx
import numpy as np

from ..config import ModelConfig
from ..model.backends import device_scope, gpu_available, mx_device
from ..native.cdraft import MAX_THREADS, CDraft
from ..settings import setting
from .factory import make_proposer, DraftOptions


class PlacementError(ValueError):
    """Bad calibration request (K out of range, no weights for the C draft, ...)."""


@dataclass
class Placement:
    target_device: str            # "gpu" | "cpu" (MLX)
    draft: str                    # "c" (ternary/q8 C engine) | "mlx" (FP32 draft layers)
    draft_device: str             # "cpu" | "gpu"
    threads: int | None           # C draft pool workers; None for an MLX draft
    available: bool = True
    reason: str = ""              # why not available / why it failed
    k: int = 4
    ar_token_s: float | None = None
    verify_s: float | None = None
    draft_token_s: float | None = None
    c: float | None = None
    v: float | None = None
    round_cost: float | None = None   # (K+1)*c + v, in AR-token units: the ranking key
    alpha: float | None = None
    projected: float | None = None    # cost-model speedup at `alpha`

    @property
    def name(self) -> str:
        th = f" threads={self.threads}" if self.threads else ""
        return f"target=mlx-{self.target_device} draft={self.draft}-{self.draft_device}{th}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["name"] = self.name
        return d


def speedup(alpha: float, k: int, c: float, v: float) -> float:
    """SPEC 5 cost model."""
    return (1.0 + alpha * k) / ((k + 1) * c + v)


def _median_time(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _prompt(cfg: ModelConfig, prompt, n: int = 8) -> list:
    if prompt is not None and len(prompt) > 0:
        toks = [int(t) for t in prompt][-n:]
    else:  # any valid tokens: timing does not depend on which
        toks = [(7 * i + 65) % cfg.vocab for i in range(n)]
    return toks


def _target_times(model, dev: str, k: int, toks: list, reps: int):
    """(AR token seconds, K+1 fast verification seconds) with the target on `dev`."""
    with device_scope(dev):
        state = model.new_state("target", ring=k + 2)
        model.prefill(toks[:-1], state)
        batch = [toks[-1]] + [toks[i % len(toks)] for i in range(k)]

        def ar():
            mx.eval(model.forward([toks[-1]], state))
            state.discard()

        def verify():
            mx.eval(model.forward(batch, state))
            state.discard()
        return _median_time(ar, reps), _median_time(verify, reps)


def _c_draft_time(cfg, weights, threads: int, k: int, toks: list, reps: int) -> float:
    d = CDraft(cfg, weights, threads=threads, ring=k + 1)
    try:
        for t in toks[:-1]:
            d.step(int(t))
        tok = [int(toks[-1])]

        def step():
            tok[0] = int(np.argmax(d.step(tok[0])))
        return _median_time(step, max(reps, 8), warmup=3)
    finally:
        d.close()


def _mlx_draft_time(model, dev: str, k: int, toks: list, reps: int) -> float:
    with device_scope(dev):
        state = model.new_state("draft", ring=k + 1)
        model.prefill(toks[:-1], state, stack="draft")

        def step():
            mx.eval(model.forward([toks[-1]], state, stack="draft"))
            state.discard()
        return _median_time(step, max(reps, 8))


@dataclass(frozen=True)
class Calibration:
    """What `calibrate_placement` measures: `threads`, the C draft thread counts to try
    (default 1, 2, and the SPEL_DRAFT_THREADS value, capped at the cores and 6);
    `drafts`; `alpha`, the acceptance of the projected figure only (the order does not
    depend on it); `prompt` (default a few seeded tokens); `reps` per timing; and whether
    the unavailable placements are listed too (after the available ones)."""
    threads: tuple | None = None
    drafts: tuple = ("c", "mlx")
    alpha: float = 0.6
    prompt: object = None
    reps: int = 5
    include_unavailable: bool = True


def calibrate_placement(model, weights: dict | None = None, k: int | None = None,
                        how: Calibration = Calibration()) -> list:
    """Measure c and v per placement and return them ranked by the cost model, best
    first (available placements before unavailable ones).

    model: the loaded SpelModel; weights: its weights dict (needed by the C draft;
    without it the C placements are reported as not available); k: speculation depth
    (default cfg.spec_k); how: Calibration."""
    threads, drafts, alpha, prompt, reps = how.threads, how.drafts, how.alpha, how.prompt, how.reps
    cfg = model.cfg
    k = cfg.spec_k if k is None else int(k)
    if not 1 <= k <= 16:
        raise PlacementError(f"K={k}: must be in 1..16")
    if not 0.0 <= alpha <= 1.0:
        raise PlacementError(f"alpha={alpha}: must be in [0, 1]")
    if threads is None:
        cores = os.cpu_count() or 1
        want = {1, 2}
        env = setting("SPEL_DRAFT_THREADS")
        if env is not None:
            want.add(env)
        threads = sorted(t for t in want if 1 <= t <= min(cores, MAX_THREADS)) or [1]
    else:
        threads = [int(t) for t in threads]
        bad = [t for t in threads if not 1 <= t <= MAX_THREADS]
        if bad:
            raise PlacementError(f"draft threads {bad[0]}: must be in 1..{MAX_THREADS}")
    toks = _prompt(cfg, prompt)
    gpu = gpu_available()
    no_gpu = "not available: MLX reports no GPU on this machine"

    targets = {}
    for dev in ("gpu", "cpu"):
        if dev == "gpu" and not gpu:
            targets[dev] = (None, None, no_gpu)
            continue
        try:
            ar_s, ver_s = _target_times(model, dev, k, toks, reps)
            targets[dev] = (ar_s, ver_s, "")
        except Exception as e:
            targets[dev] = (None, None, f"target on {dev} failed: {type(e).__name__}: {e}")

    drafts_timed = []   # (draft, device, threads, seconds or None, reason)
    if "c" in drafts:
        for t in threads:
            if weights is None:
                drafts_timed.append(("c", "cpu", t, None, "not available: no weights for the C draft"))
                continue
            try:
                drafts_timed.append(("c", "cpu", t, _c_draft_time(cfg, weights, t, k, toks, reps), ""))
            except Exception as e:
                drafts_timed.append(("c", "cpu", t, None,
                                     f"C draft failed: {type(e).__name__}: {e}"))
    if "mlx" in drafts:
        for dev in ("gpu", "cpu"):
            if dev == "gpu" and not gpu:
                drafts_timed.append(("mlx", dev, None, None, no_gpu))
                continue
            try:
                drafts_timed.append(("mlx", dev, None, _mlx_draft_time(model, dev, k, toks, reps), ""))
            except Exception as e:
                drafts_timed.append(("mlx", dev, None, None,
                                     f"MLX draft on {dev} failed: {type(e).__name__}: {e}"))

    out = []
    for tdev, (ar_s, ver_s, treason) in targets.items():
        for dname, ddev, th, d_s, dreason in drafts_timed:
            p = Placement(tdev, dname, ddev, th, k=k, alpha=alpha)
            if ar_s is None or d_s is None:
                p.available = False
                p.reason = treason or dreason
            else:
                p.ar_token_s, p.verify_s, p.draft_token_s = ar_s, ver_s, d_s
                p.c, p.v = d_s / ar_s, ver_s / ar_s
                p.round_cost = (k + 1) * p.c + p.v
                p.projected = speedup(alpha, k, p.c, p.v)
            out.append(p)
    ranked = sorted([p for p in out if p.available], key=lambda p: p.round_cost)
    if how.include_unavailable:
        ranked += [p for p in out if not p.available]
    return ranked


def choose_placement(model, weights: dict | None = None, k: int | None = None,
                     how: Calibration = Calibration()) -> Placement:
    """The best available placement (``calibrate_placement(...)[0]``)."""
    ranked = calibrate_placement(model, weights, k, replace(how, include_unavailable=False))
    if not ranked:
        raise PlacementError("no placement could be calibrated on this machine")
    return ranked[0]


class DeviceProposer:
    """Runs a proposer's calls on a given MLX device (e.g. draft=mlx-gpu while the
    target runs on the CPU), delegating everything else to the proposer."""

    def __init__(self, inner, device: str):
        self.inner, self.device = inner, device
        self.name = f"{inner.name}@{device}"

    def __getattr__(self, item):
        return getattr(self.inner, item)

    def _on(self, fn, *a):
        with device_scope(self.device):
            return fn(*a)

    def reset(self):
        return self._on(self.inner.reset)

    def sync(self, history):
        return self._on(self.inner.sync, history)

    def propose(self, *a):
        return self._on(self.inner.propose, *a)

    def commit(self, n):
        return self._on(self.inner.commit, n)

    def close(self):
        return self.inner.close()


def apply_placement(p: Placement, model, weights: dict | None = None, k: int | None = None):
    """Put a chosen placement into effect: MLX's default device becomes the target's,
    and the proposer for it is returned (wrapped to run on its own device when that
    differs from the target's). The caller owns the proposer (``close()`` it)."""
    if not p.available:
        raise PlacementError(f"{p.name}: {p.reason}")
    mx.set_default_device(mx_device(p.target_device))
    proposer = make_proposer(p.draft, model, weights, k=p.k if k is None else k,
                             options=DraftOptions(threads=p.threads or 1))
    if p.draft == "mlx" and p.draft_device != p.target_device:
        proposer = DeviceProposer(proposer, p.draft_device)
    return proposer


def format_ranking(ranked: list) -> str:
    """A short table for ``--stats``."""
    lines = ["rank  placement                                   c       v    (K+1)c+v  projected"]
    for i, p in enumerate(ranked, 1):
        if p.available:
            lines.append(f"{i:>4}  {p.name:<42} {p.c:7.4f} {p.v:7.3f} {p.round_cost:9.3f}  "
                         f"{p.projected:.2f}x at alpha {p.alpha:.2f}")
        else:
            lines.append(f"   -  {p.name:<42} {p.reason}")
    return "\n".join(lines)
