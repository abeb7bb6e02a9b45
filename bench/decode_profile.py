"""Where a round's time goes in real decoding: the fused CPU pass bodies of the target
(``_spel_cpu.profile``) per verification round and per AR step, against their wall time.

    python bench/decode_profile.py [--model DIR] [--texts 3] [--gen 300] [--temperature 0.7]
                                   [--repeats 2] [--json out.json]

After an untimed call of each mode (it builds the pass shapes), per held-out text and
repeat, one `spec` call with the governor off (every round verifies K+1 rows) and one
`--mode ar` call, each after a call that only prefills the same prompt, whose bodies are
subtracted: what is left is the decoding's own passes.  The figures a
bench of a single pass shape gives (``verify_profile.py``) run the same pass again and
again with hot caches; here the weights, the K/V caches and the GDN states come from
memory as they do in use.  Prints one line per call and the medians (ms per round):

* ``bodies``: the pass bodies (``products`` of the linear maps, the ``delta`` rule,
  ``attention``, the LM ``head``);
* ``verify``: the wall time of a verification, dispatch to the rows read;
* ``round``: the decode time per round (the draft's share, sampling and bookkeeping too).

Needs the fused CPU primitives (Linux x86-64 or arm64 with the package built).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import spel_mlx  # noqa: F401  (BLAS before mlx.core)

KINDS = {"products": "block.linear", "delta": "block.delta", "attention": "block.attend", "head": "linear"}


def per_round(profile: dict, before: dict, rounds: int) -> dict:
    """The bodies of `profile` less those of `before` (each {kind: (calls, seconds)}), in ms
    per round: the whole pass (the blocks, the head and the row-wise nodes) and its parts."""
    def ms(kind):
        return (profile.get(kind, (0, 0.0))[1] - before.get(kind, (0, 0.0))[1]) / rounds * 1e3
    out = {name: ms(kind) for name, kind in KINDS.items()}
    out["bodies"] = ms("block") + ms("linear") + ms("rowwise")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the shipped model)")
    ap.add_argument("--data", default="data/corpus")
    ap.add_argument("--texts", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--gen", type=int, default=300)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    for name in ("texts", "gen", "repeats", "prompt"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1")
    from spel_mlx import load
    from spel_mlx.api import prepare
    from spel_mlx.decoding import GovernorConfig
    from spel_mlx.model import cpu_ops
    if not cpu_ops.available():
        print(f"the fused CPU primitives are not here ({cpu_ops.status()[1]}): nothing to profile", file=sys.stderr)
        return 1
    cpu = cpu_ops._spel_cpu
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.heldout_decode import heldout_prompts

    model, tok = load(args.model) if args.model else load()
    texts = heldout_prompts(tok, args.data, args.texts, args.prompt)
    sampling = dict(temperature=args.temperature, top_p=0.95, repetition_penalty=1.1)

    def call(text, mode, max_tokens, seed):
        extra = {"mode": "ar"} if mode == "ar" else {"governor": GovernorConfig(policy="off")}
        cpu.profile(True)
        try:
            last = prepare(model, tok, text, max_tokens, seed=seed, **sampling, **extra).run()
        finally:
            prof = cpu.profile(False)
        return prof, last.stats

    for mode in ("spec", "ar"):      # untimed: builds the pass shapes and weight layouts
        call(texts[0], mode, args.gen, 0)
    rows = {"spec": [], "ar": []}
    for ti, text in enumerate(texts):
        for rep in range(args.repeats):
            for mode in ("spec", "ar"):
                before, _ = call(text, mode, 1, rep + 1)
                prof, st = call(text, mode, args.gen, rep + 1)
                rounds = max(1, st["rounds"] - 1)
                r = per_round(prof, before, rounds)
                r["round"] = st["decode_s"] / st["rounds"] * 1e3
                r["verify"] = st["verify_s"] / st["spec_rounds"] * 1e3 if st.get("spec_rounds") else None
                r["tokens_per_round"] = st["tokens"] / st["rounds"]
                rows[mode].append(r)
                print(f"text {ti} repeat {rep} {mode}: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in r.items() if v is not None), flush=True)
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0] if rs[0][k] is not None}
           for mode, rs in rows.items()}
    spec, ar = med["spec"], med["ar"]
    print(f"\nmedians, ms per round ({len(texts)} texts x {args.repeats}, T {args.temperature:g}, "
          f"{model.cfg.spec_k + 1}-row verifications):")
    print("| | bodies | products | delta | attention | head | verify wall | round |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| verification | {spec['bodies']:.2f} | {spec['products']:.2f} | {spec['delta']:.2f} | "
          f"{spec['attention']:.2f} | {spec['head']:.2f} | {spec['verify']:.2f} | {spec['round']:.2f} |")
    print(f"| AR step | {ar['bodies']:.2f} | {ar['products']:.2f} | {ar['delta']:.2f} | "
          f"{ar['attention']:.2f} | {ar['head']:.2f} | | {ar['round']:.2f} |")
    print(f"v by bodies {spec['bodies'] / ar['bodies']:.2f}, by wall {spec['verify'] / ar['round']:.2f}; "
          f"tokens per round {spec['tokens_per_round']:.2f}")
    if args.json:
        from spel_mlx.atomic import write_json
        write_json(args.json, {"args": vars(args), "calls": rows, "medians": med})
    return 0


if __name__ == "__main__":
    sys.exit(main())
