"""``python -m spel_mlx train-report``: the quality report of an exported model
(spel_mlx/training/report.py)."""
from __future__ import annotations

import json

from ..atomic import write_json
from ..checkpoints.load import DEFAULT_DIR
from ..training.report import __doc__ as REPORT_DOC, alpha_on_heldout, heldout_eval, samples
from . import args as shared
from .errors import guarded


def build_parser() -> shared.Parser:
    ap = shared.parser("train-report", REPORT_DOC.split("\n")[0])
    shared.model(ap, help=f"the exported model (default {DEFAULT_DIR})", default=str(DEFAULT_DIR))
    ap.add_argument("--data", default="data/corpus")
    ap.add_argument("--out", default="", help="write the report JSON here too")
    ap.add_argument("--prompts", type=int, default=8)
    shared.draft_length(ap, 4, "--k")          # of the alpha runs
    ap.add_argument("--skip", default="", help="comma list of parts to skip: eval,alpha,samples")
    return ap


def main(argv=None) -> int:
    return guarded(lambda: _report(build_parser().parse_args(argv)), (OSError, ValueError, RuntimeError))


def _report(a) -> int:
    skip = set(filter(None, a.skip.split(",")))
    rep = {"checkpoint": a.model}
    if "eval" not in skip:
        rep["heldout"] = heldout_eval(a.model, a.data)
        print(json.dumps(rep["heldout"]), flush=True)
    if "alpha" not in skip:
        rep["alpha"] = alpha_on_heldout(a.model, a.data, n_prompts=a.prompts, k=a.spec_k)
        print(json.dumps(rep["alpha"]), flush=True)
        rep["alpha_sampled"] = alpha_on_heldout(a.model, a.data, n_prompts=a.prompts, k=a.spec_k, sampled=True)
        print(json.dumps(rep["alpha_sampled"]), flush=True)
    if "samples" not in skip:
        rep["samples"] = samples(a.model)
        for s in rep["samples"]:
            print(f"--- {s['settings']}\n{s['text']}\n", flush=True)
    if a.out:
        write_json(a.out, rep)
    return 0
