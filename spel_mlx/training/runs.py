"""A run directory: its checkpoint, its lock and its logs.

RUN/ckpt/ holds params.safetensors, opt.safetensors (AdamW moments) and state.json
(step, model and train config, controller), replaced as a whole; log.jsonl (one record
per event) and train.log (the same as text) grow with each invocation; RUN/lock keeps a
second process out while one trains."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

import mlx.core as mx

from ..config import ModelConfig
from .config import TrainConfig, TrainError
from .schedule import Controller


def _save_arrays(path: str, arrays: dict) -> None:
    tmp = path + ".tmp.safetensors"
    mx.save_safetensors(tmp, arrays)
    os.replace(tmp, path)


def replace_dir(tmp: str, final: str) -> None:
    """Put the finished folder ``tmp`` at ``final``. The old one waits in FINAL.old
    until the new one is in place, so a crash between the renames loses neither."""
    old = final.rstrip("/") + ".old"
    if os.path.exists(final):   # else FINAL.old may be the only copy left by a crash
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(run: str, step: int, adam_t: int, params: dict, m: dict, v: dict,
                    cfg: ModelConfig, tc: TrainConfig, ctl: Controller) -> None:
    """Write run/ckpt atomically: build run/ckpt.tmp, then swap directories."""
    tmp = os.path.join(run, "ckpt.tmp")
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
    replace_dir(tmp, os.path.join(run, "ckpt"))


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


def load_start(path: str):
    """(kind, cfg, params) of what a draft run or on-policy windows start from: a run
    directory (kind: its mode, "target" or "draft") or an exported model, a safetensors
    folder or a SPELW001 file (kind "export": its target and draft as shipped)."""
    if has_checkpoint(path) or (os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json"))):
        state, cfg, params, _, _ = load_checkpoint_dir(path)   # names ckpt/state.json when missing
        return state["train"]["mode"], cfg, params
    from ..checkpoints import CheckpointError
    from ..reader import load_checkpoint
    try:
        ck = load_checkpoint(path)
    except (CheckpointError, OSError) as e:
        raise TrainError(f"{path}: neither a run directory nor a loadable model ({e})") from None
    return "export", ck.cfg, {n: mx.array(w) for n, w in ck.weights.items()}


def start_tokenizer(path: str) -> str:
    """The tokenizer an exported model folder carries (its tokenizer.model), else ""."""
    tp = os.path.join(path, "tokenizer.model")
    return tp if path and os.path.isdir(path) and os.path.exists(tp) else ""


def lock_run(run: str):
    """An exclusive lock on RUN/lock so two processes never train one run directory."""
    import fcntl
    f = open(os.path.join(run, "lock"), "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise TrainError(f"{run}: in use by another training process (RUN/lock is held)") from None
    return f


def has_checkpoint(run: str) -> bool:
    """True when the run can be resumed (ckpt/, or ckpt.old/ left by a crash mid-swap)."""
    return any(os.path.exists(os.path.join(run, d, "state.json")) for d in ("ckpt", "ckpt.old"))


class RunLog:
    """Each event as a JSON record in log.jsonl and a line in train.log (and on stdout)."""

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
