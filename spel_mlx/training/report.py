"""Quality report of an exported model: held-out loss (nats/token, bits/byte) of
the target and of the quantized draft, target/draft top-1 agreement, KL and
distribution overlap at T 0.7 (teacher-forced), greedy and sampled speculative
acceptance alpha at K on held-out prompts (the real C draft through ``spel_mlx.generate``), and
sample continuations.

    python -m spel_mlx train-report [--model spel_mlx/assets/default] [--data data/corpus]
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile

import mlx.core as mx
import numpy as np

from .data import eval_windows
from .steps import kl_target_draft

SAMPLED_T = 0.7   # generate's default temperature: the tempered figures of heldout_eval
SAMPLE_PROMPTS = ("It is a truth universally acknowledged, that",
                  "And God said unto Moses,",
                  "Elizabeth was")


def heldout_eval(ckpt_path: str, data_dir: str, seq: int = 256, max_tokens: int = 0, chunk: int = 64) -> dict:
    from ..reader import load_checkpoint
    from ..model import SpelModel
    from ..tokenizer import encode_documents, load_tokenizer
    ck = load_checkpoint(ckpt_path)
    cfg = ck.cfg
    tok_path = os.path.join(ckpt_path, "tokenizer.model") if os.path.isdir(ckpt_path) else None
    tok = load_tokenizer(cfg.vocab, tok_path if tok_path and os.path.exists(tok_path) else None)
    text = open(os.path.join(data_dir, "heldout.txt"), encoding="utf-8").read()
    ids = np.asarray(encode_documents(tok, text), dtype=np.int32)
    x, y = eval_windows(ids, seq, max_tokens or len(ids))
    n = len(x)
    model = SpelModel.from_weights(cfg, ck.weights)

    @mx.compile
    def ev(xb, yb):
        tl = model.batch_logits(xb, "target", chunk=chunk)
        dl = model.batch_logits(xb, "draft", fake_quant=True, chunk=chunk)
        tls = tl - mx.logsumexp(tl, axis=-1, keepdims=True)
        dls = dl - mx.logsumexp(dl, axis=-1, keepdims=True)
        t_nll = -mx.sum(mx.take_along_axis(tls, yb[..., None], axis=-1))
        d_nll = -mx.sum(mx.take_along_axis(dls, yb[..., None], axis=-1))
        kl = mx.sum(mx.exp(tls) * (tls - dls))
        agree = mx.sum(mx.argmax(tl, axis=-1) == mx.argmax(dl, axis=-1))
        n = tl.shape[0] * tl.shape[1]
        kl_t = kl_target_draft(tl, dl, SAMPLED_T) * n
        # sum_x min(p_T, q_T): the residual rule's acceptance without top-p and penalty
        overlap = mx.sum(mx.minimum(mx.softmax(tl / SAMPLED_T, axis=-1), mx.softmax(dl / SAMPLED_T, axis=-1)))
        return t_nll, d_nll, kl, agree, kl_t, overlap

    tot = np.zeros(6)
    for i in range(0, n, 4):
        r = ev(mx.array(x[i:i + 4]), mx.array(y[i:i + 4]))
        mx.eval(*r)
        tot += [float(v.item()) for v in r]
    ntok = x.size
    nbytes = len(tok.decode(y.reshape(-1).tolist()).encode("utf-8"))
    return {"heldout_tokens": int(ntok), "heldout_bytes": int(nbytes), "seq": seq,
            "target_nats_per_token": tot[0] / ntok, "target_bits_per_byte": tot[0] / math.log(2) / nbytes,
            "draft_nats_per_token": tot[1] / ntok, "draft_bits_per_byte": tot[1] / math.log(2) / nbytes,
            "kl_target_draft": tot[2] / ntok, "top1_agreement": tot[3] / ntok,
            f"kl_target_draft_t{SAMPLED_T:g}": tot[4] / ntok, f"overlap_t{SAMPLED_T:g}": tot[5] / ntok,
            "stored_dtype": ck.stored_dtype}


def _generate(args: list) -> tuple:
    cmd = [sys.executable, "-m", "spel_mlx.generate", "--no-stream", "--stats", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    stats = {}
    for line in r.stderr.splitlines()[::-1]:
        if line.startswith("{"):
            try:
                stats = json.loads(line)
                break
            except ValueError:
                pass
    if r.returncode != 0:
        raise RuntimeError(f"generate failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    return r.stdout, stats


def alpha_on_heldout(ckpt_path: str, data_dir: str, n_prompts: int = 8, prompt_chars: int = 400,
                     max_tokens: int = 64, k: int = 4, draft: str = "c", sampled: bool = False) -> dict:
    """Speculative decoding from held-out prompts, every round drafting; alpha =
    accepted / proposed.  Greedy, or (`sampled`) with generate's default sampling
    (T 0.7, top-p 0.95, repetition penalty 1.1, the coupled rule), a seed per prompt."""
    text = open(os.path.join(data_dir, "heldout.txt"), encoding="utf-8").read()
    lines = [l for l in text.split("\n") if len(l) > 40]
    step = max(1, len(lines) // n_prompts)
    acc = prop = 0
    per = []
    with tempfile.TemporaryDirectory() as td:
        for i in range(n_prompts):
            pf = os.path.join(td, f"p{i}.txt")
            with open(pf, "w") as f:
                f.write(lines[i * step][:prompt_chars])
            sampling = ["--seed", str(i)] if sampled else ["--temperature", "0"]
            _, st = _generate(["--checkpoint", ckpt_path, "--prompt-file", pf, "--mode", "spec",
                               "--governor", "off", *sampling, "--spec-k", str(k), "--draft", draft,
                               "--max-tokens", str(max_tokens)])
            a, p = _accept_counts(st)
            acc += a
            prop += p
            per.append(round(a / p, 4) if p else None)
    return {"alpha": acc / prop if prop else float("nan"), "accepted": acc, "proposed": prop,
            "per_prompt": per, "k": k, "draft": draft, "prompts": n_prompts, "max_tokens": max_tokens,
            "sampling": "defaults" if sampled else "greedy"}


def _accept_counts(st: dict) -> tuple:
    for a_key, p_key in (("accepted", "proposed"), ("draft_accepted", "draft_proposed")):
        if a_key in st and p_key in st:
            return int(st[a_key]), int(st[p_key])
    raise RuntimeError(f"generate --stats gave no accepted/proposed counts: {sorted(st)}")


def samples(ckpt_path: str, max_tokens: int = 80) -> list:
    out = []
    for i, prompt in enumerate(SAMPLE_PROMPTS):
        txt, st = _generate(["--checkpoint", ckpt_path, "--prompt", prompt, "--max-tokens", str(max_tokens),
                             "--seed", str(i)])
        out.append({"prompt": prompt, "settings": "defaults (sampling)", "text": txt.strip()})
    txt, _ = _generate(["--checkpoint", ckpt_path, "--prompt", SAMPLE_PROMPTS[0], "--max-tokens",
                        str(max_tokens), "--temperature", "0", "--repetition-penalty", "1.2"])
    out.append({"prompt": SAMPLE_PROMPTS[0], "settings": "greedy, repetition penalty 1.2", "text": txt.strip()})
    return out
