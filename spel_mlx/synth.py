"""Write a random SPELW001 model with a golden footer.

    python -m spel_mlx synth --preset 21m|218m [--config k=v,...] --seed N --out FILE [--force]

Tensors are generated and written one at a time (each from its own generator
seeded by (seed, tensor index), so the output depends only on seed and config),
then the golden logits are computed from a memory map of the just-written temp
file and appended; the file is renamed into place only when complete.  The 218m
model therefore never exists twice in memory.

Scales: linear maps N(0, 1/sqrt(fan_in)), embedding N(0, 1), norms 1, conv taps
around (0.1, 0.2, 0.7), decay logits U(2.2, 4.6) (a = sigmoid in ~[0.9, 0.99]),
beta logits U(-0.5, 0.5) (beta ~ 0.5).
"""
from __future__ import annotations

import math
import os
import sys

import numpy as np

from .config import ModelConfig
from .layout import TensorSpec, tensor_specs
from .checkpoints import Golden, Progress, SpelwWriter, read_spelw


def synth_tensor(spec: TensorSpec, seed: int, index: int) -> np.ndarray:
    """Tensor ``index`` of the layout, drawn from its own seeded generator."""
    rng = np.random.default_rng([seed, index])
    name, shape = spec.name, spec.shape
    if name == "tok_emb.weight":
        return rng.standard_normal(shape, dtype=np.float32)
    if name.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    if name.endswith("mixer.conv"):
        taps = np.array([0.1, 0.2, 0.7], np.float32)[:, None]
        return (taps + np.float32(0.2) * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    if name.endswith("decay_logit"):
        return rng.uniform(2.2, 4.6, shape).astype(np.float32)
    if name.endswith("beta_logit"):
        return rng.uniform(-0.5, 0.5, shape).astype(np.float32)
    w = rng.standard_normal(shape, dtype=np.float32)  # [out, in] linear map
    w *= np.float32(1.0 / math.sqrt(shape[1]))
    return w


def write_synth(out, cfg: ModelConfig, seed: int, n_golden: int = 16, draft: str = "auto",
                progress: bool = True, golden: bool = True, target: str = "mlx") -> dict:
    """Generate, write and golden-stamp a random model; returns a summary dict."""
    from .golden import compute_golden, golden_backends, golden_tokens

    specs = tensor_specs(cfg)
    prog = Progress(f"synth {os.path.basename(out)}", sum(s.nbytes for s in specs) + 64, enabled=progress)
    with SpelwWriter(out, cfg, progress=prog) as w:
        for i, s in enumerate(specs):
            w.write_tensor(s.name, synth_tensor(s, seed, i))
        prog.close()          # the tensors are the bytes counted; the golden footer follows
        if not golden:
            return {"golden": None}
        w.flush_tensors()
        written = read_spelw(w.tmp_path)  # header (flags 0) + tensors: a valid file already
        tokens = golden_tokens(cfg, seed, n_golden)
        if progress:
            sys.stderr.write(f"synth: computing golden logits for {n_golden} tokens\n")
        # the MLX model copies tensor by tensor; dropping each tensor's mapped pages
        # once copied keeps the 218m run at about one model in RAM
        target_l, draft_l = compute_golden(cfg, written.page_dropping_tensors(), tokens, draft=draft,
                                           target=target, between=lambda: written.release(0, written.file_size))
        del written
        w.write_golden(Golden(tokens, target_l, draft_l))
    return {"golden": golden_backends(), "tokens": tokens}


if __name__ == "__main__":       # python -m spel_mlx.synth: the synth command
    from .cli.synth import main
    sys.exit(main())
