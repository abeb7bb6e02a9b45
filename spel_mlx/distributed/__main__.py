"""Run a batch of requests on a pipeline, one JSON line per request (tests, bench).

    mlx.launch --backend ring --hosts 127.0.0.1 -n 2 --python PYTHON -- \\
        -m spel_mlx.distributed --checkpoint m.spelw --requests reqs.json

reqs.json: a list of objects, each ``prompt`` (text or token ids), ``max_tokens``
and any option of ``spel_mlx.api.prepare`` (mode, draft, k, temperature, seed, ...).
Rank 0 prints, per request, {"index", "tokens", "stats", "ranks"}: the tokens, the
decoder's statistics and every rank's counters for that request (compute, prefill,
communication).  Errors: one line on stderr and exit 1 (2 for bad input).
"""
from __future__ import annotations

import argparse
import json
import sys

from ..api import GenerationError, LoadError, NoCheckpoint, prepare
from . import PipelineError, open_pipeline, serve


def run_requests(pipe, requests: list, out) -> None:
    for i, spec in enumerate(requests):
        spec = dict(spec)
        prompt, max_tokens = spec.pop("prompt"), spec.pop("max_tokens")
        request = prepare(pipe.loaded, pipe.tokenizer, prompt, max_tokens, **spec)
        pipe.stats()                                   # counters from here on
        tokens = []
        request.run(on_response=lambda r: tokens.extend(r.tokens))
        out.write(json.dumps({"index": i, "tokens": tokens, "stats": request.stats, "ranks": pipe.stats()}) + "\n")
        out.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spel_mlx.distributed")
    ap.add_argument("--checkpoint")
    ap.add_argument("--config")
    ap.add_argument("--tokenizer")
    ap.add_argument("--requests", required=True, help="JSON file: a list of requests")
    args = ap.parse_args(argv)
    try:
        with open(args.requests, encoding="utf-8") as f:
            requests = json.load(f)
        pipe = open_pipeline(args.checkpoint, config=args.config, tokenizer=args.tokenizer)
    except (OSError, ValueError, LoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (NoCheckpoint, PipelineError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        if pipe.rank > 0:
            serve(pipe)
        else:
            try:
                run_requests(pipe, requests, sys.stdout)
            finally:
                pipe.loaded.close()
    except GenerationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
