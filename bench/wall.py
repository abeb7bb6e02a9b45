"""Whole-process wall time of the default command against ``--mode ar``: what a user who
types ``python -m spel_mlx generate`` waits for (interpreter, imports, load, prefill,
one-time costs and decoding), in interleaved pairs so a drifting machine hits both alike.

    python bench/wall.py [--model DIR|FILE] [--pairs 7] [--max-tokens 300]
                         [--temperature 0|0.7] [--prompts 3] [--json out.json] [--extra ARGS]

Per held-out prompt, `--pairs` pairs of fresh processes (the default command, then the
same with ``--mode ar``; the order alternates pair by pair), each timed from spawn to
exit; the row gives both medians, the median of the per-pair ratios (default / ar: below
1 the default is faster) and the same seeds' outputs compared (greedy and the coupled
rule must give ar's text).  The governor's store is off (SPEL_GOVERNOR_STORE=0) unless
`--store` is given, so each process starts as a first run on this machine would.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def held_out_prompts(data_dir: str, n: int, chars: int = 300) -> list:
    """n passages of held-out text (never seen in training), each from a line start."""
    text = open(os.path.join(data_dir, "heldout.txt"), encoding="utf-8").read()
    lines = [ln for ln in text.replace("<|endoftext|>\n", "").split("\n") if ln.strip()]
    out = []
    for i in range(1, n + 1):
        passage = "\n".join(lines[len(lines) * i // (n + 1):])[:chars]
        out.append(passage.rsplit(" ", 1)[0] if " " in passage else passage)
    return out


def run_once(args: list, env: dict) -> tuple:
    """(wall seconds from spawn to exit, stdout, the --stats JSON)."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "spel_mlx.generate", "--stats", "--no-stream", *args],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"generate {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()[-400:]}")
    stats = next((json.loads(line) for line in r.stderr.splitlines()[::-1] if line.startswith("{")), {})
    return wall, r.stdout, stats


def measure(prompt_file: str, common: list, pairs: int, env: dict) -> dict:
    walls = {"default": [], "ar": []}
    outs, ratios, decode = {}, [], {"default": [], "ar": []}
    for p in range(pairs):
        order = ("default", "ar") if p % 2 == 0 else ("ar", "default")
        got = {}
        for row in order:
            extra = ["--mode", "ar"] if row == "ar" else []
            got[row] = run_once(["--prompt-file", prompt_file, *common, *extra], env)
            walls[row].append(got[row][0])
            decode[row].append(got[row][2].get("tok_s"))
            outs.setdefault(row, got[row][1])
        ratios.append(got["default"][0] / got["ar"][0])
    med = statistics.median
    return {"default_wall_s": med(walls["default"]), "ar_wall_s": med(walls["ar"]),
            "ratio": med(ratios), "ratios": [round(r, 3) for r in ratios],
            "default_tok_s": med(t for t in decode["default"] if t), "ar_tok_s": med(t for t in decode["ar"] if t),
            "same_output": outs["default"] == outs["ar"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the shipped model)")
    ap.add_argument("--data", default="data/corpus")
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--store", action="store_true", help="keep the governor's store on (a machine's later runs)")
    ap.add_argument("--extra", default="", help="more generate flags for both commands")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    env = dict(os.environ)
    if not a.store:
        env["SPEL_GOVERNOR_STORE"] = "0"
    common = ["--max-tokens", str(a.max_tokens), "--temperature", str(a.temperature), "--seed", str(a.seed),
              *(["--checkpoint", a.model] if a.model else []), *a.extra.split()]
    rows = []
    with tempfile.TemporaryDirectory() as td:
        for i, text in enumerate(held_out_prompts(a.data, a.prompts)):
            pf = os.path.join(td, f"p{i}.txt")
            with open(pf, "w", encoding="utf-8") as f:
                f.write(text)
            r = measure(pf, common, a.pairs, env)
            r["prompt"] = i
            rows.append(r)
            print(f"prompt {i}: default {r['default_wall_s']:.2f} s, ar {r['ar_wall_s']:.2f} s, "
                  f"default/ar {r['ratio']:.3f} ({', '.join(map(str, r['ratios']))}); decoding "
                  f"{r['default_tok_s']:.0f} vs {r['ar_tok_s']:.0f} tok/s; same output {r['same_output']}",
                  flush=True)
    print(f"median default/ar wall over prompts: {statistics.median(r['ratio'] for r in rows):.3f} "
          f"({a.max_tokens} tokens, T {a.temperature:g}, {a.pairs} pairs each)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"model": a.model, "max_tokens": a.max_tokens, "temperature": a.temperature,
                       "pairs": a.pairs, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
