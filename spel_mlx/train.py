"""MLX trainer for the target model and QAT distillation of the draft.

    python -m spel_mlx.train target --run runs/target --config d_model=256,... --budget-min 45
    python -m spel_mlx.train draft  --run runs/draft --init runs/target --budget-min 15
    python -m spel_mlx.train export --run runs/draft --out spel_mlx/assets/default
    python -m spel_mlx.train onpolicy --init runs/target --out runs/onpolicy.npy --minutes 6
    python -m spel_mlx.train all    (corpus -> tokenizer -> target -> draft -> on-policy
                                     windows -> draft on them -> export; re-run to resume)

A run directory holds ``ckpt/`` (params, AdamW moments, controller state,
replaced atomically as a whole), ``log.jsonl`` and ``train.log``.  Re-running
the same command on an existing run directory resumes it: batch i is drawn
from a generator seeded by (seed, i), so a resumed run sees the same data in
the same order and (on the same machine) reproduces the same losses.

Training controller: linear warm-up then cosine decay; plateau detection on the
held-out loss (LR halved after ``patience`` evaluations without improvement);
gradient-norm instability detection (non-finite or > spike_factor x the running
mean: the update is skipped and reported; otherwise clipped to ``clip``); a
convergence estimate from the loss trajectory (slope per doubling of steps and a
projected final loss).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from . import layout
from .config import ConfigError, ModelConfig, parse_config_string
from . import train_model as tm

import mlx.core as mx  # noqa: E402

DEFAULT_SHAPE = ("d_model=256,n_layers=8,n_heads=4,head_dim=64,d_ff=768,vocab=2048,"
                 "max_seq=4096,draft_map=0:2:3:5")


class TrainError(RuntimeError):
    """Bad arguments, missing inputs or an unreadable run directory."""


@dataclass
class TrainConfig:
    mode: str = "target"          # target | draft
    steps: int = 1000
    budget_min: float = 0.0       # >0: set steps from measured speed to fit this many minutes
    batch: int = 8
    seq: int = 256
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    clip: float = 1.0
    spike_factor: float = 4.0
    plateau_patience: int = 3
    plateau_factor: float = 0.5
    plateau_min_delta: float = 0.01
    eval_every: int = 100
    eval_tokens: int = 16384
    ckpt_every: int = 100
    log_every: int = 10
    seed: int = 0
    chunk: int = 64
    data: str = "data/corpus"
    tokenizer: str = ""           # default: spel_mlx/assets/tokenizer.model
    init: str = ""                # draft mode: the target run directory
    onpolicy: str = ""            # draft mode: .npy of target-generated windows [n, seq+1]
    onpolicy_frac: float = 0.5    # share of each draft batch drawn from them


# --- data ---------------------------------------------------------------------
def load_tokens(data_dir: str, tokenizer, split: str) -> np.ndarray:
    """Token ids of data_dir/{split}.txt, cached next to it per tokenizer."""
    txt = os.path.join(data_dir, f"{split}.txt")
    if not os.path.exists(txt):
        raise TrainError(f"{txt} not found: run `python -m spel_mlx.corpus --out {data_dir}` first")
    cache = os.path.join(data_dir, f"{split}.{tokenizer.name}.npy")
    src_mtime = max(os.path.getmtime(txt), os.path.getmtime(getattr(tokenizer, "path", txt)))
    if os.path.exists(cache) and os.path.getmtime(cache) >= src_mtime:
        return np.load(cache)
    ids = np.asarray(tokenizer.encode(open(txt, encoding="utf-8").read()), dtype=np.int32)
    tmp = cache + ".tmp.npy"
    np.save(tmp, ids)
    os.replace(tmp, cache)
    return ids


def batch_at(tokens: np.ndarray, step: int, seed: int, batch: int, seq: int):
    """Batch `step` (deterministic in (seed, step)): x, y int32 [batch, seq]."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq - 1, size=batch)
    idx = starts[:, None] + np.arange(seq + 1)[None, :]
    w = tokens[idx]
    return w[:, :-1], w[:, 1:]


def mix_onpolicy(x, y, rows: np.ndarray, step: int, seed: int, frac: float):
    """Replace the first round(frac * batch) rows of a batch by target-generated
    windows (deterministic in (seed, step), like batch_at)."""
    n = int(round(frac * x.shape[0]))
    if n <= 0 or rows is None or len(rows) == 0:
        return x, y
    rng = np.random.default_rng([seed, step, 1])
    w = rows[rng.integers(0, len(rows), size=n), :x.shape[1] + 1]
    x, y = x.copy(), y.copy()
    x[:n], y[:n] = w[:, :-1], w[:, 1:]
    return x, y


def generate_onpolicy(target_run: str, out_path: str, minutes: float, data_dir: str = "data/corpus",
                      tokenizer_path: str = "", seq: int = 256, prompt_len: int = 64, seed: int = 0,
                      max_rows: int = 0, quiet: bool = False) -> dict:
    """Target-generated training windows for the draft (on-policy distillation data).

    Each row is prompt_len tokens of training text followed by the target's own
    continuation (seq + 1 tokens in all): even rows greedy (what greedy
    speculative decoding verifies), odd rows sampled at temperature 0.8.  The
    draft then learns the target where the target's own decoding takes it.
    Rows are written as int32 [n, seq+1] (.npy, atomically) when time is up."""
    from . import sampling as smp
    from .model import SpelModel
    from .speculative import SpeculativeDecoder
    from .tokenizer import load_tokenizer
    _, cfg, params, _, _ = load_checkpoint_dir(target_run)
    tok = load_tokenizer(cfg.vocab, tokenizer_path or None)
    train_tok = load_tokens(data_dir, tok, "train")
    names = [sp.name for sp in layout.tensor_specs(cfg)]
    model = SpelModel.from_weights(cfg, {n: params[n] for n in names})
    greedy = SpeculativeDecoder(model, None, "ar")
    sampled = SpeculativeDecoder(model, None, "ar",
                                 params=smp.SamplingParams(temperature=0.8, top_p=0.95, seed=seed))
    rng = np.random.default_rng([seed, 7])
    rows, t0, n_gen = [], time.time(), seq + 1 - prompt_len
    while time.time() - t0 < minutes * 60 and (not max_rows or len(rows) < max_rows):
        s = int(rng.integers(0, len(train_tok) - prompt_len))
        prompt = [int(t) for t in train_tok[s:s + prompt_len]]
        dec = greedy if len(rows) % 2 == 0 else sampled
        out = dec.generate(prompt, n_gen)
        rows.append(prompt + out + [0] * (n_gen - len(out)))
        if not quiet and len(rows) % 20 == 0:
            el = time.time() - t0
            print(f"[onpolicy] {len(rows)} rows, {len(rows) * n_gen:,} generated tokens, "
                  f"{len(rows) * n_gen / el:.0f} tok/s, {el / 60:.1f}/{minutes:g} min", flush=True)
    arr = np.asarray(rows, dtype=np.int32).reshape(-1, seq + 1)
    tmp = out_path + ".tmp.npy"
    np.save(tmp, arr)
    os.replace(tmp, out_path)
    return {"rows": int(arr.shape[0]), "generated_tokens": int(arr.shape[0] * n_gen),
            "seconds": round(time.time() - t0, 1), "path": out_path}


def eval_windows(tokens: np.ndarray, seq: int, max_tokens: int):
    """Non-overlapping held-out windows (fixed, in order)."""
    n = min((len(tokens) - 1) // seq, max(1, max_tokens // seq))
    idx = np.arange(n)[:, None] * seq + np.arange(seq + 1)[None, :]
    w = tokens[idx]
    return w[:, :-1], w[:, 1:]


# --- controller -------------------------------------------------------------------
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


# --- the compiled step ----------------------------------------------------------
def _decay_mask(name: str) -> bool:
    return name.endswith(".weight") and "norm" not in name


def make_step(cfg: ModelConfig, tc: TrainConfig, trainable_names: list):
    """Compiled train step: (trainable, frozen, m, v, x, y, lr, t, spike) ->
    (loss, gnorm, ok, trainable', m', v').  The update is skipped in-graph when
    the gradient norm is non-finite or above `spike`."""
    b1, b2, eps, wd, clip = tc.beta1, tc.beta2, tc.adam_eps, tc.weight_decay, tc.clip
    chunk = tc.chunk

    if tc.mode == "target":
        def loss_fn(train, frozen, x, y):
            return tm.cross_entropy(tm.forward({**frozen, **train}, x, cfg, "target", chunk=chunk), y)
    else:
        def loss_fn(train, frozen, x, y):
            p = {**frozen, **train}
            t_logits = mx.stop_gradient(tm.forward(p, x, cfg, "target", chunk=chunk))
            d_logits = tm.forward(p, x, cfg, "draft", quant=True, chunk=chunk)
            return tm.kl_target_draft(t_logits, d_logits)

    vg = mx.value_and_grad(loss_fn)

    def step(train, frozen, m, v, x, y, lr, t, spike):
        loss, grads = vg(train, frozen, x, y)
        gsq = sum(mx.sum(g * g) for g in grads.values())
        gnorm = mx.sqrt(gsq)
        ok = mx.logical_and(mx.isfinite(gnorm), gnorm < spike)
        scale = mx.minimum(1.0, clip / (gnorm + 1e-6))
        bc1 = 1 - b1 ** t
        bc2 = 1 - b2 ** t
        new_p, new_m, new_v = {}, {}, {}
        for n in trainable_names:
            g = mx.where(ok, grads[n] * scale, 0.0)
            mn = b1 * m[n] + (1 - b1) * g
            vn = b2 * v[n] + (1 - b2) * g * g
            upd = (mn / bc1) / (mx.sqrt(vn / bc2) + eps)
            if _decay_mask(n):
                upd = upd + wd * train[n]
            new_p[n] = mx.where(ok, train[n] - lr * upd, train[n])
            new_m[n] = mx.where(ok, mn, m[n])
            new_v[n] = mx.where(ok, vn, v[n])
        return loss, gnorm, ok, new_p, new_m, new_v

    return mx.compile(step)


def make_eval(cfg: ModelConfig, tc: TrainConfig):
    """Compiled held-out evaluation: (params, x, y) -> (sum NLL, [KL sum, agree count])."""
    chunk = tc.chunk

    def ev(p, x, y):
        if tc.mode == "target":
            lg = tm.forward(p, x, cfg, "target", chunk=chunk)
            lse = mx.logsumexp(lg, axis=-1)
            nll = lse - mx.take_along_axis(lg, y[..., None], axis=-1)[..., 0]
            return mx.sum(nll), mx.array(0.0), mx.array(0.0)
        tl = tm.forward(p, x, cfg, "target", chunk=chunk)
        dl = tm.forward(p, x, cfg, "draft", quant=True, chunk=chunk)
        lse = mx.logsumexp(dl, axis=-1)
        nll = lse - mx.take_along_axis(dl, y[..., None], axis=-1)[..., 0]
        kl = tm.kl_target_draft(tl, dl) * tl.shape[0] * tl.shape[1]
        agree = mx.sum(mx.argmax(tl, axis=-1) == mx.argmax(dl, axis=-1))
        return mx.sum(nll), kl, agree

    return mx.compile(ev)


# --- checkpoints ------------------------------------------------------------------
def _save_arrays(path: str, arrays: dict) -> None:
    tmp = path + ".tmp.safetensors"
    mx.save_safetensors(tmp, arrays)
    os.replace(tmp, path)


def save_checkpoint(run: str, step: int, adam_t: int, params: dict, m: dict, v: dict,
                    cfg: ModelConfig, tc: TrainConfig, ctl: Controller) -> None:
    """Write run/ckpt atomically: build run/ckpt.tmp, then swap directories."""
    tmp, final, old = os.path.join(run, "ckpt.tmp"), os.path.join(run, "ckpt"), os.path.join(run, "ckpt.old")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    _save_arrays(os.path.join(tmp, "params.safetensors"), params)
    opt = {f"m.{k}": a for k, a in m.items()}
    opt.update({f"v.{k}": a for k, a in v.items()})
    _save_arrays(os.path.join(tmp, "opt.safetensors"), opt)
    state = {"step": step, "adam_t": adam_t, "model": cfg.to_dict(), "train": dataclasses.asdict(tc),
             "controller": ctl.to_dict()}
    with open(os.path.join(tmp, "state.json"), "w") as f:
        json.dump(state, f)
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint_dir(run: str):
    ck = os.path.join(run, "ckpt")
    if not os.path.exists(os.path.join(ck, "state.json")):
        # a crash between the two renames leaves the previous checkpoint in ckpt.old
        if os.path.exists(os.path.join(run, "ckpt.old", "state.json")):
            ck = os.path.join(run, "ckpt.old")
        else:
            raise TrainError(f"{run}: no checkpoint (ckpt/state.json missing)")
    try:
        state = json.load(open(os.path.join(ck, "state.json")))
        params = mx.load(os.path.join(ck, "params.safetensors"))
        opt = mx.load(os.path.join(ck, "opt.safetensors"))
    except (OSError, ValueError, RuntimeError) as e:
        raise TrainError(f"{ck}: unreadable checkpoint ({e})") from None
    m = {k[2:]: a for k, a in opt.items() if k.startswith("m.")}
    v = {k[2:]: a for k, a in opt.items() if k.startswith("v.")}
    mc = dict(state["model"])
    mc["draft_map"] = tuple(mc["draft_map"])
    cfg = ModelConfig(**mc).validate()
    return state, cfg, params, m, v


def _lock_run(run: str):
    """An exclusive lock on RUN/lock so two processes never train one run directory."""
    import fcntl
    f = open(os.path.join(run, "lock"), "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise TrainError(f"{run}: in use by another training process (RUN/lock is held)") from None
    return f


# --- the loop ---------------------------------------------------------------------
def _fmt_time(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class _Log:
    def __init__(self, run: str, quiet: bool):
        self.quiet = quiet
        self.jf = open(os.path.join(run, "log.jsonl"), "a")
        self.tf = open(os.path.join(run, "train.log"), "a")

    def event(self, rec: dict, line: str) -> None:
        self.jf.write(json.dumps({**rec, "time": round(time.time(), 1)}) + "\n")
        self.jf.flush()
        self.tf.write(line + "\n")
        self.tf.flush()
        if not self.quiet:
            print(line, flush=True)


def train(run: str, cfg: ModelConfig | None, tc: TrainConfig, tokenizer=None,
          stop_after: int | None = None, quiet: bool = False, extend_to: int | None = None) -> dict:
    """Train (or resume) in `run`. `stop_after`: stop (with a checkpoint) after this
    many steps of this invocation, simulating a killed run in tests. `extend_to`: on
    resume, lengthen the schedule to this many steps (the cosine is recomputed over
    the new total). Returns a summary."""
    os.makedirs(run, exist_ok=True)
    lock = _lock_run(run)  # held until this function returns (the file object closes)
    resume = os.path.exists(os.path.join(run, "ckpt", "state.json")) or \
        os.path.exists(os.path.join(run, "ckpt.old", "state.json"))
    ctl = Controller()
    old_steps = None
    if resume:
        state, cfg, params, m, v = load_checkpoint_dir(run)
        tc = TrainConfig(**state["train"])
        step, adam_t = state["step"], state["adam_t"]
        cs = state["controller"]
        ctl = Controller(**cs)
        if extend_to is not None and extend_to != tc.steps:
            if extend_to < step:
                raise TrainError(f"--steps {extend_to} is below the run's current step {step}")
            old_steps, tc.steps = tc.steps, extend_to
    else:
        if tc.mode == "draft":
            if not tc.init:
                raise TrainError("draft mode needs --init RUN_DIR (a trained target run)")
            state_t, cfg_t, params_t, _, _ = load_checkpoint_dir(tc.init)
            if cfg is not None and cfg != cfg_t:
                raise TrainError(f"--config differs from the target run {tc.init}'s config")
            cfg = cfg_t
            # from a target run: draft layers start as copies of target layers; from
            # a draft run: its distilled draft is trained further (e.g. on-policy)
            params = dict(params_t) if state_t["train"]["mode"] == "draft" else \
                tm.copy_target_to_draft(cfg, dict(params_t))
        else:
            if cfg is None:
                raise TrainError("target mode needs a model config")
            params = tm.init_params(cfg, tc.seed)
        step, adam_t = 0, 0
        m = v = None
    if tokenizer is None:
        from .tokenizer import load_tokenizer
        tokenizer = load_tokenizer(cfg.vocab, tc.tokenizer or None)
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
        try:
            onpolicy_rows = np.load(tc.onpolicy)
        except (OSError, ValueError) as e:
            raise TrainError(f"{tc.onpolicy}: cannot read on-policy windows ({e})") from None
        if onpolicy_rows.ndim != 2 or onpolicy_rows.shape[1] < tc.seq + 1 or \
                onpolicy_rows.min(initial=0) < 0 or onpolicy_rows.max(initial=0) >= cfg.vocab:
            raise TrainError(f"{tc.onpolicy}: expected int windows [n, >= {tc.seq + 1}] of token ids "
                             f"< {cfg.vocab}, got shape {onpolicy_rows.shape}")

    prefix = "draft." if tc.mode == "draft" else ""
    names = [s.name for s in layout.tensor_specs(cfg)]
    trainable = [n for n in names if n.startswith("draft.")] if tc.mode == "draft" else \
        [n for n in names if not n.startswith("draft.")]
    del prefix
    train_p = {n: params[n] for n in trainable}
    frozen = {n: params[n] for n in names if n not in train_p}
    if m is None:
        m = {n: mx.zeros_like(train_p[n]) for n in trainable}
        v = {n: mx.zeros_like(train_p[n]) for n in trainable}
    step_fn = make_step(cfg, tc, trainable)
    eval_fn = make_eval(cfg, tc)
    ex, ey = eval_windows(held_tok, tc.seq, tc.eval_tokens)
    eval_bytes = len(tokenizer.decode(ex.reshape(-1).tolist()))  # bytes the eval targets cover (approx.)
    log = _Log(run, quiet)
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

    def evaluate():
        tot, kl, ag = 0.0, 0.0, 0.0
        p = {**frozen, **train_p}
        eb = max(1, tc.batch)
        for i in range(0, len(ex), eb):
            a, b, c = eval_fn(p, mx.array(ex[i:i + eb]), mx.array(ey[i:i + eb]))
            mx.eval(a, b, c)
            tot += a.item()
            kl += b.item()
            ag += c.item()
        n = ex.size
        r = {"heldout_nats": tot / n, "heldout_bpb": tot / math.log(2) / eval_bytes}
        if tc.mode == "draft":
            r.update({"heldout_kl": kl / n, "heldout_top1_agree": ag / n})
        return r

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
            spent = time.time() - t0
            budget = tc.budget_min * 60 - spent
            steps_per_s = tps / (tc.batch * tc.seq)
            n_evals = 1 + budget * steps_per_s / tc.eval_every
            eval_cost = n_evals * (len(ex) * tc.seq) / max(tps * 2.5, 1)
            tc.steps = max(step + 10, int(step + (budget - eval_cost) * steps_per_s))
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
            r = evaluate()
            msg = ctl.observe_eval(tc, step, r["heldout_nats"] if tc.mode == "target" else r["heldout_kl"])
            extra = (f" KL {r['heldout_kl']:.4f} top-1 agree {r['heldout_top1_agree']:.3f}"
                     if tc.mode == "draft" else "")
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


# --- export -----------------------------------------------------------------------
def golden_tokens_from_heldout(data_dir: str, tokenizer, n: int = 16) -> np.ndarray:
    """The first n tokens of the held-out text: the golden footer feeds real prose."""
    held = load_tokens(data_dir, tokenizer, "heldout")
    return np.asarray(held[:n], dtype=np.uint32)


def export_run(run: str, out_dir: str, dtype: str = "float16", tokenizer_path: str = "",
               data_dir: str = "data/corpus", spelw_path: str = "") -> str:
    """Export a run's checkpoint: a SPELW001 file (FP32, golden footer on held-out
    tokens) and a safetensors model folder in ``dtype`` made from it by
    spel_mlx.convert (golden logits recomputed for the rounded weights), plus the
    tokenizer. Returns the folder."""
    from .tokenizer import DEFAULT_SP_MODEL, load_tokenizer
    from .golden import compute_golden
    from .spelw import Golden, write_spelw
    from .convert import convert
    _, cfg, params, _, _ = load_checkpoint_dir(run)
    names = [s.name for s in layout.tensor_specs(cfg)]
    missing = [n for n in names if n not in params]
    if missing:
        raise TrainError(f"{run}: checkpoint lacks {missing[0]} (and {len(missing) - 1} more)")
    weights = {n: np.array(params[n], dtype=np.float32) for n in names}
    tok_path = tokenizer_path or DEFAULT_SP_MODEL
    tok = load_tokenizer(cfg.vocab, None if cfg.vocab == 128 else tok_path)
    gt = golden_tokens_from_heldout(data_dir, tok)
    tl, dl = compute_golden(cfg, weights, gt)
    spelw_path = spelw_path or os.path.join(run, "model.spelw")
    write_spelw(spelw_path, cfg, weights, Golden(gt, tl, dl))
    code = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}[dtype]
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    convert(spelw_path, tmp, code, progress=False)
    if cfg.vocab != 128:
        shutil.copyfile(tok_path, os.path.join(tmp, "tokenizer.model"))
    old = out_dir.rstrip("/") + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(out_dir):
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


# --- the whole pipeline -----------------------------------------------------------
def train_all(a) -> dict:
    """corpus -> tokenizer -> target -> draft on text -> on-policy windows -> draft
    on text + windows -> export, each step skipped or resumed when its output
    exists (re-running the command after an interruption continues it).
    Returns the wall time of each step run here (also in RUNS/timing.json)."""
    from . import corpus
    from .tokenizer import DEFAULT_SP_MODEL, train_sentencepiece
    times, t = {}, time.time()

    def lap(name):
        nonlocal t
        times[name] = round(time.time() - t, 1)
        t = time.time()
        print(f"[all] {name}: {times[name] / 60:.1f} min", flush=True)
    os.makedirs(a.runs, exist_ok=True)
    if not all(os.path.exists(os.path.join(a.data, f)) for f in ("train.txt", "heldout.txt", "manifest.json")):
        corpus.prepare(a.data)
        lap("corpus")
    sp_path = a.tokenizer_out or DEFAULT_SP_MODEL
    tr, dr = os.path.join(a.runs, "target"), os.path.join(a.runs, "draft")
    # a resumed pipeline keeps the tokenizer its target was trained with
    if not (os.path.exists(sp_path) and os.path.exists(os.path.join(tr, "ckpt", "state.json"))):
        train_sentencepiece(os.path.join(a.data, "train.txt"), sp_path, a.vocab)
        lap("tokenizer")
    cfg = ModelConfig(**{**ModelConfig().to_dict(), **parse_config_string(a.config)})
    cfg = cfg.replace(draft_map=tuple(cfg.draft_map), vocab=a.vocab)
    train(tr, cfg, TrainConfig(mode="target", budget_min=a.target_min, data=a.data, batch=4,
                               warmup=40, eval_tokens=8192, ckpt_every=50, tokenizer=sp_path))
    lap("target")
    train(dr, None, TrainConfig(mode="draft", budget_min=a.draft_min, data=a.data, init=tr, batch=4,
                                lr=1e-3, warmup=20, eval_every=50, eval_tokens=4096,
                                ckpt_every=50, tokenizer=sp_path))
    lap("draft")
    final = dr
    if a.onpolicy_min > 0 and a.onpolicy_draft_min > 0:
        op = os.path.join(a.runs, "onpolicy.npy")
        if not os.path.exists(op):
            generate_onpolicy(tr, op, a.onpolicy_min, a.data, sp_path)
            lap("onpolicy windows")
        final = os.path.join(a.runs, "draft_onpolicy")
        train(final, None, TrainConfig(mode="draft", budget_min=a.onpolicy_draft_min, data=a.data,
                                       init=dr, batch=4, lr=3e-4, warmup=10, eval_every=50,
                                       eval_tokens=4096, ckpt_every=50, tokenizer=sp_path,
                                       onpolicy=op, onpolicy_frac=0.5))
        lap("draft on-policy")
        if a.onpolicy2_min > 0 and a.onpolicy2_draft_min > 0:
            # a second round: more windows (another seed), then the on-policy draft
            # continues on all of them at a lower rate (alpha K=4, 24 held-out
            # prompts: 0.731 after the first round, 0.776 after this one)
            op2, op_all = os.path.join(a.runs, "onpolicy2.npy"), os.path.join(a.runs, "onpolicy_all.npy")
            if not os.path.exists(op2):
                generate_onpolicy(tr, op2, a.onpolicy2_min, a.data, sp_path, seed=1)
                lap("onpolicy windows 2")
            if not os.path.exists(op_all):
                tmp = op_all + ".tmp.npy"
                np.save(tmp, np.concatenate([np.load(op), np.load(op2)]))
                os.replace(tmp, op_all)
            prev_final, final = final, os.path.join(a.runs, "draft_onpolicy2")
            train(final, None, TrainConfig(mode="draft", budget_min=a.onpolicy2_draft_min, data=a.data,
                                           init=prev_final, batch=4, lr=2e-4, warmup=10, eval_every=100,
                                           eval_tokens=4096, ckpt_every=100, tokenizer=sp_path,
                                           onpolicy=op_all, onpolicy_frac=0.6))
            lap("draft on-policy 2")
    print(export_run(final, a.out, data_dir=a.data, tokenizer_path=sp_path))
    lap("export")
    prev = {}
    tf = os.path.join(a.runs, "timing.json")
    if os.path.exists(tf):
        try:
            prev = json.load(open(tf))
        except ValueError:
            prev = {}
    for k, v in times.items():          # an interrupted-and-resumed step adds up
        prev[k] = round(prev.get(k, 0.0) + v, 1)
    with open(tf + ".tmp", "w") as f:
        json.dump(prev, f, indent=1)
    os.replace(tf + ".tmp", tf)
    return {"out": a.out, "minutes": {k: round(v / 60, 1) for k, v in prev.items()},
            "total_min": round(sum(prev.values()) / 60, 1)}


# --- CLI --------------------------------------------------------------------------
def _add_train_args(p, mode: str):
    d = TrainConfig(mode=mode)
    p.add_argument("--run", required=True, help="run directory (resumed if it has a checkpoint)")
    p.add_argument("--config", default=DEFAULT_SHAPE if mode == "target" else "",
                   help="model shape, k=v,... (target mode)")
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("mode",):
            continue
        p.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(d, f.name)),
                       default=None, help=f"(default {getattr(d, f.name)!r})")


def _tc_from_args(a, mode: str) -> TrainConfig:
    kw = {f.name: getattr(a, f.name) for f in dataclasses.fields(TrainConfig)
          if f.name != "mode" and getattr(a, f.name, None) is not None}
    if mode == "draft":
        kw.setdefault("lr", 5e-4)
        kw.setdefault("warmup", 20)
    return TrainConfig(mode=mode, **kw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spel_mlx.train", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    _add_train_args(sub.add_parser("target", help="train the target model"), "target")
    _add_train_args(sub.add_parser("draft", help="QAT-distil the draft from a target run"), "draft")
    e = sub.add_parser("export", help="export a run as a safetensors model folder")
    e.add_argument("--run", required=True)
    e.add_argument("--out", default="spel_mlx/assets/default")
    e.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    e.add_argument("--data", default="data/corpus")
    e.add_argument("--spelw", default="", help="where the FP32 SPELW001 file goes (default RUN/model.spelw)")
    g = sub.add_parser("onpolicy", help="target-generated windows for draft distillation (--onpolicy)")
    g.add_argument("--init", required=True, help="the trained target run")
    g.add_argument("--out", required=True, help=".npy file to write")
    g.add_argument("--minutes", type=float, default=8.0)
    g.add_argument("--max-rows", type=int, default=0)
    g.add_argument("--data", default="data/corpus")
    g.add_argument("--tokenizer", default="")
    g.add_argument("--seq", type=int, default=256)
    g.add_argument("--prompt-len", type=int, default=64)
    g.add_argument("--seed", type=int, default=0)
    al = sub.add_parser("all", help="corpus, tokenizer, target, draft and export in one go")
    al.add_argument("--runs", default="runs")
    al.add_argument("--data", default="data/corpus")
    al.add_argument("--config", default=DEFAULT_SHAPE)
    al.add_argument("--target-min", type=float, default=60.0)
    al.add_argument("--draft-min", type=float, default=20.0)
    al.add_argument("--onpolicy-min", type=float, default=6.0,
                    help="minutes of target-generated windows for on-policy distillation (0: none)")
    al.add_argument("--onpolicy-draft-min", type=float, default=12.0,
                    help="minutes of draft distillation on them (after --draft-min on text)")
    al.add_argument("--onpolicy2-min", type=float, default=8.0,
                    help="minutes of more windows for a second on-policy round (0: none)")
    al.add_argument("--onpolicy2-draft-min", type=float, default=20.0,
                    help="minutes of the second round's distillation (on both rounds' windows)")
    al.add_argument("--vocab", type=int, default=2048)
    al.add_argument("--out", default="spel_mlx/assets/default")
    al.add_argument("--tokenizer-out", default="", help="where the SentencePiece model goes "
                    "(default spel_mlx/assets/tokenizer.model)")
    a = ap.parse_args(argv)
    try:
        if a.cmd in ("target", "draft"):
            cfg = None
            if a.config:
                cfg = ModelConfig(**{**ModelConfig().to_dict(), **parse_config_string(a.config)}).validate() \
                    if a.cmd == "target" else None
                if a.cmd == "draft":
                    raise TrainError("draft mode takes its shape from --init; drop --config")
            if cfg is not None and isinstance(cfg.draft_map, list):
                cfg = cfg.replace(draft_map=tuple(cfg.draft_map))
            resuming = os.path.exists(os.path.join(a.run, "ckpt", "state.json"))
            s = train(a.run, cfg, _tc_from_args(a, a.cmd), extend_to=a.steps if resuming else None)
            print(json.dumps(s, default=float))
        elif a.cmd == "onpolicy":
            if not 1 <= a.prompt_len <= a.seq:
                raise TrainError(f"--prompt-len {a.prompt_len}: must be in 1..--seq ({a.seq})")
            print(json.dumps(generate_onpolicy(a.init, a.out, a.minutes, a.data, a.tokenizer, a.seq,
                                               a.prompt_len, a.seed, a.max_rows)))
        elif a.cmd == "export":
            print(export_run(a.run, a.out, a.dtype, data_dir=a.data, spelw_path=a.spelw))
        else:
            print(json.dumps(train_all(a)))
    except (TrainError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted (the last checkpoint is kept; re-run the same command to resume)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
