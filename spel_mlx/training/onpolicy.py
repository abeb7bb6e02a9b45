"""On-policy distillation data: windows of the target's own continuations."""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from .. import layout
from ..atomic import save_npy
from .config import TrainError
from .data import load_tokens
from .runs import load_start, start_tokenizer

# how the sampled rows are drawn: "t0.8" (the first rounds' windows: T 0.8, top-p
# 0.95, one seed for every row) or "defaults" (as `generate` samples by default:
# T 0.7, top-p 0.95, repetition penalty 1.1; a seed per row)
SAMPLINGS = ("t0.8", "defaults")


def _sampling_params(sampling: str, seed: int):
    from ..decoding import sampling as smp
    if sampling == "t0.8":
        return smp.SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
    if sampling == "defaults":
        from ..api import DEFAULT_REPETITION_PENALTY, DEFAULT_TEMPERATURE, DEFAULT_TOP_P
        return smp.SamplingParams(temperature=DEFAULT_TEMPERATURE, top_p=DEFAULT_TOP_P,
                                  repetition_penalty=DEFAULT_REPETITION_PENALTY, seed=seed)
    raise TrainError(f"--sampling {sampling!r}: expected one of {', '.join(SAMPLINGS)}")


def generate_onpolicy(target_run: str, out_path: str, minutes: float, data_dir: str = "data/corpus",
                      tokenizer_path: str = "", seq: int = 256, prompt_len: int = 64, seed: int = 0,
                      max_rows: int = 0, quiet: bool = False, sampling: str = "t0.8",
                      greedy_share: float = 0.5) -> dict:
    """Target-generated training windows for the draft (on-policy distillation data).

    Each row is prompt_len tokens of training text followed by the target's own
    continuation (seq + 1 tokens in all): a `greedy_share` of the rows greedy (what
    greedy speculative decoding verifies; 0.5: the even rows), the others sampled as
    `sampling` says (SAMPLINGS).  The draft then learns the target where the target's
    own decoding takes it.  `target_run`: a run directory or an exported model.
    Rows are written as int32 [n, seq+1] (.npy, atomically) when time is up."""
    from ..decoding import SpeculativeDecoder
    from ..model import SpelModel
    from ..tokenizer import load_tokenizer
    if not 0.0 <= greedy_share <= 1.0:
        raise TrainError(f"--greedy-share {greedy_share:g}: must be in [0, 1]")
    params_s = _sampling_params(sampling, seed)
    _, cfg, params = load_start(target_run)
    tok = load_tokenizer(cfg.vocab, tokenizer_path or start_tokenizer(target_run) or None)
    train_tok = load_tokens(data_dir, tok, "train")
    names = [sp.name for sp in layout.tensor_specs(cfg)]
    model = SpelModel.from_weights(cfg, {n: params[n] for n in names})
    greedy = SpeculativeDecoder(model, None, "ar")
    sampled = SpeculativeDecoder(model, None, "ar", params=params_s)
    rng = np.random.default_rng([seed, 7])
    rows, t0, n_gen = [], time.time(), seq + 1 - prompt_len
    while time.time() - t0 < minutes * 60 and (not max_rows or len(rows) < max_rows):
        s = int(rng.integers(0, len(train_tok) - prompt_len))
        prompt = [int(t) for t in train_tok[s:s + prompt_len]]
        if (len(rows) * greedy_share) % 1 < greedy_share:
            dec = greedy
        else:
            dec = sampled
            if sampling == "defaults":   # the noise stream is indexed by position: a row's own seed
                dec.params = replace(params_s, seed=int(rng.integers(0, 2 ** 62)))
        out = dec.generate(prompt, n_gen)
        rows.append(prompt + out + [0] * (n_gen - len(out)))
        if not quiet and len(rows) % 20 == 0:
            el = time.time() - t0
            print(f"[onpolicy] {len(rows)} rows, {len(rows) * n_gen:,} generated tokens, "
                  f"{len(rows) * n_gen / el:.0f} tok/s, {el / 60:.1f}/{minutes:g} min", flush=True)
    arr = np.asarray(rows, dtype=np.int32).reshape(-1, seq + 1)
    save_npy(out_path, arr)
    return {"rows": int(arr.shape[0]), "generated_tokens": int(arr.shape[0] * n_gen),
            "seconds": round(time.time() - t0, 1), "path": out_path, "sampling": sampling,
            "greedy_share": greedy_share}
