"""Round traces: what a round would decide at every position, replayed under any rule.

    python bench/round_traces.py [--checkpoint DIR] [--texts 5] [--prompt 64] [--gen 256]
                                 [--costs quiet,busy] [--noise 0.3]
                                 [--save traces.npz | --load traces.npz]

Greedy decoding makes a round's outcome a function of where it starts: for every
position of the AR output this records what the C draft proposes from there (its top two
tokens and probabilities at up to 12 steps, the draft's own chain), the target's tokens
and the n-gram lookup.  Proposal rules (draft length from the draft's confidence, n-gram
and model per position, a branch on the second choice) are then replayed exactly, and so
are governor policies (``decoding.governor``) over modelled round costs.  Prints the
tables of docs/decoding.md ("Cost-model governor", "Acceptance where it is lost").

Model tokens after an accepted prefix are the draft's choice given the true prefix, which
is the first proposal of a round starting there; the replay of fixed K reproduces the
engine's alpha and rounds exactly.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

import spel_mlx  # noqa: F401  (BLAS before mlx.core)
from spel_mlx import decoding as sp
from spel_mlx.reader import load_checkpoint
from spel_mlx.decoding.ngram import NgramIndex
from spel_mlx.model import SpelModel
from spel_mlx.native.cdraft import CDraft
from spel_mlx.tokenizer import load_tokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.heldout_decode import heldout_prompts  # noqa: E402

STEPS = 12
FIELDS = ("toks", "top2", "p1", "p2", "tgt", "ngram")
# round costs in AR tokens: verify rows (index = rows) and one draft forward (c), measured
# (docs/decoding.md): the shipped model quiet and busy, the 21m and 218m random checkpoints
COSTS = {"quiet": ([0.0] + [1 + 0.25 * (m - 1) for m in range(1, STEPS + 2)], 0.13),
         "busy": ([0.0, 1.0, 1.09, 1.24, 1.55, 1.9, 2.5, 3.06, 3.3, 3.6, 3.65, 3.7, 3.75, 3.8], 0.12),
         "21m": ([0.0, 1.0, 1.29, 1.40, 1.47, 1.80, 2.11, 2.38, 2.57, 2.57, 2.70, 2.62, 3.14, 2.62], 0.022),
         "218m": ([0.0, 1.0, 1.18, 1.14, 1.13, 1.45, 1.63, 1.36, 1.47, 1.58, 1.75, 2.02, 2.15, 1.78], 0.02)}


def record(model, weights, cfg, prompt, gen) -> dict:
    """The trace of one prompt: per generated position, the draft's chain and the target's."""
    out = sp.SpeculativeDecoder(model, None, "ar").generate(prompt, gen + STEPS + 2)
    seq = list(prompt) + list(out)
    ring = STEPS + 2
    draft = CDraft(cfg, weights, threads=1, ring=ring)
    for i in range(0, len(prompt) - 1, ring):
        chunk = prompt[i:min(i + ring, len(prompt) - 1)]
        draft.forward(chunk, logits=False)
        draft.commit(len(chunk))
    t = {f: np.zeros((gen, STEPS + 1), np.float64 if f in ("p1", "p2") else np.int32) for f in FIELDS[:5]}
    t["ngram"] = np.full((gen, STEPS), -1, np.int32)
    index = NgramIndex(2, 4)
    index.extend(seq[:len(prompt) - 1])
    for r in range(gen):
        i = len(prompt) - 1 + r                 # the round's pending token
        index.append(seq[i])
        found = index.lookup(STEPS)
        t["ngram"][r, :len(found)] = found
        tok = seq[i]
        for j in range(STEPS + 1):
            z = draft.forward([tok], start=j)[0].astype(np.float64)
            p = np.exp(z - z.max())
            p /= p.sum()
            a, b = np.argsort(-p)[:2]
            t["toks"][r, j], t["top2"][r, j], t["p1"][r, j], t["p2"][r, j] = a, b, p[a], p[b]
            t["tgt"][r, j] = seq[i + 1 + j]
            tok = int(a)
        draft.commit(1)
    draft.close()
    return t


def replay(t, gen, choose, k=4, branch=False):
    """Rounds of a proposal rule: choose(t, r) -> proposal.  Returns [(proposed, accepted,
    rows verified, drafted-ahead hit)] and the tokens per round."""
    r, rounds = 0, []
    while r < gen:
        prop = choose(t, r)[:max(0, gen - r - 1)]
        n = 0
        while n < len(prop) and prop[n] == t["tgt"][r, n]:
            n += 1
        rows, gained = len(prop) + 1, 0
        if branch and n < len(prop):
            rows += 1
            gained = int(t["top2"][r + n, 0] == t["tgt"][r, n]) if r + n < len(t["tgt"]) else 0
        m = len(prop)
        hit = m > 0 and n == m and t["toks"][r, m] == t["tgt"][r, m]
        rounds.append((m, n, rows, hit))
        r += n + 1 + gained
    return rounds, gen / len(rounds)


def modelled_speed(rounds, gen, costs) -> float:
    """tokens per AR-token time, drafting ahead (a round after a hit has no draft time)."""
    verify, c = costs
    total, prev_hit = 0.0, False
    for m, _, rows, hit in rounds:
        total += verify[min(rows, len(verify) - 1)] + ((m + 1) * c if m and not prev_hit else 0.0)
        prev_hit = hit
    return gen / total


def model_token(t, r, j):
    return int(t["toks"][r + j, 0]) if r + j < len(t["toks"]) else -1


def fixed(k):
    return lambda t, r: [int(x) for x in t["toks"][r, :k]]


def by_ratio(thr, kmin, kmax):
    """Propose while the draft's p1/p2 >= thr, at least kmin and at most kmax."""
    def rule(t, r):
        out = []
        for j in range(kmax):
            if j >= kmin and t["p1"][r, j] < thr * t["p2"][r, j]:
                break
            out.append(int(t["toks"][r, j]))
        return out
    return rule


def ngram_where_unsure(thr, k=4):
    def rule(t, r):
        out = []
        for j in range(k):
            g = int(t["ngram"][r, j])
            tok = model_token(t, r, j)
            out.append(g if g >= 0 and r + j < len(t["p1"]) and t["p1"][r + j, 0] < thr * t["p2"][r + j, 0] else tok)
        return out
    return rule


def ngram_first(k=4):
    return lambda t, r: [int(t["ngram"][r, j]) if t["ngram"][r, j] >= 0 else model_token(t, r, j) for j in range(k)]


RULES = [("fixed K = 4 (today)", fixed(4), False), ("fixed K = 3", fixed(3), False), ("fixed K = 6", fixed(6), False),
         ("stop early: after 2, when the draft's p1/p2 < 1.5", by_ratio(1.5, 2, 4), False),
         ("stop early: after 1, when p1/p2 < 1.1", by_ratio(1.1, 1, 4), False),
         ("past K: 4..8 while p1/p2 >= 1.1", by_ratio(1.1, 4, 8), False),
         ("both: 2..8 while p1/p2 >= 1.5", by_ratio(1.5, 2, 8), False),
         ("n-gram token where the draft is unsure (p1/p2 < 1.5)", ngram_where_unsure(1.5), False),
         ("n-gram continuation first, the model extends it", ngram_first(), False),
         ("branch: the draft's 2nd choice at the first rejection, one more row", fixed(4), True)]


def rules_table(traces, gen, costs):
    base = {}
    print(f"| rule | tokens / round per text | modelled speed, {' / '.join(costs)} |")
    print("|---|---|---|")
    for name, rule, branch in RULES:
        runs = [replay(t, gen, rule, branch=branch) for t in traces]
        speed = {c: [modelled_speed(rounds, gen, COSTS[c]) for rounds, _ in runs] for c in costs}
        base = base or speed
        rel = " / ".join(f"{statistics.median(a / b for a, b in zip(speed[c], base[c])):.2f}" for c in costs)
        print(f"| {name} | {' / '.join(f'{tpr:.2f}' for _, tpr in runs)} | {rel} |")


def governor_table(traces, gen, costs, noise=0.0, k=4):
    """spec's default governor replayed on modelled costs, against raw speculation;
    `noise`: lognormal sigma of AR round times (drafting rounds get a quarter of it)."""
    cfgs = (("raw", sp.GovernorConfig(policy="off")), ("cost (default)", sp.GovernorConfig()))
    for cname in costs:
        costs_of = COSTS[cname]
        out = []
        for label, cfg in cfgs:
            rates = []
            for t in traces:
                gov = sp.governor.make_governor(cfg, "spec", sp.GREEDY, None)
                rates.append(governed_rate(t, gen, k, costs_of, gov, noise))
            out.append(f"{label} {' / '.join(f'{x:.2f}' for x in rates)}x AR")
        print(f"{cname} costs: " + "; ".join(out))


def governed_rate(t, gen, k, costs, gov, noise=0.0):
    verify, c = costs
    rng = np.random.default_rng(0)
    r, total, prev_hit, synced = 0, 0.0, False, 0
    while r < gen:
        kk = min(k, gen - r - 1)
        if kk > 0 and (gov is None or gov.drafting):
            total += (r - synced) * c          # catch-up of the tokens it missed
            prop = [int(x) for x in t["toks"][r, :kk]]
            n = 0
            while n < kk and prop[n] == t["tgt"][r, n]:
                n += 1
            cost = verify[kk + 1] + (0.0 if prev_hit else (kk + 1) * c)
            prev_hit, m = n == kk and t["toks"][r, kk] == t["tgt"][r, kk], kk
        else:
            n, m, cost, prev_hit = 0, 0, 1.0, False
        sigma = noise if m == 0 else noise / 4
        cost *= float(np.exp(sigma * rng.standard_normal() - sigma * sigma / 2))
        total += cost
        if gov is not None:
            gov.round(n, m, cost)
        r += n + 1
        synced = r if m else synced
    return gen / total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--data", default="data/corpus")
    ap.add_argument("--texts", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--save", default="")
    ap.add_argument("--load", default="")
    ap.add_argument("--costs", default="quiet,busy", help=f"cost curves among {', '.join(COSTS)}")
    ap.add_argument("--noise", type=float, default=0.0, help="lognormal sigma of AR round times")
    a = ap.parse_args(argv)
    costs = [c for c in a.costs.split(",") if c]
    if any(c not in COSTS for c in costs):
        ap.error(f"--costs {a.costs!r}: expected names among {', '.join(COSTS)}")
    if a.load:
        z = np.load(a.load)
        traces = [{f: z[f"{i}_{f}"] for f in FIELDS} for i in range(int(z["texts"]))]
    else:
        ck = load_checkpoint(a.checkpoint)
        cfg = ck.cfg
        tok_path = os.path.join(ck.source, "tokenizer.model") if os.path.isdir(ck.source) else None
        tok = load_tokenizer(cfg.vocab, tok_path if tok_path and os.path.exists(tok_path) else None)
        model = SpelModel.from_weights(cfg, ck.weights)
        traces = [record(model, ck.weights, cfg, [t % cfg.vocab for t in p], a.gen + STEPS)
                  for p in heldout_prompts(tok, a.data, a.texts, a.prompt)]
        if a.save:
            np.savez(a.save, texts=len(traces), **{f"{i}_{f}": t[f] for i, t in enumerate(traces) for f in FIELDS})
    rules_table(traces, a.gen, costs)
    governor_table(traces, a.gen, costs, a.noise)
    return 0


if __name__ == "__main__":
    sys.exit(main())
