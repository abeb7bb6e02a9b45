"""Greedy decoding of the shipped model on held-out texts: ar / spec / governed /
n-gram / auto, with alpha and tokens per round, beside mlx-lm's greedy decoding of a
same-shape Llama (random weights) in the same process.

    python bench/heldout_decode.py [--texts 3] [--prompt 64] [--gen 128] [--repeats 3]
                                   [--checkpoint DIR] [--json out.json]

Texts: passages of data/corpus/heldout.txt (the split training never sees) starting
at 1/(n+1), 2/(n+1), ... of the file, ``--prompt`` tokens each.  Every row is the
median over ``--repeats`` timed calls after one untimed warm-up call (compiles the
passes); modes of one text are interleaved per repeat so load changes hit them alike.
``x AR`` divides by the ar row of the same text; ``x mlx-lm`` by mlx-lm's greedy rate
on the same prompt length.  Prints a markdown table (docs/decoding.md,
"Measurements").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import spel_mlx  # noqa: F401  (BLAS before mlx.core)
from spel_mlx import decoding as sp
from spel_mlx.checkpoints import load_checkpoint
from spel_mlx.model import SpelModel
from spel_mlx.tokenizer import load_tokenizer

import mlx.core as mx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import peers  # noqa: E402

MODES = [  # (label, mode, draft kind, threads, governor, drafting ahead)
    ("ar", "ar", None, 0, None, False),
    ("spec, C draft 1 thread", "spec", "c", 1, None, False),
    ("spec, C draft 1 thread, drafting ahead", "spec", "c", 1, None, True),
    ("spec, C draft 2 threads", "spec", "c", 2, None, False),
    ("governed, C draft 1 thread, drafting ahead", "governed", "c", 1, None, True),
    ("governed (grace 2), C draft 1 thread, drafting ahead", "governed", "c", 1,
     sp.GovernorConfig(zero_accept_grace=2), True),
    ("spec, n-gram draft", "spec", "ngram", 0, None, False),
    ("spec, auto (n-gram, else C drafting ahead)", "spec", "auto", 1, None, True),
]


def heldout_prompts(tok, data_dir: str, n: int, length: int) -> list:
    text = open(os.path.join(data_dir, "heldout.txt"), encoding="utf-8").read()
    out = []
    for i in range(1, n + 1):
        at = text.find("\n", len(text) * i // (n + 1)) + 1      # start of a line
        ids = tok.encode(text[at:at + 8 * length])
        out.append([int(t) for t in ids[:length]])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--data", default="data/corpus")
    ap.add_argument("--texts", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    ck = load_checkpoint(a.checkpoint)
    cfg = ck.cfg
    tok_path = os.path.join(ck.source, "tokenizer.model") if os.path.isdir(ck.source) else None
    tok = load_tokenizer(cfg.vocab, tok_path if tok_path and os.path.exists(tok_path) else None)
    model = SpelModel.from_weights(cfg, ck.weights)
    prompts = heldout_prompts(tok, a.data, a.texts, a.prompt)
    decoders = {}
    for label, mode, kind, threads, gov, ahead in MODES:
        draft = None if kind is None else sp.make_proposer(kind, model, weights=ck.weights, k=a.k,
                                                         threads=threads or None, ahead=ahead)
        decoders[label] = sp.SpeculativeDecoder(model, draft, mode, k=a.k, governor=gov)
    llama = peers.build_llama(cfg)
    rows = []
    for ti, prompt in enumerate(prompts):
        runs = {label: [] for label in decoders}
        runs["mlx-lm Llama greedy"] = []
        for label, dec in decoders.items():            # warm-up: compiles every pass shape
            dec.generate(prompt, a.gen)
        peers.greedy_decode_rate(llama, prompt, 8)
        outputs = {}
        for _ in range(a.repeats):
            for label, dec in decoders.items():
                out = dec.generate(prompt, a.gen)
                outputs.setdefault(label, out)
                runs[label].append(dict(dec.stats.to_dict()))
            runs["mlx-lm Llama greedy"].append({"tok_s": peers.greedy_decode_rate(llama, prompt, a.gen)[0]})
        ar_out = outputs["ar"]
        ar_rate = statistics.median(r["tok_s"] for r in runs["ar"])
        lm_rate = statistics.median(r["tok_s"] for r in runs["mlx-lm Llama greedy"])
        for label, rs in runs.items():
            rate = statistics.median(r["tok_s"] for r in rs)
            r0 = rs[0]
            rows.append({"text": ti, "row": label, "tok_s": rate, "x_ar": rate / ar_rate,
                         "x_mlx_lm": rate / lm_rate, "alpha": r0.get("alpha"),
                         "tokens_per_round": r0.get("tokens_per_round"),
                         "trips": r0.get("governor_trips"), "c": r0.get("c"), "v": r0.get("v"),
                         "same_as_ar": (outputs.get(label) == ar_out) if label in outputs else None})
    print(f"{cfg.d_model}d/{cfg.n_layers}L checkpoint {ck.source}; {a.texts} held-out texts, "
          f"prompt {a.prompt} tokens, {a.gen} generated, K={a.k}, median of {a.repeats}")
    labels = list(dict.fromkeys(r["row"] for r in rows))
    print("| row | tok/s (per text) | x AR | x mlx-lm | alpha | tokens/round | = ar output |")
    print("|---|---|---|---|---|---|---|")
    for label in labels:
        rs = [r for r in rows if r["row"] == label]
        f = lambda k, d=2: " / ".join("—" if r[k] is None else f"{r[k]:.{d}f}" for r in rs)  # noqa: E731
        same = "—" if rs[0]["same_as_ar"] is None else ("yes" if all(r["same_as_ar"] for r in rs) else "NO")
        print(f"| {label} | {f('tok_s', 0)} | {f('x_ar')} | {f('x_mlx_lm')} | {f('alpha', 3)} | "
              f"{f('tokens_per_round')} | {same} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"checkpoint": ck.source, "texts": a.texts, "prompt": a.prompt, "gen": a.gen,
                       "k": a.k, "repeats": a.repeats, "rows": rows}, fh, indent=1)
    for dec in decoders.values():
        dec.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
