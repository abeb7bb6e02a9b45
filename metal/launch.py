"""Launch plans of the kernels: grid, threadgroup, template and output shapes,
identical for the Metal and the emulated executor (docs/metal.md)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KernelDef:
    name: str       # metal/<name>.metal holds the body
    inputs: tuple
    outputs: tuple


KERNELS = {
    k.name: k for k in (
        KernelDef("gdn_conv", ("x", "tail", "conv"), ("u", "tails")),
        KernelDef("gdn_delta", ("q", "k", "v", "decay", "beta", "s0"), ("o", "s_all")),
        KernelDef("attn_verify", ("q", "k_cache", "v_cache", "pos0", "inv_freq"), ("o",)),
        KernelDef("tern_act_quant", ("x", "cp"), ("xq", "sx")),
        KernelDef("tern_gemv", ("w", "ws", "xq", "sx"), ("y",)),
        KernelDef("q8_gemv", ("w", "ws", "xq", "sx"), ("y",)),
    )
}
ATTN_THREADS = 128          # attn_verify's NT
ATTN_QUERY_TILE = 8         # attn_verify's QT: queries per threadgroup
DELTA_ROWS_PER_GROUP = 4    # gdn_delta threadgroup (32, 4, 1)
GEMV_ROWS_PER_SIMD = 2      # tern_gemv's RPS
GEMV_SIMD_PER_GROUP = 4


def supports(kind: str, head_dim: int) -> bool:
    """Shapes the kernels handle ("attend", "delta"); others fall back to MLX ops."""
    return head_dim in (32, 64, 128) if kind in ("attend", "delta") else True


@dataclass
class Launch:
    kernel: str
    inputs: list
    template: list
    grid: tuple
    threadgroup: tuple
    output_shapes: list
    output_dtypes: list   # numpy dtypes


def ceil_to(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def plan_conv(x, tail, conv) -> Launch:
    M, d = x.shape
    tg = 64
    return Launch("gdn_conv", [x, tail, conv], [], (ceil_to(d, tg), 1, 1), (tg, 1, 1),
                  [(M, d), (M, 2, d)], [np.float32, np.float32])


def plan_delta(q, k, v, decay, beta, s0, fused: bool) -> Launch:
    M, H, hd = q.shape
    return Launch("gdn_delta", [q, k, v, decay, beta, s0], [("HD", hd), ("FUSED", int(fused))],
                  (32, hd, H), (32, DELTA_ROWS_PER_GROUP, 1),
                  [(M, H, hd), (M, H, hd, hd)], [np.float32, np.float32])


def plan_attend(q, k_cache, v_cache, pos0, inv_freq, rope_q: bool) -> Launch:
    M, H, hd = q.shape
    return Launch("attn_verify", [q, k_cache, v_cache, pos0, inv_freq],
                  [("HD", hd), ("ROPE_Q", int(rope_q))],
                  (ATTN_THREADS, ceil_to(M, ATTN_QUERY_TILE) // ATTN_QUERY_TILE, H), (ATTN_THREADS, 1, 1),
                  [(M, H, hd)], [np.float32])


def plan_act_quant(x, cp_scalar, cp: int) -> Launch:
    N = x.shape[0]
    return Launch("tern_act_quant", [x, cp_scalar], [], (256, N, 1), (256, 1, 1),
                  [(N, cp), (N,)], [np.int8, np.float32])


def plan_gemv(w, ws, xq, sx, kernel="tern_gemv") -> Launch:
    R = w.shape[0]
    N = xq.shape[0]
    nv = 1 if N == 1 else 4
    groups = (R + GEMV_ROWS_PER_SIMD - 1) // GEMV_ROWS_PER_SIMD
    return Launch(kernel, [w, ws, xq, sx], [("NV", nv)],
                  (32, ceil_to(groups, GEMV_SIMD_PER_GROUP), (N + nv - 1) // nv),
                  (32, GEMV_SIMD_PER_GROUP, 1), [(N, R)], [np.float32])


def rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """theta^(-2i/hd), i < hd/2, in float32 (computed in float64 then rounded)."""
    i = np.arange(head_dim // 2, dtype=np.float64)
    return (float(theta) ** (-2.0 * i / head_dim)).astype(np.float32)
