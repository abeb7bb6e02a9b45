"""Speculation across a pipeline: ar vs spec on 1, 2 and 3 ranks on localhost, each
round's time split into compute per rank and communication, and a cost model for P
machines joined by links of latency L, checked against the localhost runs.

    python bench/pipeline.py [--checkpoint DIR] [--gen 128] [--k 4] [--repeats 3]
                             [--ranks 1,2,3] [--json docs/pipeline.json]

1 rank is the plain single-process decoder; P >= 2 ranks run under mlx.launch (ring
backend, 127.0.0.1) through ``python -m spel_mlx.distributed``.  Per rank count, one
untimed warm-up of each mode, then ``--repeats`` interleaved ar / spec calls (greedy,
the C draft); every figure is the median over the repeats of each call's median
round.  A round's rest (communication, and per-round overhead) is its time on rank 0
minus the draft's part and the compute of every rank (ranks compute one after the
other within a round).  Absolute speeds on a shared 2-core machine mean little; the
ratio spec / ar at each rank count is the point (docs/distributed.md).

Cost model: a round on P ranks costs  draft + C(M) + P * hop, with C(M) the target's
compute for M rows summed over the ranks (an AR step M = 1, a verification M = K+1)
and hop the one-way cost of one message (latency and software; the bytes, (K+1) * d
* 4, are a few KB), whatever M.  ar gives 1 / T(1) tokens/s, spec tokens_per_round /
(draft + T(K+1)).  Check: each P's ar run gives its hop (rest / P); the model then
predicts that P's spec round from its draft and compute, and spec/ar, compared with
the measurement.  Projections: the 1-rank compute on P machines at hop latencies
LATENCIES_MS.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.common import machine_info, write_json_atomic  # noqa: E402

import spel_mlx  # noqa: E402,F401  (BLAS before mlx.core)
from spel_mlx.distributed.launch import launch_command  # noqa: E402

PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
LATENCIES_MS = (0.05, 0.2, 1.0, 5.0)   # one-way per hop, software included: projections


def requests(gen: int, k: int, repeats: int) -> list:
    # drafting ahead off: on a machine with fewer cores than ranks its thread would take
    # a core from a rank; the draft's time is then all on the round's critical path
    base = dict(prompt=PROMPT, temperature=0, k=k, draft_ahead="off")
    warm = [dict(base, max_tokens=16, mode="ar"), dict(base, max_tokens=16, mode="spec", draft="c")]
    timed = [dict(base, max_tokens=gen, mode=m, **({"draft": "c"} if m == "spec" else {}))
             for _ in range(repeats) for m in ("ar", "spec")]
    return warm + timed


def run_single(checkpoint, reqs: list) -> list:
    from spel_mlx.api import load
    from spel_mlx.distributed.batch import run_request
    model, tok = load(checkpoint)
    try:
        return [dict(run_request(model, tok, spec), ranks=None) for spec in reqs]
    finally:
        model.close()


def run_pipeline(n: int, checkpoint, reqs: list) -> list:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "reqs.json")
        with open(path, "w") as f:
            json.dump(reqs, f)
        args = ["-m", "spel_mlx.distributed", "--requests", path] + (["--checkpoint", checkpoint] if checkpoint else [])
        p = subprocess.run(launch_command(n, args), capture_output=True, text=True, timeout=1800)
    lines = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    if len(lines) != len(reqs):
        raise RuntimeError(f"{n} ranks: {len(lines)} of {len(reqs)} requests answered\n{p.stderr}")
    return lines


def round_figures(line: dict) -> dict:
    """One call's figures, per round in ms (medians over its rounds, so bursts of other
    work on the machine weigh little): the round on rank 0, the target's part of it
    (verification: each rank's compute, the rest communication), the draft's part
    (mean), and tok/s at that round time and over the whole call."""
    st, ranks = line["stats"], line["ranks"]
    spec = st["spec_rounds"] > 0
    rounds = st["spec_rounds"] if spec else st["ar_rounds"]
    draft = st["draft_s"] / rounds if spec else 0.0
    round_s = line["round_median_s"]
    verify = round_s - draft
    # one process: the target's part is all compute (and the round's own overhead)
    compute = [verify] if ranks is None else [r["compute_median_s"] for r in ranks]
    return {"tok_s": st["tokens_per_round"] / round_s, "call_tok_s": st["tokens"] / st["decode_s"],
            "round_ms": 1e3 * round_s, "draft_ms": 1e3 * draft, "verify_ms": 1e3 * verify,
            "compute_ms": [1e3 * c for c in compute], "comm_ms": 1e3 * max(0.0, verify - sum(compute)),
            "tokens_per_round": st["tokens_per_round"], "alpha": st["alpha"]}


def medians(rows: list) -> dict:
    out = {}
    for key in rows[0]:
        vals = [r[key] for r in rows]
        out[key] = [statistics.median(v) for v in zip(*vals)] if isinstance(vals[0], list) else statistics.median(vals)
    return out


def model_round(C: float, P: int, hop: float, draft: float = 0.0) -> float:
    """One round on P ranks: the draft, the target's compute (split across the ranks,
    done one after the other), and P hops round the ring (any unit, the same for all)."""
    return draft + C + P * hop


def cost_model(res: dict) -> dict:
    """Check: at each P, the ar run's rest gives the hop (rest / P); the model then
    predicts the spec round from that run's draft and compute, and spec/ar.
    Projections: the 1-rank run's compute, draft and tokens/round on P machines at
    the hop latencies LATENCIES_MS."""
    out = {"check": {}, "compute_inflation": {}}
    for n, r in res.items():
        P, ar, sp = int(n), r["ar"], r["spec"]
        # the ranks' compute summed, over one process's: > 1 when ranks slow each other down
        out["compute_inflation"][n] = {m: sum(r[m]["compute_ms"]) / res["1"][m]["compute_ms"][0]
                                       for m in ("ar", "spec")} if "1" in res else None
        if P < 2:
            continue
        hop = ar["comm_ms"] / P
        spec_round = model_round(sum(sp["compute_ms"]), P, hop, sp["draft_ms"])
        out["check"][n] = {"hop_ms": hop, "spec_round_ms": {"predicted": spec_round, "measured": sp["round_ms"]},
                           "spec_over_ar": {"predicted": sp["tokens_per_round"] * ar["round_ms"] / spec_round,
                                            "measured": sp["tok_s"] / ar["tok_s"]}}
    if "1" in res:
        one = res["1"]
        C_ar, C_v = one["ar"]["verify_ms"] / 1e3, one["spec"]["verify_ms"] / 1e3
        draft, tpr = one["spec"]["draft_ms"] / 1e3, one["spec"]["tokens_per_round"]
        out["fit"] = {"C_ar_ms": 1e3 * C_ar, "C_verify_ms": 1e3 * C_v, "draft_ms": 1e3 * draft, "tokens_per_round": tpr}
        out["projection"] = []
        for L in LATENCIES_MS:
            for P in (2, 4, 8):
                t_ar, t_spec = model_round(C_ar, P, L / 1e3), model_round(C_v, P, L / 1e3, draft)
                out["projection"].append({"latency_ms": L, "P": P, "ar_tok_s": 1 / t_ar, "spec_tok_s": tpr / t_spec,
                                          "spec_over_ar": tpr * t_ar / t_spec})
    return out


def table(res: dict) -> str:
    lines = ["| ranks | mode | tok/s | spec/ar | round ms | draft ms | compute ms per rank | rest ms | tokens/round |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n, modes in res.items():
        for m in ("ar", "spec"):
            f = modes[m]
            ratio = f"{modes['spec']['tok_s'] / modes['ar']['tok_s']:.2f}" if m == "spec" else ""
            lines.append(f"| {n} | {m} | {f['tok_s']:.1f} | {ratio} | {f['round_ms']:.2f} | {f['draft_ms']:.2f} | "
                         f"{' + '.join(f'{c:.2f}' for c in f['compute_ms'])} | {f['comm_ms']:.2f} | "
                         f"{f['tokens_per_round']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="default: the shipped model")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ranks", default="1,2,3")
    ap.add_argument("--passes", type=int, default=1, help="sweeps over the rank counts (medians pool them)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from spel_mlx.loading import checkpoint_path
    checkpoint = checkpoint_path(args.checkpoint)
    reqs = requests(args.gen, args.k, args.repeats)
    load_before = os.getloadavg()
    figures = {}
    for _ in range(args.passes):      # rank counts interleaved, so changes in load hit them alike
        for n in args.ranks.split(","):
            lines = run_single(checkpoint, reqs) if n == "1" else run_pipeline(int(n), checkpoint, reqs)
            for ln, spec in zip(lines[2:], reqs[2:]):
                figures.setdefault(n, {}).setdefault(spec["mode"], []).append(round_figures(ln))
    res = {n: {m: medians(rows) for m, rows in modes.items()} for n, modes in figures.items()}
    out = {"schema": "spel-mlx-pipeline/1", "machine": dict(machine_info(), loadavg_before=load_before,
                                                             loadavg_after=os.getloadavg()),
           "checkpoint": checkpoint, "K": args.k, "gen": args.gen, "repeats": args.repeats, "results": res}
    if "1" in res:
        out["cost_model"] = cost_model(res)
    print(table(res))
    if args.json:
        write_json_atomic(args.json, out)
    else:
        print(json.dumps(out.get("cost_model", {}), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
