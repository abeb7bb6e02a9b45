"""Decoding of the shipped model on held-out texts: greedy ar / raw spec / spec's default
(auto: n-gram, else the C draft drafting ahead while it pays; cost governor) / the C draft
alone / governed / n-gram / auto, with alpha and
tokens per round, beside mlx-lm's greedy decoding of a same-shape Llama (random weights)
in the same process; and sampled rows (the ``generate`` defaults: T 0.7, top-p 0.95,
penalty 1.1) for both lossless rules.

    python bench/heldout_decode.py [--texts 3] [--prompt 64] [--gen 128] [--repeats 3]
                                   [--rows all|greedy|sampled] [--select ar,default]
                                   [--temperature 0.7] [--checkpoint DIR] [--json out.json]

``--checkpoint`` a random-weight file (``python -m spel_mlx.synth --preset 21m``) gives
the alpha ~ 0 regime, where spec's default must stay near AR; ``--select`` keeps the
rows whose label contains one of the given words (the ar rows are always kept).

Texts: passages of data/corpus/heldout.txt (the split training never sees) starting
at 1/(n+1), 2/(n+1), ... of the file, ``--prompt`` tokens each.  Every row is the
median over ``--repeats`` timed calls after one untimed warm-up call (compiles the
passes); modes of one text are interleaved per repeat so load changes hit them alike.
Sampled rows use seed 1, 2, ... in repeat 1, 2, ... (the same seed for every row of a
repeat).  ``x AR`` divides by the ar row of the same text and kind (greedy or sampled);
``x mlx-lm`` by mlx-lm's greedy rate on the same prompt length; ``= ar output``
compares with that ar row's output (sampled: the first repeat's seed; the residual
rule emits other samples of the same distribution); alpha, tokens/round and drafted-ahead
hits per round are over all repeats.  Prints a markdown table
(docs/decoding.md, "Measurements").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace

import spel_mlx  # noqa: F401  (BLAS before mlx.core)
from spel_mlx import decoding as sp
from spel_mlx.reader import load_checkpoint
from spel_mlx.model import SpelModel
from spel_mlx.tokenizer import load_tokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import peers  # noqa: E402

SAMPLED = sp.SamplingParams(temperature=0.7, top_p=0.95, repetition_penalty=1.1)
COUPLED, RESIDUAL = replace(SAMPLED, accept="coupled"), replace(SAMPLED, accept="residual")
RAW = sp.GovernorConfig(policy="off")   # every round drafts (raw speculation)
GREEDY_MODES = [  # (label, mode, draft kind, threads, governor, drafting ahead)
    ("ar", "ar", None, 0, None, False),
    ("spec raw, C draft 1 thread", "spec", "c", 1, RAW, False),
    ("spec raw, C draft 1 thread, drafting ahead", "spec", "c", 1, RAW, True),
    ("spec raw, C draft 2 threads", "spec", "c", 2, RAW, False),
    ("spec (the default: auto = n-gram, else C drafting ahead while it pays; cost governor)",
     "spec", "auto", 1, None, "auto"),
    ("spec, C draft 1 thread (cost governor, drafting ahead while it pays)", "spec", "c", 1, None, "auto"),
    ("governed, C draft 1 thread, drafting ahead", "governed", "c", 1, None, True),
    ("governed (grace 2), C draft 1 thread, drafting ahead", "governed", "c", 1,
     sp.GovernorConfig(zero_accept_grace=2), True),
    ("spec raw, n-gram draft", "spec", "ngram", 0, RAW, False),
    ("spec raw, auto (n-gram, else C drafting ahead)", "spec", "auto", 1, RAW, True),
]
SAMPLED_MODES = [  # (label, mode, draft kind, threads, params, drafting ahead)
    ("ar, sampled", "ar", None, 0, COUPLED, False),
    ("spec sampled (the default: coupled, cost governor, drafting ahead while it pays), C draft", "spec",
     "c", 1, COUPLED, "auto"),
    ("spec sampled residual (the default until 2026-12-03: drafting ahead while it pays), C draft", "spec",
     "c", 1, RESIDUAL, "auto"),
    ("spec sampled coupled, C draft, drafting ahead", "spec", "c", 1, COUPLED, True),
    ("spec sampled coupled, C draft", "spec", "c", 1, COUPLED, False),
    ("spec sampled residual, C draft, drafting ahead", "spec", "c", 1, RESIDUAL, True),
    ("spec sampled residual, C draft", "spec", "c", 1, RESIDUAL, False),
    ("spec sampled residual, auto (n-gram, else C drafting ahead while it pays)", "spec", "auto", 1,
     RESIDUAL, "auto"),
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
    ap.add_argument("--rows", choices=("all", "greedy", "sampled"), default="all")
    ap.add_argument("--select", default="", help="comma-separated words: only rows whose label holds one")
    ap.add_argument("--temperature", type=float, default=SAMPLED.temperature,
                    help="of the sampled rows (low acceptance: 1.5)")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    words = [w for w in a.select.split(",") if w]
    wanted = lambda label: not words or label.startswith("ar") or any(w in label for w in words)  # noqa: E731
    ck = load_checkpoint(a.checkpoint)
    cfg = ck.cfg
    tok_path = os.path.join(ck.source, "tokenizer.model") if os.path.isdir(ck.source) else None
    tok = load_tokenizer(cfg.vocab, tok_path if tok_path and os.path.exists(tok_path) else None)
    model = SpelModel.from_weights(cfg, ck.weights)
    prompts = heldout_prompts(tok, a.data, a.texts, a.prompt)
    decoders = {}   # label -> (decoder, the ar label it is compared with, sampled)
    if a.rows in ("all", "greedy"):
        for label, mode, kind, threads, gov, ahead in filter(lambda r: wanted(r[0]), GREEDY_MODES):
            draft = None if kind is None else sp.make_proposer(kind, model, weights=ck.weights, k=a.k,
                                                               options=sp.DraftOptions(threads=threads or None,
                                                                                    ahead=ahead))
            decoders[label] = (sp.SpeculativeDecoder(model, draft, mode, k=a.k,
                                                     options=sp.DecodeOptions(governor=gov)), "ar", False)
    if a.rows in ("all", "sampled"):
        for label, mode, kind, threads, params, ahead in filter(lambda r: wanted(r[0]), SAMPLED_MODES):
            draft = None if kind is None else sp.make_proposer(kind, model, weights=ck.weights, k=a.k,
                                                               options=sp.DraftOptions(threads=threads or None,
                                                                                    ahead=ahead))
            params = replace(params, temperature=a.temperature)
            decoders[label] = (sp.SpeculativeDecoder(model, draft, mode, k=a.k, params=params), "ar, sampled", True)
    llama = None
    if a.rows != "sampled":
        try:
            llama = peers.build_llama(cfg)
        except ImportError:     # the peers extra (mlx-lm) is optional: its row is left out
            print("mlx-lm is not installed: no mlx-lm row (pip install -e '.[peers]')", file=sys.stderr)
    rows = []
    for ti, prompt in enumerate(prompts):
        runs = {label: [] for label in decoders}
        if llama is not None:
            runs["mlx-lm Llama greedy"] = []
        for label, (dec, _, sampled) in decoders.items():      # warm-up: compiles every pass shape
            dec.generate(prompt, a.gen)
        if llama is not None:
            peers.greedy_decode_rate(llama, prompt, 8)
        outputs = {}
        labels = list(decoders)
        for rep in range(a.repeats):
            # each repeat starts one row later: a fixed order ran the first row ~3% slower
            for label in labels[rep % len(labels):] + labels[:rep % len(labels)]:
                dec, _, sampled = decoders[label]
                if sampled:
                    dec.params = replace(dec.params, seed=rep + 1)
                out = dec.generate(prompt, a.gen)
                outputs.setdefault(label, out)
                runs[label].append(dict(dec.stats.to_dict()))
            if llama is not None:
                runs["mlx-lm Llama greedy"].append({"tok_s": peers.greedy_decode_rate(llama, prompt, a.gen)[0]})
        lm_rate = statistics.median(r["tok_s"] for r in runs["mlx-lm Llama greedy"]) if llama is not None else None
        for label, rs in runs.items():
            ar_label = decoders[label][1] if label in decoders else "ar"
            ar_rate = statistics.median(r["tok_s"] for r in runs[ar_label]) if ar_label in runs else None
            rate = statistics.median(r["tok_s"] for r in rs)
            r0 = rs[0]
            total = lambda key: sum(r.get(key) or 0 for r in rs)  # noqa: E731  (over the repeats' seeds)
            rows.append({"text": ti, "row": label, "tok_s": rate, "x_ar": rate / ar_rate if ar_rate else None,
                         "x_mlx_lm": rate / lm_rate if lm_rate else None,
                         "alpha": total("accepted") / total("proposed") if total("proposed") else r0.get("alpha"),
                         "tokens_per_round": total("tokens") / total("rounds") if total("rounds") else None,
                         "hits_per_round": total("ahead_hits") / total("rounds") if "ahead_hits" in r0 else None,
                         "trips": r0.get("governor_trips"), "c": r0.get("c"), "v": r0.get("v"),
                         "ahead_hits": r0.get("ahead_hits"), "ahead_misses": r0.get("ahead_misses"),
                         "same_as_ar": (outputs.get(label) == outputs.get(ar_label)) if label in outputs else None})
    print(f"{cfg.d_model}d/{cfg.n_layers}L checkpoint {ck.source}; {a.texts} held-out texts, "
          f"prompt {a.prompt} tokens, {a.gen} generated, K={a.k}, median of {a.repeats}")
    labels = list(dict.fromkeys(r["row"] for r in rows))
    print("| row | tok/s (per text) | x AR | median x AR | x mlx-lm | alpha | tokens/round | ahead hits/round | "
          "= ar output |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label in labels:
        rs = [r for r in rows if r["row"] == label]
        f = lambda k, d=2: " / ".join("—" if r[k] is None else f"{r[k]:.{d}f}" for r in rs)  # noqa: E731
        same = "—" if rs[0]["same_as_ar"] is None else ("yes" if all(r["same_as_ar"] for r in rs) else "no")
        ratios = [r["x_ar"] for r in rs if r["x_ar"] is not None]
        med = f"{statistics.median(ratios):.2f}" if ratios else "—"
        print(f"| {label} | {f('tok_s', 0)} | {f('x_ar')} | {med} | {f('x_mlx_lm')} | "
              f"{f('alpha', 3)} | {f('tokens_per_round')} | {f('hits_per_round')} | {same} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"checkpoint": ck.source, "texts": a.texts, "prompt": a.prompt, "gen": a.gen,
                       "k": a.k, "repeats": a.repeats, "rows": rows}, fh, indent=1)
    for dec, _, _ in decoders.values():
        dec.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
