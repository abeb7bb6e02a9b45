"""The AR step against its bandwidth bound: what one core reads per second (``read_seconds``,
a streaming sum over a buffer far larger than the L3), the bytes of weights a single-token
step reads (the layouts the CPU products read: float16 blocks where the weights are exactly
binary16), and the measured AR rate, in one process.

    python bench/roofline.py [--model DIR|FILE] [--tokens 200] [--repeats 5] [--buffer-mb 1024]

roofline tok/s = bandwidth / bytes per token: the rate of a step bound by streaming its
weights from DRAM once.  A model whose weights fit the L3 can exceed it; one that streams
them should reach a large share of it (the issue's goal: 70%).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import spel_mlx  # noqa: F401  (BLAS before mlx.core)
import mlx.core as mx

from spel_mlx import _spel_cpu
from spel_mlx.decoding import SpeculativeDecoder
from spel_mlx.model import SpelModel
from spel_mlx.model.linear import Linear
from spel_mlx.reader import load_checkpoint


def read_bandwidth(buffer_mb: int, repeats: int) -> float:
    """Bytes per second one thread reads (the median of `repeats` sweeps of a fresh buffer)."""
    a = mx.ones((buffer_mb << 20) // 4, dtype=mx.float32)
    mx.eval(a)
    _spel_cpu.read_seconds(a)                      # pages in, caches settle
    secs = [_spel_cpu.read_seconds(a)[0] for _ in range(repeats)]
    return a.nbytes / statistics.median(secs)


def step_weight_bytes(model) -> int:
    """Bytes of the target's weight layouts a single-token step reads (the draft's are not)."""
    total = 0
    for name, m in model.named_modules():
        if isinstance(m, Linear) and not name.startswith("draft"):
            layouts = m.layouts()
            total += min(x.nbytes for x in layouts) if layouts else m.weight.nbytes
    return total + model.tok_emb.weight.shape[1] * 4   # one embedding row


def ar_rate(model, vocab: int, tokens: int, repeats: int) -> float:
    prompt = [int(t) for t in (i * 37 % vocab for i in range(32))]
    dec = SpeculativeDecoder(model, None, "ar")
    dec.generate(prompt, 16)                       # builds the passes
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dec.generate(prompt, tokens)
        rates.append(tokens / (time.perf_counter() - t0))
    return statistics.median(rates)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the shipped model)")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--buffer-mb", type=int, default=1024)
    ap.add_argument("--json", help="also write the figures here")
    a = ap.parse_args(argv)
    ck = load_checkpoint(a.model)
    model = SpelModel.from_weights(ck.cfg, ck.weights)
    ck.release_pages()
    rate = ar_rate(model, ck.cfg.vocab, a.tokens, a.repeats)
    nbytes = step_weight_bytes(model)
    bw = read_bandwidth(a.buffer_mb, a.repeats)
    roof = bw / nbytes
    out = {"checkpoint": ck.source, "weight_bytes_per_token": nbytes, "read_GB_s": round(bw / 1e9, 2),
           "roofline_tok_s": round(roof, 1), "ar_tok_s": round(rate, 1), "ar_over_roofline": round(rate / roof, 3)}
    print(f"| {ck.source} | {nbytes / 1e6:.1f} MB | {bw / 1e9:.1f} GB/s | {roof:.0f} | {rate:.0f} | "
          f"{rate / roof:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
