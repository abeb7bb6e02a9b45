"""MLX trainer for the target model and QAT distillation of the draft.

    python -m spel_mlx train target --run runs/target --config d_model=256,... --budget-min 45
    python -m spel_mlx train target --run runs/more --init spel_mlx/assets/default --lr 5e-4 --seed 1
    python -m spel_mlx train draft  --run runs/draft --init runs/target --budget-min 15
    python -m spel_mlx train export --run runs/draft --out spel_mlx/assets/default --force
    python -m spel_mlx train onpolicy --init runs/target --out runs/onpolicy.npy --minutes 6
    python -m spel_mlx train draft  --run runs/sampled --init spel_mlx/assets/default \
                                    --onpolicy W.npy --distill-temperature 0.7
    python -m spel_mlx train all --force   (corpus -> tokenizer -> target -> draft -> on-policy
                                     windows -> draft on them -> export; re-run to resume)

Re-running the same command on an existing run directory resumes it.  An output that
exists (export's --out and a --spelw given, onpolicy's --out, all's --out) is replaced only
with --force, checked before any work.
"""
from __future__ import annotations

import dataclasses
import json
import os

from ..atomic import refuse_existing
from ..config import ConfigError
from ..training.config import DEFAULT_SHAPE, TrainConfig, TrainError, model_config
from ..training.export import export_run
from ..training.loop import train
from ..training.onpolicy import SAMPLINGS, generate_onpolicy
from ..training.pipeline import train_all
from . import args as shared
from .errors import guarded


def _add_train_args(p, mode: str):
    d = TrainConfig(mode=mode)
    p.add_argument("--run", required=True, help="run directory (resumed if it has a checkpoint)")
    shared.config(p, default="", help=f"model shape, k=v,... (target mode; default {DEFAULT_SHAPE}, "
                                     "or --init's when given)")
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


def build_parser() -> shared.Parser:
    ap = shared.parser("train", __doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    _add_train_args(sub.add_parser("target", help="train the target model"), "target")
    _add_train_args(sub.add_parser("draft", help="QAT-distil the draft from a target run"), "draft")
    e = sub.add_parser("export", help="export a run as a safetensors model folder")
    e.add_argument("--run", required=True)
    e.add_argument("--out", default="spel_mlx/assets/default")
    e.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    e.add_argument("--data", default="data/corpus")
    e.add_argument("--spelw", default="", help="where the FP32 SPELW001 file goes (default RUN/model.spelw)")
    shared.force(e, "an existing --out or --spelw")
    g = sub.add_parser("onpolicy", help="target-generated windows for draft distillation (--onpolicy)")
    g.add_argument("--init", required=True, help="the trained target: a run directory or an exported model")
    g.add_argument("--out", required=True, help=".npy file to write")
    g.add_argument("--minutes", type=float, default=8.0)
    g.add_argument("--max-rows", type=int, default=0)
    g.add_argument("--data", default="data/corpus")
    g.add_argument("--tokenizer", default="")
    g.add_argument("--seq", type=int, default=256)
    g.add_argument("--prompt-len", type=int, default=64)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--sampling", choices=SAMPLINGS, default="t0.8",
                   help="the sampled rows: t0.8 (T 0.8, top-p 0.95) or defaults (as generate: "
                        "T 0.7, top-p 0.95, repetition penalty 1.1)")
    g.add_argument("--greedy-share", type=float, default=0.5, help="share of the rows decoded greedily")
    shared.force(g, "an existing --out")
    al = sub.add_parser("all", help="corpus, tokenizer, target, draft and export in one go")
    al.add_argument("--runs", default="runs")
    al.add_argument("--data", default="data/corpus")
    shared.config(al, default=DEFAULT_SHAPE, help=f"model shape, k=v,... (default {DEFAULT_SHAPE})")
    al.add_argument("--target-min", type=float, default=100.0)
    al.add_argument("--draft-min", type=float, default=10.0)
    al.add_argument("--onpolicy-min", type=float, default=8.0,
                    help="minutes of target-generated windows for on-policy distillation (0: none)")
    al.add_argument("--onpolicy-draft-min", type=float, default=20.0,
                    help="minutes of draft distillation on them (after --draft-min on text)")
    al.add_argument("--onpolicy2-min", type=float, default=0.0,
                    help="minutes of more windows for a second on-policy round (0: none)")
    al.add_argument("--onpolicy2-draft-min", type=float, default=0.0,
                    help="minutes of the second round's distillation (on both rounds' windows)")
    al.add_argument("--vocab", type=int, default=2048)
    al.add_argument("--out", default="spel_mlx/assets/default")
    al.add_argument("--tokenizer-out", default="", help="where the SentencePiece model goes "
                    "(default spel_mlx/assets/tokenizer.model)")
    shared.force(al, "an existing --out (the shipped model by default)")
    return ap


def outputs(a) -> list:
    """What the subcommand writes that may exist already (a run directory is resumed)."""
    if a.cmd == "export":
        return [a.out, a.spelw]          # (the default RUN/model.spelw belongs to the run)
    if a.cmd in ("onpolicy", "all"):
        return [a.out]
    return []


def _run(a) -> int:
    refuse_existing(outputs(a), a.cmd in ("target", "draft") or a.force)
    if a.cmd in ("target", "draft"):
        if a.cmd == "draft" and a.config:
            raise TrainError("draft mode takes its shape from --init; drop --config")
        shape = a.config or (DEFAULT_SHAPE if a.cmd == "target" and not a.init else "")
        cfg = model_config(shape) if shape else None   # a continued target keeps --init's shape
        resuming = os.path.exists(os.path.join(a.run, "ckpt", "state.json"))
        s = train(a.run, cfg, _tc_from_args(a, a.cmd), extend_to=a.steps if resuming else None)
        print(json.dumps(s, default=float))
    elif a.cmd == "onpolicy":
        if not 1 <= a.prompt_len <= a.seq:
            raise TrainError(f"--prompt-len {a.prompt_len}: must be in 1..--seq ({a.seq})")
        print(json.dumps(generate_onpolicy(a.init, a.out, a.minutes, a.data, a.tokenizer, a.seq,
                                           a.prompt_len, a.seed, a.max_rows, sampling=a.sampling,
                                           greedy_share=a.greedy_share)))
    elif a.cmd == "export":
        print(export_run(a.run, a.out, a.dtype, data_dir=a.data, spelw_path=a.spelw))
    else:
        print(json.dumps(train_all(a)))
    return 0


def main(argv=None) -> int:
    return guarded(lambda: _run(build_parser().parse_args(argv)), (TrainError, ConfigError, FileExistsError),
                   interrupted="interrupted (the last checkpoint is kept; re-run the same command to resume)")
