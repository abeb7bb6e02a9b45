"""The "never slower" rows (docs/never_slower.md): the default command against
``--mode ar`` where speculation cannot pay, in one process and as whole processes,
each beside its goal.

    python bench/never_slower.py [--random FILE] [--shipped spel-21m] [--texts 3]
                                 [--pairs 3] [--repeats 3] [--gen 300] [--ttft FILE] [--json out.json]

Rows: a random-weight 21m checkpoint (alpha ~ 0; written by ``spel_mlx synth --preset
21m --seed 0`` when --random does not exist), greedy and sampled at T 0.7, in one
process (bench/heldout_decode.py: default / ar per held-out text, median; goal
>= 0.97) and whole processes (bench/wall.py: default / ar wall time per prompt,
median; goal <= 1.03); the shipped model sampled at T 1.5 in one process (>= 0.97);
with --ttft, the time to first token of a fresh process at that checkpoint beside
the page-in of its bytes (bench/ttft.py).  Every row runs in its own subprocess, one
after another: run it on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_ROW = "(the default:"          # heldout_decode's label of the default command's row


def bench(script: str, args: list) -> dict:
    with tempfile.TemporaryDirectory() as td:
        out = os.path.join(td, "r.json")
        r = subprocess.run([sys.executable, os.path.join(REPO, "bench", script), *args, "--json", out],
                           capture_output=True, text=True, cwd=REPO, timeout=7200)
        if r.returncode != 0:
            raise RuntimeError(f"{script} {' '.join(args)} failed: {r.stderr.strip()[-600:]}")
        with open(out) as f:
            return json.load(f)


def in_process(ckpt, rows: str, temperature: float, a) -> tuple:
    """(per-text default / ar ratios, their median, whether every output equals ar's)."""
    got = bench("heldout_decode.py", [*(["--checkpoint", ckpt] if ckpt else []), "--texts", str(a.texts),
                                      "--gen", str(a.gen), "--repeats", str(a.repeats), "--rows", rows,
                                      "--select", "default",
                                      "--temperature", str(temperature), "--k", str(a.k)])
    mine = [r for r in got["rows"] if DEFAULT_ROW in r["row"]]
    ratios = [round(r["x_ar"], 3) for r in mine]
    return ratios, statistics.median(ratios), all(r["same_as_ar"] for r in mine)


def whole_process(ckpt, temperature: float, a) -> tuple:
    got = bench("wall.py", [*(["--model", ckpt] if ckpt else []), "--pairs", str(a.pairs), "--prompts",
                            str(a.texts), "--max-tokens", str(a.gen), "--temperature", str(temperature)])
    ratios = [round(r["ratio"], 3) for r in got["rows"]]
    return ratios, statistics.median(ratios), all(r["same_output"] for r in got["rows"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--random", default="data/random-21m.spelw", help="random-weight 21m checkpoint (made if missing)")
    ap.add_argument("--shipped", default="spel-21m")
    ap.add_argument("--texts", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed calls per text in one process (their median is taken: more calls, less spread)")
    ap.add_argument("--gen", type=int, default=300)
    ap.add_argument("--k", type=int, default=3, help="heldout_decode's K (the shipped config's spec_k)")
    ap.add_argument("--ttft", default="", help="a checkpoint to time the first token of (e.g. a 218m synth)")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    if not os.path.exists(a.random):
        os.makedirs(os.path.dirname(a.random) or ".", exist_ok=True)
        subprocess.run([sys.executable, "-m", "spel_mlx", "synth", "--preset", "21m", "--seed", "0",
                        "--out", a.random], check=True, cwd=REPO)
    rows = []

    def row(name, how, goal, fn):
        ratios, med, same = fn()
        ok = med >= goal if how == ">=" else med <= goal
        rows.append({"row": name, "ratios": ratios, "median": med, "goal": f"{how} {goal}", "met": ok,
                     "same_as_ar": same})
        print(f"{name}: {' / '.join(map(str, ratios))}; median {med:.3f} (goal {how} {goal}: "
              f"{'met' if ok else 'NOT met'}); text equals ar's: {same}", flush=True)

    row("random 21m, greedy, one process", ">=", 0.97, lambda: in_process(a.random, "greedy", 0.7, a))
    row("random 21m, sampled T 0.7, one process", ">=", 0.97, lambda: in_process(a.random, "sampled", 0.7, a))
    row("random 21m, greedy, whole process", "<=", 1.03, lambda: whole_process(a.random, 0.0, a))
    row("random 21m, sampled T 0.7, whole process", "<=", 1.03, lambda: whole_process(a.random, 0.7, a))
    from spel_mlx.checkpoints.load import shipped_path
    shipped = shipped_path(a.shipped)
    row(f"{a.shipped}, sampled T 1.5, one process", ">=", 0.97, lambda: in_process(shipped, "sampled", 1.5, a))
    ttft = None
    if a.ttft:
        ttft = bench("ttft.py", ["--model", a.ttft, "--runs", "3"])["summary"]
        for m, s in ttft["modes"].items():
            print(f"first token, {a.ttft} ({ttft['bytes'] / 1e6:.0f} MB, read in {ttft['read_s']:.2f} s), {m}: "
                  f"load {s['load']:.2f} s + first token {s['first']:.2f} s; process {s['wall']:.2f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "ttft": ttft}, f, indent=1)
    return 0 if all(r["met"] and r["same_as_ar"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
