"""Export a run: a SPELW001 file and a safetensors model folder with its tokenizer."""
from __future__ import annotations

import os
import shutil

import numpy as np

from .. import layout
from .config import TrainError
from .data import load_tokens
from .runs import load_checkpoint_dir, replace_dir


def golden_tokens_from_heldout(data_dir: str, tokenizer, n: int = 16) -> np.ndarray:
    """The first n tokens of the held-out text: the golden footer feeds real prose."""
    held = load_tokens(data_dir, tokenizer, "heldout")
    return np.asarray(held[:n], dtype=np.uint32)


def snap_draft(weights: dict) -> dict:
    """The weights with each quantized draft matrix replaced by its deployed form
    (quant.snap: the values the C draft computes with, on their own grid), so the
    exported draft is exactly the draft that runs and packs without loss."""
    from ..quant import snap
    return {n: (snap(w, layout.draft_quant(n))[0] if layout.draft_quant(n) else w) for n, w in weights.items()}


def export_run(run: str, out_dir: str, dtype: str = "float16", tokenizer_path: str = "",
               data_dir: str = "data/corpus", spelw_path: str = "", pack_draft: bool = True) -> str:
    """Export a run's checkpoint: a SPELW001 file (FP32, the draft snapped to its
    quantization grid, golden footer on held-out tokens) and a safetensors model folder
    in ``dtype`` made from it by spel_mlx.convert (golden logits recomputed for the
    rounded weights; ``pack_draft``: the draft's quantized matrices as codes and
    scales), plus the tokenizer (``tokenizer_path``, else the one the run was trained
    with, else the shipped one). Returns the folder."""
    from ..tokenizer import DEFAULT_SP_MODEL, load_tokenizer
    from ..golden import compute_golden
    from ..checkpoints import Golden, write_spelw
    from ..convert import convert
    state, cfg, params, _, _ = load_checkpoint_dir(run)
    names = [s.name for s in layout.tensor_specs(cfg)]
    missing = [n for n in names if n not in params]
    if missing:
        raise TrainError(f"{run}: checkpoint lacks {missing[0]} (and {len(missing) - 1} more)")
    weights = snap_draft({n: np.array(params[n], dtype=np.float32) for n in names})
    # the tokenizer the run was trained with, where it still exists
    trained_with = state.get("train", {}).get("tokenizer", "")
    tok_path = tokenizer_path or (trained_with if trained_with and os.path.isfile(trained_with) else DEFAULT_SP_MODEL)
    tok = load_tokenizer(cfg.vocab, None if cfg.vocab == 128 else tok_path)
    gt = golden_tokens_from_heldout(data_dir, tok)
    tl, dl = compute_golden(cfg, weights, gt)
    spelw_path = spelw_path or os.path.join(run, "model.spelw")
    write_spelw(spelw_path, cfg, weights, Golden(gt, tl, dl))
    code = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}[dtype]
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    convert(spelw_path, tmp, code, progress=False, pack_draft=pack_draft)
    if cfg.vocab != 128:
        shutil.copyfile(tok_path, os.path.join(tmp, "tokenizer.model"))
    replace_dir(tmp, out_dir.rstrip("/"))
    return out_dir
