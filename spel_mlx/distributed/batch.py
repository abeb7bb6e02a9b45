"""Run a batch of requests on a pipeline, one JSON line per request (tests, bench).

    mlx.launch --backend ring --hosts 127.0.0.1 -n 2 --python PYTHON -- \\
        -m spel_mlx.distributed --checkpoint m.spelw --requests reqs.json

reqs.json: a list of objects, each ``prompt`` (text or token ids), ``max_tokens``
and any option of ``spel_mlx.api.prepare`` (mode, draft, k, temperature, seed, ...;
``governor`` by its policy name: cost, original or off).
Rank 0 prints, per request, {"index", "tokens", "stats", "ranks", "round_median_s"}:
the tokens, the decoder's statistics, every rank's counters for that request
(compute, prefill, communication) and the median time between two rounds' responses
(a steady-state round: robust to other work on the machine).  Errors: one line on
stderr and exit 1 (2 for bad input).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from ..api import NoCheckpoint, prepare
from ..decoding import GovernorConfig
from . import PipelineError, open_pipeline, serve


def run_request(model, tokenizer, spec: dict) -> dict:
    """One request of the batch: {"tokens", "stats", "round_median_s"}."""
    spec = dict(spec)
    if isinstance(spec.get("governor"), str):      # JSON names the policy: cost | original | off
        spec["governor"] = GovernorConfig(policy=spec["governor"])
    request = prepare(model, tokenizer, spec.pop("prompt"), spec.pop("max_tokens"), **spec)
    tokens, stamps = [], []

    def on_response(r):
        tokens.extend(r.tokens)
        if r.finish_reason is None:
            stamps.append(time.perf_counter())
    request.run(on_response=on_response)
    gaps = np.diff(stamps)      # from the second round on: the first one's wait includes the prefill
    return {"tokens": tokens, "stats": request.stats, "round_median_s": float(np.median(gaps)) if gaps.size else None}


def run_requests(pipe, requests: list, out) -> None:
    for i, spec in enumerate(requests):
        pipe.stats()                                   # counters from here on
        result = run_request(pipe.loaded, pipe.tokenizer, spec)
        out.write(json.dumps(dict(index=i, ranks=pipe.stats(), **result)) + "\n")
        out.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spel_mlx.distributed")
    ap.add_argument("--checkpoint")
    ap.add_argument("--config")
    ap.add_argument("--tokenizer")
    ap.add_argument("--placement", choices=("gpu", "cpu"), default=None, help="where each rank's stage runs")
    ap.add_argument("--requests", required=True, help="JSON file: a list of requests")
    args = ap.parse_args(argv)
    try:
        with open(args.requests, encoding="utf-8") as f:
            requests = json.load(f)
        pipe = open_pipeline(args.checkpoint, config=args.config, tokenizer=args.tokenizer, placement=args.placement)
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
    except (OSError, ValueError) as e:          # unreadable requests, LoadError, GenerationError
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
