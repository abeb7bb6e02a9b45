"""Time to first token in a fresh process, against the page-in of the weights.

    python bench/ttft.py --model FILE|DIR [--runs 5] [--prompt TEXT] [--modes default,ar]
                         [--json out.json]

Each run is a fresh interpreter that imports spel_mlx, loads the model and streams one
token of a short prompt; it reports, from its own start: imports done, model loaded,
first token.  Beside it, a fresh interpreter that only reads the checkpoint's bytes
into memory (`numpy.fromfile`, the page cache warm as for the runs): the floor a
first token cannot beat.  The modes alternate run by run; medians are printed and, with
--json, written with every run.  The governor's store is off, as in bench/wall.py.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "It is a truth universally acknowledged, that"

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import spel_mlx
from spel_mlx import load, stream_generate
t_import = time.perf_counter()
model, tok = load(sys.argv[1], prepare="ar" if sys.argv[3] == "ar" else "spec")   # as the CLI
t_load = time.perf_counter()
kw = {} if sys.argv[3] == "default" else {"mode": sys.argv[3]}
for r in stream_generate(model, tok, sys.argv[2], max_tokens=1, **kw):
    break
t_first = time.perf_counter()
print(json.dumps({"import": t_import - t0, "load": t_load - t_import, "first": t_first - t_load}))
"""

PAGE_IN = r"""
import os, sys, time, numpy as np
t0 = time.perf_counter()
n = 0
for root, _, files in ([(os.path.dirname(sys.argv[1]) or ".", None, [os.path.basename(sys.argv[1])])]
                       if os.path.isfile(sys.argv[1]) else os.walk(sys.argv[1])):
    for f in files:
        n += int(np.fromfile(os.path.join(root, f), dtype=np.uint8).size)
print('{"read": %.6f, "bytes": %d}' % (time.perf_counter() - t0, n))
"""


def child(code: str, args: list, env: dict) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=1800)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"child failed ({r.returncode}): {r.stderr.strip()[-600:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["wall"] = wall
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--modes", default="default,ar")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    env = dict(os.environ, SPEL_GOVERNOR_STORE="0")
    modes = a.modes.split(",")
    runs = {m: [] for m in modes}
    page_in = []
    for i in range(a.runs):
        page_in.append(child(PAGE_IN, [a.model], env))
        for m in (modes if i % 2 == 0 else modes[::-1]):
            runs[m].append(child(CHILD, [a.model, a.prompt, m], env))
            print(f"run {i + 1}/{a.runs} {m}: " + " ".join(f"{k} {v:.2f}s" for k, v in runs[m][-1].items()),
                  file=sys.stderr, flush=True)

    def med(rows, k):
        return statistics.median(r[k] for r in rows)

    summary = {"model": a.model, "bytes": page_in[0]["bytes"], "read_s": med(page_in, "read"),
               "modes": {m: {k: med(rs, k) for k in ("import", "load", "first", "wall")} for m, rs in runs.items()}}
    print(f"{a.model}: {summary['bytes'] / 1e6:.0f} MB, read in {summary['read_s']:.2f} s (fresh process, warm page cache)")
    for m, s in summary["modes"].items():
        print(f"  {m:8s} import {s['import']:.2f} s, load {s['load']:.2f} s, first token {s['first']:.2f} s "
              f"after load; load + first token {s['load'] + s['first']:.2f} s; process {s['wall']:.2f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "runs": runs, "page_in": page_in}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
