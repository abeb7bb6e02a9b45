"""Convert checkpoints between SPELW001 and a safetensors model folder.

    python -m spel_mlx convert SRC DST [--dtype f32|f16|bf16] [--pack-draft] [--force] [--quiet]

Direction by SRC: a folder or a ``.safetensors`` file -> DST is a SPELW001 file;
any other file (``.spelw``, ``.bin``, ...) is read as SPELW001 -> DST is a folder
(``model.safetensors`` + ``config.json``).  Streams tensor by tensor; output is
written to temp files and renamed, so a failure leaves nothing behind (and the temp
files of a killed conversion are removed by the next one to the same place).  DST
may not be, contain or lie inside SRC; an existing DST is replaced only with --force.
``--dtype f16|bf16`` (SPELW001 -> folder only) rounds the weights and recomputes
the golden logits for the rounded weights.  ``--pack-draft`` (SPELW001 -> folder) stores
the draft's q8 and ternary matrices as their codes and row scales (a quarter and a
sixteenth of the bytes), exactly: refused unless the draft is on its quantization grid, as
an exported model's is (converters/packed_draft.py).  Exit 2 on bad input, one line on stderr.
"""
from __future__ import annotations

import os
import sys

from .atomic import refuse_existing
from .config import ConfigError
from .checkpoints import CheckpointError, Progress


def direction(src: str) -> str:
    """'st2spelw' or 'spelw2st'."""
    if os.path.isdir(src) or (src.endswith(".safetensors") and not _starts_with_spelw(src)):
        return "st2spelw"
    return "spelw2st"


def _starts_with_spelw(path) -> bool:
    from .checkpoints import is_spelw
    return is_spelw(path)


def rounded_golden(src: str, dtype: str, progress: bool, pack_draft: bool = False):
    """Golden logits for the weights as they will be stored in ``dtype`` (a packed draft's
    quantized matrices stay exact)."""
    import numpy as np

    from .converters.safetensors_io import bf16_bits_to_f32, f32_to_bf16_bits
    from .golden import compute_golden
    from .checkpoints import Golden, read_spelw
    from .layout import draft_quant

    sp = read_spelw(src)
    if sp.golden is None:
        return None
    def stored(k, v):
        if pack_draft and draft_quant(k):
            return np.asarray(v)
        if dtype == "F16":
            return np.asarray(v).astype(np.float16).astype(np.float32)
        return bf16_bits_to_f32(f32_to_bf16_bits(np.asarray(v)))
    w = {k: stored(k, v) for k, v in sp.tensors.items()}
    if progress:
        sys.stderr.write(f"convert: recomputing golden logits for {dtype}-rounded weights\n")
    tl, dl = compute_golden(sp.cfg, w, sp.golden.tokens)
    return Golden(np.array(sp.golden.tokens), tl, dl)


def convert(src: str, dst: str, dtype: str = "F32", progress: bool = True, force: bool = False,
            pack_draft: bool = False) -> str:
    """Convert SRC into DST (direction by SRC).  Refuses a DST that is, contains or lies
    inside SRC, and one that already exists unless ``force``.  ``pack_draft`` (SPELW001
    -> folder): the draft's quantized matrices stored as codes and scales, exactly."""
    from .checkpoints.files import check_destination
    from .converters import safetensors_to_spelw, spelw_to_safetensors
    from .converters.spelw_safetensors import CONFIG_FILE, MODEL_FILE, SafetensorsModel, spelw_size

    if not os.path.exists(src):
        raise CheckpointError(src, "no such file or folder")
    if direction(src) == "st2spelw":
        if dtype != "F32" or pack_draft:
            raise ConfigError("--dtype and --pack-draft apply to SPELW001 -> safetensors only (SPELW001 stores FP32)")
        if os.path.isdir(dst):
            raise CheckpointError(dst, "destination is a folder; a SPELW001 file path is expected")
        st = SafetensorsModel(src)  # validated here, before anything is created
        check_destination(dst, [src, *st.source_paths], [dst])
        refuse_existing([dst], force)
        g = st.golden()
        total = spelw_size(st.cfg, g.n if g is not None else None)
        prog = Progress(f"convert {os.path.basename(os.path.normpath(src))} -> {os.path.basename(dst)}",
                        total, enabled=progress)
        del st, g
        try:
            safetensors_to_spelw(src, dst, progress=prog)
        finally:
            prog.close()
        return "safetensors -> SPELW001"
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise CheckpointError(dst, "destination is a file; a folder is expected for SPELW001 -> safetensors")
    outputs = [os.path.join(dst, MODEL_FILE), os.path.join(dst, CONFIG_FILE)]
    check_destination(dst, [src], outputs)
    refuse_existing(outputs, force)
    golden = rounded_golden(src, dtype, progress, pack_draft) if dtype != "F32" else None
    prog = Progress(f"convert {os.path.basename(src)} -> {os.path.basename(os.path.normpath(dst))}",
                    os.path.getsize(src), enabled=progress)
    try:
        spelw_to_safetensors(src, dst, dtype=dtype, progress=prog, golden=golden, pack_draft=pack_draft)
    finally:
        prog.close()      # a 16-bit copy writes fewer bytes than the file read: the bar ends here
    return f"SPELW001 -> safetensors ({dtype}{', draft packed' if pack_draft else ''})"


if __name__ == "__main__":       # python -m spel_mlx.convert: the convert command
    from .cli.convert import main
    sys.exit(main())
