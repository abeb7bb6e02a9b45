"""On-policy distillation data: windows of the target's own continuations."""
from __future__ import annotations

import time

import numpy as np

from .. import layout
from ..atomic import save_npy
from .data import load_tokens
from .runs import load_checkpoint_dir


def generate_onpolicy(target_run: str, out_path: str, minutes: float, data_dir: str = "data/corpus",
                      tokenizer_path: str = "", seq: int = 256, prompt_len: int = 64, seed: int = 0,
                      max_rows: int = 0, quiet: bool = False) -> dict:
    """Target-generated training windows for the draft (on-policy distillation data).

    Each row is prompt_len tokens of training text followed by the target's own
    continuation (seq + 1 tokens in all): even rows greedy (what greedy
    speculative decoding verifies), odd rows sampled at temperature 0.8.  The
    draft then learns the target where the target's own decoding takes it.
    Rows are written as int32 [n, seq+1] (.npy, atomically) when time is up."""
    from ..decoding import SpeculativeDecoder
    from ..decoding import sampling as smp
    from ..model import SpelModel
    from ..tokenizer import load_tokenizer
    _, cfg, params, _, _ = load_checkpoint_dir(target_run)
    tok = load_tokenizer(cfg.vocab, tokenizer_path or None)
    train_tok = load_tokens(data_dir, tok, "train")
    names = [sp.name for sp in layout.tensor_specs(cfg)]
    model = SpelModel.from_weights(cfg, {n: params[n] for n in names})
    greedy = SpeculativeDecoder(model, None, "ar")
    sampled = SpeculativeDecoder(model, None, "ar",
                                 params=smp.SamplingParams(temperature=0.8, top_p=0.95, seed=seed))
    rng = np.random.default_rng([seed, 7])
    rows, t0, n_gen = [], time.time(), seq + 1 - prompt_len
    while time.time() - t0 < minutes * 60 and (not max_rows or len(rows) < max_rows):
        s = int(rng.integers(0, len(train_tok) - prompt_len))
        prompt = [int(t) for t in train_tok[s:s + prompt_len]]
        dec = greedy if len(rows) % 2 == 0 else sampled
        out = dec.generate(prompt, n_gen)
        rows.append(prompt + out + [0] * (n_gen - len(out)))
        if not quiet and len(rows) % 20 == 0:
            el = time.time() - t0
            print(f"[onpolicy] {len(rows)} rows, {len(rows) * n_gen:,} generated tokens, "
                  f"{len(rows) * n_gen / el:.0f} tok/s, {el / 60:.1f}/{minutes:g} min", flush=True)
    arr = np.asarray(rows, dtype=np.int32).reshape(-1, seq + 1)
    save_npy(out_path, arr)
    return {"rows": int(arr.shape[0]), "generated_tokens": int(arr.shape[0] * n_gen),
            "seconds": round(time.time() - t0, 1), "path": out_path}
