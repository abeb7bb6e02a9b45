"""The draft stored as it is deployed: each quantized matrix as its codes and row scales.

SPEC 3 quantizes the draft's projections to q8 and its MLP to ternary at load.  A draft
whose float32 weights already are their own quantization (``spel_mlx.quant.snap``) is
stored losslessly as those codes: a q8 matrix NAME as ``NAME.q8`` (I8 [R, C]) and
``NAME.scale`` (F32 [R]), a ternary one as ``NAME.ternary`` (U8 [R, ceil(C/64)*16], SPEC
3's canonical 2-bit packing) and ``NAME.scale``: a quarter (q8) or a sixteenth (ternary)
of the FP32 bytes.  Reading gives back dequantize(codes, scales), bit for bit the
weights they were made from, so SPELW001 -> packed folder -> SPELW001 stays byte-identical.
Weights that are not on their grid are refused, never rounded silently.
"""
from __future__ import annotations

import numpy as np

from spel_mlx import quant
from spel_mlx.checkpoints.rules import CheckpointError
from spel_mlx.layout import draft_quant

SCALE = ".scale"
CODES = {"q8": ".q8", "ternary": ".ternary"}
META_DRAFT = "spel.draft"          # __metadata__: "packed" when the draft is stored so


def stored_names(name: str) -> tuple:
    """The tensors that hold `name` packed (its codes, its scales), or () when it is not
    a quantized draft matrix."""
    scheme = draft_quant(name)
    return () if scheme is None else (name + CODES[scheme], name + SCALE)


def entries(name: str, shape: tuple, weights, where: str) -> list:
    """The safetensors entries (name, dtype, shape, get) of quantized draft matrix `name`."""
    scheme = draft_quant(name)
    w = np.asarray(weights, dtype=np.float32)
    if not quant.on_grid(w, scheme):
        raise CheckpointError(where, f"tensor {name}: not on its {scheme} grid, so packing it would change "
                              "it (export a trained run, which snaps the draft, or keep the draft as floats)",
                              field=name)
    q, s = quant.QUANTIZERS[scheme](w)
    codes = q if scheme == "q8" else quant.pack_ternary(q)
    dtype = "I8" if scheme == "q8" else "U8"
    return [(name + CODES[scheme], dtype, codes.shape, lambda c=codes: c),
            (name + SCALE, "F32", (shape[0],), lambda s=s: s)]


def check(name: str, shape: tuple, ents: dict, path: str) -> None:
    """The packed pair of `name` is present, of the right dtypes and shapes, and its
    codes are codes (ternary: no code 2; q8: no -128)."""
    codes_name, scale_name = stored_names(name)
    scheme = draft_quant(name)
    rows, cols = shape
    want = {codes_name: ("I8" if scheme == "q8" else "U8",
                         (rows, cols) if scheme == "q8" else (rows, quant.packed_row_bytes(cols))),
            scale_name: ("F32", (rows,))}
    for n, (dtype, shp) in want.items():
        e = ents.get(n)
        if e is None:
            raise CheckpointError(path, f"packed draft: {n} missing (the stored form of {name})", offset=8, field=n)
        if e.dtype != dtype or tuple(e.shape) != shp:
            raise CheckpointError(e.file.path, f"tensor {n}: {e.dtype} {list(e.shape)}, expected {dtype} {list(shp)}",
                                  offset=e.start, field=n)
    codes = ents[codes_name].file.raw(codes_name)
    bad = (codes == -128) if scheme == "q8" else np.any(
        np.stack([(codes >> (2 * k)) & 3 for k in range(4)]) == 2, axis=0)
    if np.any(bad):
        e = ents[codes_name]
        r = int(np.argwhere(bad)[0][0])
        raise CheckpointError(e.file.path, f"tensor {codes_name}: row {r} holds a code outside SPEC 3's "
                              f"{scheme} codes", offset=e.start, field=codes_name)
    scales = ents[scale_name].file.raw(scale_name)
    if not np.all(np.isfinite(scales)) or np.any(scales < 0):
        e = ents[scale_name]
        raise CheckpointError(e.file.path, f"tensor {scale_name}: scales must be finite and >= 0",
                              offset=e.start, field=scale_name)


def read(name: str, shape: tuple, ents: dict) -> np.ndarray:
    """float32 [R, C]: dequantize(codes, scales) of packed matrix `name`."""
    codes_name, scale_name = stored_names(name)
    codes = ents[codes_name].file.raw(codes_name)
    q = codes if draft_quant(name) == "q8" else quant.unpack_ternary(codes, shape[1])
    return quant.dequantize(q, np.asarray(ents[scale_name].file.raw(scale_name), dtype=np.float32))
