"""`train all`: the whole pipeline from corpus to exported model, resumable step by step."""
from __future__ import annotations

import json
import os
import time

import numpy as np

from ..atomic import save_npy, write_json
from .config import TrainConfig, model_config
from .export import export_run
from .loop import train
from .onpolicy import generate_onpolicy


def train_all(a) -> dict:
    """corpus -> tokenizer -> target -> draft on text -> on-policy windows -> draft
    on text + windows -> export, each step skipped or resumed when its output
    exists (re-running the command after an interruption continues it).
    Returns the wall time of each step run here (also in RUNS/timing.json)."""
    from . import corpus
    from ..tokenizer import DEFAULT_SP_MODEL, train_sentencepiece
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
    cfg = model_config(a.config, vocab=a.vocab)
    train(tr, cfg, TrainConfig(mode="target", budget_min=a.target_min, data=a.data, batch=8, lr=1.5e-3,
                               warmup=100, eval_tokens=16384, ckpt_every=50, tokenizer=sp_path))
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
                                       init=dr, batch=4, lr=5e-4, warmup=10, eval_every=50,
                                       eval_tokens=4096, ckpt_every=50, tokenizer=sp_path,
                                       onpolicy=op, onpolicy_frac=0.5))
        lap("draft on-policy")
        if a.onpolicy2_min > 0 and a.onpolicy2_draft_min > 0:
            # a second round: more windows (another seed), then the on-policy draft
            # continues on all of them at a lower rate (its gain: docs/training.md)
            op2, op_all = os.path.join(a.runs, "onpolicy2.npy"), os.path.join(a.runs, "onpolicy_all.npy")
            if not os.path.exists(op2):
                generate_onpolicy(tr, op2, a.onpolicy2_min, a.data, sp_path, seed=1)
                lap("onpolicy windows 2")
            if not os.path.exists(op_all):
                save_npy(op_all, np.concatenate([np.load(op), np.load(op2)]))
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
    write_json(tf, prev)
    return {"out": a.out, "minutes": {k: round(v / 60, 1) for k, v in prev.items()},
            "total_min": round(sum(prev.values()) / 60, 1)}
