"""Weight layouts around the GEMV kernels: q8 rows padded for q8_gemv, and the
ternary rows in MLX's own 2-bit affine format (the baseline they are measured against)."""
from __future__ import annotations

import numpy as np

import mlx.core as mx

from .launch import ceil_to


def pad_q8_rows(q) -> np.ndarray:
    """q8 rows int8 [R, C] -> [R, ceil(C/64)*64] with zero columns (q8_gemv's layout)."""
    q = np.asarray(q, dtype=np.int8)
    cp = ceil_to(max(int(q.shape[1]), 1), 64)
    out = np.zeros((q.shape[0], cp), np.int8)
    out[:, :q.shape[1]] = q
    return out


def ternary_to_mlx_affine(packed: np.ndarray, scales: np.ndarray):
    """SPEC 3 packing -> (w uint32 [R, cp/16], scales [R, cp/64], biases [R, cp/64]) for
    ``mx.quantized_matmul(..., group_size=64, bits=2)``: codes {0, 1, 2} mean -s, 0, +s
    (scale s, bias -s), which represents the ternary rows exactly.  Both formats put 16
    codes in a little-endian 32-bit word, low bits first, so only the code values change:
    ours 0 -> 1, 1 -> 2, 3 -> 0, 2 -> 1."""
    packed = np.ascontiguousarray(packed, dtype=np.uint8)
    R, nbytes = packed.shape
    cp = nbytes * 4
    codes = np.stack([(packed >> (2 * i)) & 3 for i in range(4)], axis=-1).reshape(R, cp)
    remap = np.array([1, 2, 1, 0], dtype=np.uint8)[codes]
    b = remap.reshape(R, nbytes, 4)
    repacked = (b[..., 0] | (b[..., 1] << 2) | (b[..., 2] << 4) | (b[..., 3] << 6)).astype(np.uint8)
    s = np.asarray(scales, dtype=np.float32).reshape(R, 1)
    groups = cp // 64
    return (np.ascontiguousarray(repacked).view(np.uint32), np.repeat(s, groups, axis=1),
            np.repeat(-s, groups, axis=1))


def mlx_affine_ternary_matmul(x, w, scales, biases):
    """The baseline: MLX's built-in 2-bit affine quantized matmul (float activations)."""
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=64, bits=2)
