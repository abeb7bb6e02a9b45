"""``python -m spel_mlx distributed``: a batch of requests on a layer pipeline, one JSON
line per request (spel_mlx/distributed/batch.py); run under mlx.launch.  Errors: one
line on stderr and exit 1 (2 for bad input)."""
from __future__ import annotations

import json
import sys

from ..api import NoCheckpoint
from ..distributed import PipelineError, open_pipeline, serve
from ..distributed.batch import run_requests
from . import args as shared
from .errors import UsageError


def build_parser() -> shared.Parser:
    ap = shared.parser("distributed", "A batch of requests on a pipeline of mlx.launch's processes.")
    shared.model(ap)
    shared.config(ap)
    shared.tokenizer(ap)
    ap.add_argument("--placement", choices=("gpu", "cpu"), default=None, help="where each rank's stage runs")
    ap.add_argument("--requests", required=True, help="JSON file: a list of requests")
    return ap


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        with open(args.requests, encoding="utf-8") as f:
            requests = json.load(f)
        pipe = open_pipeline(args.model, config=args.config, tokenizer=args.tokenizer, placement=args.placement)
        if pipe.rank > 0:
            serve(pipe)
            return 0
        try:
            run_requests(pipe, requests, sys.stdout)
        finally:
            pipe.loaded.close()
    except (NoCheckpoint, PipelineError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (UsageError, OSError, ValueError) as e:  # bad flags, unreadable requests, LoadError, GenerationError
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
