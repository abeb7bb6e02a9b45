"""Run a batch of requests on a pipeline, one JSON line per request (tests, bench).

    mlx.launch --backend ring --hosts 127.0.0.1 -n 2 --python PYTHON -- \\
        -m spel_mlx distributed --model m.spelw --requests reqs.json

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

import json
import time

import numpy as np

from ..api import prepare
from ..decoding import GovernorConfig


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
