"""train(): start or resume a run, then step, log, evaluate and checkpoint until done.

Re-running on an existing run directory resumes it; with the same data order (see
data.batch_at) a resumed run reproduces the losses of an uninterrupted one."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import mlx.core as mx
import numpy as np

from .. import layout
from ..config import ModelConfig
from ..model import copy_target_to_draft, init_params
from .config import TrainConfig, TrainError
from .data import batch_at, eval_windows, load_onpolicy_rows, load_tokens, mix_onpolicy
from .runs import (RunLog, has_checkpoint, load_checkpoint_dir, load_start, lock_run, save_checkpoint,
                   start_tokenizer)
from .schedule import Controller
from .steps import make_eval, make_step


def _fmt_time(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _resume(run: str, extend_to: int | None):
    """(cfg, tc, params, m, v, step, adam_t, controller, old_steps) from RUN's checkpoint."""
    state, cfg, params, m, v = load_checkpoint_dir(run)
    tc = TrainConfig(**state["train"])
    step = state["step"]
    old_steps = None
    if extend_to is not None and extend_to != tc.steps:
        if extend_to < step:
            raise TrainError(f"--steps {extend_to} is below the run's current step {step}")
        old_steps, tc.steps = tc.steps, extend_to
    return cfg, tc, params, m, v, step, state["adam_t"], Controller(**state["controller"]), old_steps


def _initial_params(cfg: ModelConfig | None, tc: TrainConfig):
    """(cfg, params) of a fresh run: a target random or, with --init, continued from a
    trained model (its draft carried along, frozen); a draft from --init."""
    if tc.mode != "draft":
        if not tc.init:
            if cfg is None:
                raise TrainError("target mode needs a model config")
            return cfg, init_params(cfg, tc.seed)
        _, cfg_t, params_t = load_start(tc.init)
        if cfg is not None and cfg != cfg_t:
            raise TrainError(f"--config differs from {tc.init}'s config (a continued target keeps its shape)")
        return cfg_t, dict(params_t)
    if not tc.init:
        raise TrainError("draft mode needs --init (a trained target or draft run, or an exported model)")
    kind, cfg_t, params_t = load_start(tc.init)
    if cfg is not None and cfg != cfg_t:
        raise TrainError(f"--config differs from the target run {tc.init}'s config")
    if tc.draft_map:
        try:
            layers = tuple(int(i) for i in tc.draft_map.split(":"))
            new = dataclasses.replace(cfg_t, draft_map=layers).validate()
        except ValueError as e:
            raise TrainError(f"--draft-map {tc.draft_map!r}: {e}") from None
        if kind != "target" and new.draft_map != cfg_t.draft_map:
            raise TrainError(f"--draft-map {tc.draft_map!r}: a new draft map starts from a target run, "
                             f"not from {tc.init} (a {kind})")
        cfg_t = new
    # from a target run: draft layers start as copies of target layers; from a
    # draft run or an exported model: its distilled draft is trained further
    params = dict(params_t) if kind in ("draft", "export") else \
        copy_target_to_draft(cfg_t, dict(params_t))
    return cfg_t, params


def _inputs(cfg: ModelConfig, tc: TrainConfig, tokenizer):
    """(tokenizer, train tokens, held-out tokens, on-policy rows or None), checked."""
    if tokenizer is None:
        from ..tokenizer import load_tokenizer
        tokenizer = load_tokenizer(cfg.vocab, tc.tokenizer or start_tokenizer(tc.init) or None)
    if tokenizer.vocab_size != cfg.vocab:
        raise TrainError(f"tokenizer has {tokenizer.vocab_size} pieces, model vocab is {cfg.vocab}")
    train_tok = load_tokens(tc.data, tokenizer, "train")
    held_tok = load_tokens(tc.data, tokenizer, "heldout")
    if len(train_tok) < tc.seq + 2 or len(held_tok) < tc.seq + 2:
        raise TrainError(f"{tc.data}: corpus too small for seq={tc.seq}")
    onpolicy_rows = None
    if tc.onpolicy:
        if tc.mode != "draft":
            raise TrainError("--onpolicy data is for draft distillation")
        onpolicy_rows = load_onpolicy_rows(tc.onpolicy, tc.seq, cfg.vocab)
    if tc.distill_temperature != 1.0 and tc.mode != "draft":
        raise TrainError("--distill-temperature is for draft distillation")
    if not (tc.distill_temperature > 0.0 and 0.0 <= tc.distill_t1_weight <= 1.0):
        raise TrainError(f"--distill-temperature {tc.distill_temperature:g} must be > 0 and "
                         f"--distill-t1-weight {tc.distill_t1_weight:g} in [0, 1]")
    return tokenizer, train_tok, held_tok, onpolicy_rows


def _evaluate(eval_fn, params: dict, ex, ey, tc: TrainConfig, eval_bytes: int) -> dict:
    """Held-out nats/token and bits/byte (draft: also KL, top-1 agreement and, with a
    distillation temperature, the objective)."""
    tot = np.zeros(4)
    eb = max(1, tc.batch)
    for i in range(0, len(ex), eb):
        out = eval_fn(params, mx.array(ex[i:i + eb]), mx.array(ey[i:i + eb]))
        mx.eval(*out)
        tot += [o.item() for o in out]
    n = ex.size
    r = {"heldout_nats": tot[0] / n, "heldout_bpb": tot[0] / math.log(2) / eval_bytes}
    if tc.mode == "draft":
        r.update({"heldout_kl": tot[1] / n, "heldout_top1_agree": tot[2] / n})
        if tc.distill_temperature != 1.0:
            r["heldout_objective"] = tot[3] / n
    return r


def _budget_steps(tc: TrainConfig, step: int, spent: float, tps: float, eval_windows_n: int) -> int:
    """The step count that fits what is left of tc.budget_min at `tps` tokens/s."""
    budget = tc.budget_min * 60 - spent
    steps_per_s = tps / (tc.batch * tc.seq)
    n_evals = 1 + budget * steps_per_s / tc.eval_every
    # an evaluation is forward only: taken as 2.5x the training throughput
    eval_cost = n_evals * (eval_windows_n * tc.seq) / max(tps * 2.5, 1)
    return max(step + 10, int(step + (budget - eval_cost) * steps_per_s))


def train(run: str, cfg: ModelConfig | None, tc: TrainConfig, tokenizer=None,
          stop_after: int | None = None, quiet: bool = False, extend_to: int | None = None) -> dict:
    """Train (or resume) in `run`. `stop_after`: stop (with a checkpoint) after this
    many steps of this invocation, simulating a killed run in tests. `extend_to`: on
    resume, lengthen the schedule to this many steps (the cosine is recomputed over
    the new total). Returns a summary."""
    os.makedirs(run, exist_ok=True)
    lock = lock_run(run)  # held until this function returns (the file object closes)
    resume = has_checkpoint(run)
    if resume:
        cfg, tc, params, m, v, step, adam_t, ctl, old_steps = _resume(run, extend_to)
    else:
        cfg, params = _initial_params(cfg, tc)
        m = v = None
        step, adam_t, ctl = 0, 0, Controller()
    tokenizer, train_tok, held_tok, onpolicy_rows = _inputs(cfg, tc, tokenizer)

    names = [s.name for s in layout.tensor_specs(cfg)]
    trainable = [n for n in names if n.startswith("draft.")] if tc.mode == "draft" else \
        [n for n in names if not n.startswith("draft.")]
    train_p = {n: params[n] for n in trainable}
    frozen = {n: params[n] for n in names if n not in train_p}
    if m is None:
        m = {n: mx.zeros_like(train_p[n]) for n in trainable}
        v = {n: mx.zeros_like(train_p[n]) for n in trainable}
    step_fn = make_step(cfg, tc, trainable)
    eval_fn = make_eval(cfg, tc)
    ex, ey = eval_windows(held_tok, tc.seq, tc.eval_tokens)
    eval_bytes = len(tokenizer.decode(ex.reshape(-1).tolist()))  # bytes the eval targets cover (approx.)
    log = RunLog(run, quiet)
    if resume:
        log.event({"event": "resume", "step": step, "steps": tc.steps},
                  f"resumed {run} at step {step}/{tc.steps}" +
                  (f" (schedule extended from {old_steps} steps)" if old_steps is not None else ""))
    else:
        log.event({"event": "start", "model": cfg.to_dict(), "train": dataclasses.asdict(tc),
                   "params": cfg.target_params() if tc.mode == "target" else cfg.draft_params()},
                  f"start {tc.mode}: {sum(int(np.prod(train_p[n].shape)) for n in trainable):,} trainable "
                  f"params, {len(train_tok):,} train / {len(held_tok):,} held-out tokens, "
                  f"batch {tc.batch} x seq {tc.seq}")

    t0 = time.time()
    timed_tokens = 0
    done_here = 0
    last = {}
    train_time = 0.0  # seconds in training steps only (not eval/checkpoint)
    while step < tc.steps:
        t_step = time.time()
        lr = ctl.lr(tc, step)
        x, y = batch_at(train_tok, step, tc.seed, tc.batch, tc.seq)
        if onpolicy_rows is not None:
            x, y = mix_onpolicy(x, y, onpolicy_rows, step, tc.seed, tc.onpolicy_frac)
        loss, gnorm, ok, np_, nm, nv = step_fn(train_p, frozen, m, v, mx.array(x), mx.array(y),
                                               mx.array(lr, mx.float32),
                                               mx.array(adam_t + 1, mx.float32),
                                               mx.array(ctl.spike_threshold(tc), mx.float32))
        mx.eval(loss, gnorm, ok, np_, nm, nv)
        okb = bool(ok.item())
        lossf, gn = float(loss.item()), float(gnorm.item())
        train_p, m, v = np_, nm, nv
        if okb:
            adam_t += 1
        msg = ctl.observe_step(tc, step, lossf, gn, okb)
        if msg:
            log.event({"event": "instability", "step": step, "gnorm": gn}, msg)
        step += 1
        done_here += 1
        # throughput of training steps alone; skip the first steps of an invocation (compilation)
        if done_here > 3:
            timed_tokens += tc.batch * tc.seq
            train_time += time.time() - t_step
        tps = timed_tokens / train_time if train_time > 0 else 0.0
        if tc.budget_min > 0 and done_here == 23 and step < 40 and tps > 0 and not resume:
            # fit the schedule into the time budget, once, early in a fresh run
            tc.steps = _budget_steps(tc, step, time.time() - t0, tps, len(ex))
            log.event({"event": "budget", "steps": tc.steps, "tok_s": tps},
                      f"budget {tc.budget_min:g} min at {tps:.0f} tok/s -> {tc.steps} steps")
        last = {"step": step, "loss": lossf, "lr": lr, "gnorm": gn, "tok_s": tps}
        if step % tc.log_every == 0 or step == tc.steps:
            ctl.history.append([step, ctl.loss_ema])
            eta = (tc.steps - step) * tc.batch * tc.seq / tps if tps else 0
            conv = ctl.convergence(tc.steps)
            cs = (f" | trend {conv['slope_per_doubling']:+.3f}/2x -> {conv['projected_final']:.3f}"
                  if conv else "")
            log.event({"event": "step", **last, "loss_ema": ctl.loss_ema, "skipped": ctl.skipped, **conv},
                      f"[{tc.mode}] step {step}/{tc.steps} loss {lossf:.4f} (ema {ctl.loss_ema:.4f}) "
                      f"lr {lr:.2e} gnorm {gn:.2f} {tps:.0f} tok/s ETA {_fmt_time(eta) if tps else '?'}{cs}")
        if step % tc.eval_every == 0 or step == tc.steps:
            r = _evaluate(eval_fn, {**frozen, **train_p}, ex, ey, tc, eval_bytes)
            # the plateau detector watches what the run minimizes
            watched = r["heldout_nats"] if tc.mode == "target" else r.get("heldout_objective", r["heldout_kl"])
            msg = ctl.observe_eval(tc, step, watched)
            extra = (f" KL {r['heldout_kl']:.4f} top-1 agree {r['heldout_top1_agree']:.3f}"
                     if tc.mode == "draft" else "")
            if "heldout_objective" in r:
                extra += f" objective (T {tc.distill_temperature:g}) {r['heldout_objective']:.4f}"
            log.event({"event": "eval", "step": step, **r},
                      f"[{tc.mode}] eval step {step}: held-out {r['heldout_nats']:.4f} nats/token "
                      f"{r['heldout_bpb']:.4f} bits/byte{extra}")
            if msg:
                log.event({"event": "plateau", "step": step, "lr_scale": ctl.lr_scale}, msg)
            last.update(r)
        if step % tc.ckpt_every == 0 or step == tc.steps or \
                (stop_after is not None and done_here >= stop_after):
            save_checkpoint(run, step, adam_t, {**frozen, **train_p}, m, v, cfg, tc, ctl)
        if stop_after is not None and done_here >= stop_after:
            break
    del lock
    summary = {"step": step, "steps": tc.steps, "skipped": ctl.skipped,
               "plateau_events": ctl.plateau_events, "convergence": ctl.convergence(tc.steps), **last}
    if step >= tc.steps:
        log.event({"event": "done", **summary}, f"done {tc.mode} at step {step}: " +
                  json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()}))
    return summary
