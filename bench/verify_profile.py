"""Profile the target's AR step and K+1 verify passes (21m shape by default).

    python bench/verify_profile.py [--preset 21m] [--repeats 40] [--Ms 2,5,9,17] [--strict]

Random weights, a 100-token prompt prefilled; every timed call forwards on the
same position: the AR step discards, a verify pass of M commits about half
and runs one AR step (which evaluates the accepted token's GDN state, left
lazy by the pass), the median AR step is subtracted, then it restores (untimed).  The calls of all shapes are
interleaved round by round so load changes on a shared machine hit them alike;
each figure is the median of the repeats, CPU time (process_time) beside wall.
"""
from __future__ import annotations

import argparse
import statistics
import time

import spel_mlx  # noqa: F401  (BLAS before mlx.core)
from spel_mlx import model as model_mod
from spel_mlx.config import resolve_config

import mlx.core as mx  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="21m", help="21m, 218m, or 'shipped' (the packaged trained model)")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--Ms", default="2,5,9,17")
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--strict", action="store_true", help="also time strict verify")
    args = ap.parse_args(argv)
    if args.preset == "shipped":
        from spel_mlx.reader import load_checkpoint
        ck = load_checkpoint()
        cfg, weights = ck.cfg, ck.weights
    else:
        cfg = resolve_config(args.preset, use_env=False)
        weights = model_mod.init_weights(cfg, seed=0)
    Ms = [int(m) for m in args.Ms.split(",")]
    model = model_mod.SpelModel.from_weights(cfg, weights)
    state = model.new_state("target", ring=max(Ms) + 1)
    prompt = [(7 * i + 3) % cfg.vocab for i in range(args.prompt)]
    model.prefill(prompt, state)
    modes = [("ar", 1, False)] + [(f"M={m}", m, False) for m in Ms]
    if args.strict:
        modes += [(f"M={m} strict", m, True) for m in Ms]
    toks = {m: [(5 * j + 1) % cfg.vocab for j in range(m)] for _, m, _ in modes}

    snap = state.snapshot()

    def call(m, strict):
        """(wall, cpu) seconds of the timed part of one call."""
        w0, c0 = time.perf_counter(), time.process_time()
        mx.eval(model.forward(toks[m], state, strict=strict))
        if m == 1:
            w, c = time.perf_counter() - w0, time.process_time() - c0
            state.discard()
            return w, c
        # a verify round: accept about half, then the next pass starts from the
        # accepted token's state (left lazy by the pass, so evaluated there)
        state.commit(m // 2 + 1)
        mx.eval(model.forward(toks[1], state))
        w, c = time.perf_counter() - w0, time.process_time() - c0
        state.discard()
        state.restore(snap)      # untimed: rewrites the caches
        mx.eval([state.k_cache, state.v_cache])
        return w, c

    for _, m, s in modes:          # compile + warm
        for _ in range(3):
            call(m, s)
    wall = {name: [] for name, _, _ in modes}
    cpu = {name: [] for name, _, _ in modes}
    for _ in range(args.repeats):
        for name, m, s in modes:
            w, c = call(m, s)
            wall[name].append(w)
            cpu[name].append(c)
    # a verify round timed the pass plus the next AR step: take one AR step off
    ar_c, ar_w = statistics.median(cpu["ar"]), statistics.median(wall["ar"])
    for name, m, _ in modes:
        if m > 1:
            cpu[name] = [c - ar_c for c in cpu[name]]
            wall[name] = [w - ar_w for w in wall[name]]
    print(f"{args.preset}: pos={args.prompt}, {args.repeats} repeats, medians")
    print(f"{'pass':>12} {'cpu ms':>8} {'wall ms':>8} {'min wall':>8} {'v(cpu)':>7} {'v(wall)':>7}")
    for name, _, _ in modes:
        c, w = statistics.median(cpu[name]), statistics.median(wall[name])
        print(f"{name:>12} {c * 1e3:8.2f} {w * 1e3:8.2f} {min(wall[name]) * 1e3:8.2f} "
              f"{c / ar_c:7.2f} {w / ar_w:7.2f}")


if __name__ == "__main__":
    main()
