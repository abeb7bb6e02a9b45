"""Numpy reference quantizers and GEMVs (SPEC 3); the C draft must match them bit for bit.

Rounding is IEEE round-half-to-even everywhere (``np.rint`` here, ``rintf`` /
``vrndnq_f32`` / ``_mm256_round_ps`` in C): it is the hardware default on every
target, so the numpy and C quantizers agree exactly.  All divisions are single
float32 divisions (no reciprocal multiply).  Sums that define a scale are
accumulated in float64 strictly left to right (``np.cumsum`` is sequential,
``np.sum`` is pairwise and is therefore NOT used for them), then rounded to float32.

Packed ternary: 2-bit codes, 4 weights per byte, low bits first, code 0 -> 0,
1 -> +1, 3 -> -1, 2 -> 0; each row padded with code 0 to a multiple of 64 weights,
so a row takes ``ceil(C/64)*16`` bytes.
"""
from __future__ import annotations

import numpy as np

PAD_WEIGHTS = 64                      # padding unit of a packed ternary row
ROW_BYTES_PER_PAD = PAD_WEIGHTS // 4  # 16 bytes per 64 weights
TERNARY_REFINEMENTS = 3
_DECODE = np.array([0, 1, 0, -1], dtype=np.int8)  # code -> weight (code 2 decodes as 0)


def _f32_2d(w) -> np.ndarray:
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight matrix, got shape {w.shape}")
    return w


def _seq_sum(a: np.ndarray) -> np.ndarray:
    """Row sums in float64, strictly left to right (matches the C loop)."""
    if a.shape[1] == 0:
        return np.zeros(a.shape[0], dtype=np.float64)
    return np.cumsum(a.astype(np.float64), axis=1)[:, -1]


def _safe_div(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """w / s per row in float32; rows with s == 0 give 0 (their weights are all 0)."""
    s_col = s[:, None]
    out = np.zeros_like(w)
    np.divide(w, s_col, out=out, where=(s_col != 0))
    return out


def quantize_q8(w) -> tuple:
    """Per output row: s = max|w| / 127, q = rint(w / s) in [-127, 127]."""
    w = _f32_2d(w)
    amax = np.abs(w).max(axis=1) if w.shape[1] else np.zeros(w.shape[0], np.float32)
    s = (amax.astype(np.float32) / np.float32(127.0)).astype(np.float32)
    q = np.clip(np.rint(_safe_div(w, s)), -127, 127).astype(np.int8)
    return q, s


def quantize_ternary(w, refinements: int = TERNARY_REFINEMENTS) -> tuple:
    """Per output row: s = mean|w|; `refinements` least-squares steps
    (q = clip(rint(w/s), -1, 1); s = <w,q>/<q,q>, old s kept when <q,q> = 0);
    the final q is recomputed with the final s."""
    w = _f32_2d(w)
    rows, cols = w.shape
    if cols == 0:
        return np.zeros((rows, 0), np.int8), np.zeros(rows, np.float32)
    s = (_seq_sum(np.abs(w)) / cols).astype(np.float32)
    for _ in range(refinements):
        q = np.clip(np.rint(_safe_div(w, s)), -1, 1)
        wq = _seq_sum(w * q)              # w*q is exactly +-w or 0
        qq = np.abs(q).sum(axis=1)        # integer count, exact
        np.divide(wq, qq, out=wq, where=qq > 0)
        s = np.where(qq > 0, wq.astype(np.float32), s).astype(np.float32)
    q = np.clip(np.rint(_safe_div(w, s)), -1, 1).astype(np.int8)
    return q, s


def packed_row_bytes(cols: int) -> int:
    return (cols + PAD_WEIGHTS - 1) // PAD_WEIGHTS * ROW_BYTES_PER_PAD


def pack_ternary(t) -> np.ndarray:
    """int8 {-1,0,1} [R, C] -> uint8 [R, ceil(C/64)*16], low bits first."""
    t = np.asarray(t)
    if t.ndim != 2:
        raise ValueError(f"expected a 2-D ternary matrix, got shape {t.shape}")
    if t.size and (t.min() < -1 or t.max() > 1):
        raise ValueError("ternary values must be in {-1, 0, 1}")
    rows, cols = t.shape
    padded = np.zeros((rows, packed_row_bytes(cols) * 4), dtype=np.uint8)
    codes = np.where(t > 0, 1, np.where(t < 0, 3, 0)).astype(np.uint8)
    padded[:, :cols] = codes
    c = padded.reshape(rows, -1, 4)
    return (c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)).astype(np.uint8)


def unpack_ternary(packed, cols: int) -> np.ndarray:
    """uint8 [R, nbytes] -> int8 [R, cols] (code 2 decodes as 0)."""
    packed = np.asarray(packed, dtype=np.uint8)
    if packed.ndim != 2 or packed.shape[1] * 4 < cols:
        raise ValueError(f"packed shape {packed.shape} cannot hold {cols} columns")
    codes = np.stack([(packed >> (2 * k)) & 3 for k in range(4)], axis=-1).reshape(packed.shape[0], -1)
    return _DECODE[codes[:, :cols]]


def quantize_activation(x) -> tuple:
    """Per vector: s_x = max|x| / 127, x_q = rint(x / s_x) in [-127, 127]; zeros stay zeros.
    Accepts [n] or [M, n] (each row its own vector)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 1:
        q, s = quantize_q8(x[None, :])
        return q[0], np.float32(s[0])
    return quantize_q8(x)


def dot_q8_int(q: np.ndarray, xq: np.ndarray) -> np.ndarray:
    """Exact int32 row dot products."""
    return (q.astype(np.int32) @ xq.astype(np.int32)).astype(np.int32)


def _scale(s_rows, sx, acc) -> np.ndarray:
    # Same association as the C code: (s_r * s_x) * float(acc), all float32.
    return ((s_rows.astype(np.float32) * np.float32(sx)) * acc.astype(np.float32)).astype(np.float32)


def gemv_q8_ref(q, s, x) -> np.ndarray:
    """y = s_r * s_x * sum_j q_rj x_qj, activation quantized per vector."""
    xq, sx = quantize_activation(x)
    return _scale(s, sx, dot_q8_int(q, xq))


def gemv_ternary_ref(t_or_packed, s, x, cols: int | None = None) -> np.ndarray:
    """Ternary GEMV from unpacked int8 {-1,0,1} [R,C] or packed uint8 (pass cols)."""
    t = t_or_packed
    if t.dtype == np.uint8:
        t = unpack_ternary(t, len(x) if cols is None else cols)
    xq, sx = quantize_activation(x)
    return _scale(s, sx, dot_q8_int(t, xq))


def dequantize(q, s) -> np.ndarray:
    return (q.astype(np.float32) * s[:, None]).astype(np.float32)


QUANTIZERS = {"q8": quantize_q8, "ternary": quantize_ternary}


def snap(w, scheme: str, max_steps: int = 8) -> tuple:
    """(v, q, s): the weights the deployed draft uses, as float32 values on their own grid:
    v = dequantize(q, s) with quantize(v) == (q, s) exactly, so the draft stored as v (or
    as q and s) quantizes at load to the same codes and scales, and q and s are recovered
    from v without loss.  Ternary rows land there in one step; a q8 scale
    s' = fl(fl(127 s) / 127) can move by an ulp, so it is iterated to its fixed point."""
    quantize = QUANTIZERS[scheme]
    q, s = quantize(w)
    for _ in range(max_steps):
        v = dequantize(q, s)
        q2, s2 = quantize(v)
        if np.array_equal(q2, q) and np.array_equal(s2.view(np.uint32), s.view(np.uint32)):
            return v, q, s
        q, s = q2, s2
    raise ValueError(f"{scheme} weights did not reach a fixed point in {max_steps} steps")


def on_grid(v, scheme: str) -> bool:
    """Whether float32 weights are their own quantization (what ``snap`` returns)."""
    v = _f32_2d(v)
    q, s = QUANTIZERS[scheme](v)
    return np.array_equal(dequantize(q, s).view(np.uint32), v.view(np.uint32))
