"""The gated delta rule of SPEC 2 over a sequence: the recurrence and its chunked form.

Per head, S_t = a S_{t-1} + beta (v_t - S_{t-1} k_t) k_t^T and o_t = S_t q_t / sqrt(hd),
S rows indexing v and columns k.  Both functions take token-major q, k, v
[..., T, H, hd] (q, k unit vectors) and a, beta [H] (already sigmoided).
"""
from __future__ import annotations

import math

import mlx.core as mx


def delta_rule_recurrent(q, k, v, a, beta, S0):
    """One token at a time from S0 [..., H, hd, hd].  Returns o [..., T, H, hd] and
    the list of the T states after each token."""
    *lead, T, H, hd = q.shape
    a3 = a.reshape(H, 1, 1)
    b3 = beta.reshape(H, 1, 1)
    S = S0
    outs, states = [], []
    for t in range(T):
        kt = k[..., t:t + 1, :, :].reshape(*lead, H, hd, 1)               # column k_t
        err = b3 * (v[..., t:t + 1, :, :].reshape(*lead, H, hd, 1) - S @ kt)   # beta (v - S k)
        S = a3 * S + err * kt.reshape(*lead, H, 1, hd)                      # + outer(err, k)
        outs.append(S @ q[..., t:t + 1, :, :].reshape(*lead, H, hd, 1))
        states.append(S)
    if T == 1:
        return outs[0].reshape(*lead, 1, H, hd) * (1.0 / math.sqrt(hd)), states
    o = mx.moveaxis(mx.concatenate(outs, axis=-1), -1, -3) * (1.0 / math.sqrt(hd))
    return o, states


def chunk_gates(a, C: int) -> dict:
    """The decay factors of a chunk of C tokens (a [H]; t, s = 1..C within the chunk):
    G = a^(t-s) for s <= t, Gm = a^(t-1-s) for s < t (else 0), d_prev = a^(t-1),
    d_cur = a^t, d_end = a^(C-s), aC = a^C.  They depend on the weights only, so
    decoding computes them once per (weights, C) and a pass captures them."""
    H = a.shape[0]
    loga = mx.log(a).reshape(H, 1, 1, 1)
    t = mx.arange(1, C + 1, dtype=mx.float32)
    diff = t[:, None] - t[None, :]                                          # t - s
    return {"G": mx.where(diff >= 0, mx.exp(loga * mx.maximum(diff, 0)), 0.0),      # [H,1,C,C]
            "Gm": mx.where(diff > 0, mx.exp(loga * mx.maximum(diff - 1, 0)), 0.0),
            "d_prev": mx.exp(loga * (t - 1).reshape(C, 1)),                 # [H,1,C,1]
            "d_cur": mx.exp(loga * t.reshape(C, 1)),
            "d_end": mx.exp(loga * (C - t).reshape(C, 1)),
            "aC": mx.exp(loga * C).reshape(H, 1, 1)}


def unit_lower_inv_blocked(A):
    """The inverse of unit lower triangular A [..., C, C] by block doubling, in batched
    products only: with X the inverse of A's diagonal s-blocks and E the blocks just
    below them inside each 2s-block, the 2s-blocks' inverse is X - X E X.  MLX's
    triangular inverse runs only on the CPU; on a GPU this keeps the chunk there.
    C is padded to a power of two with the identity."""
    C = A.shape[-1]
    n = 1 << max(C - 1, 0).bit_length()
    if n != C:
        z = [(0, 0)] * (A.ndim - 2) + [(0, n - C), (0, n - C)]
        A = mx.pad(A, z) + mx.diag((mx.arange(n) >= C).astype(A.dtype))
    i = mx.arange(n)
    X = mx.broadcast_to(mx.eye(n, dtype=A.dtype), A.shape)
    s = 1
    while s < n:
        # E: rows in the lower half, columns in the upper half of the same 2s-block
        below = ((i[:, None] // (2 * s)) == (i[None, :] // (2 * s))) & \
            ((i[:, None] // s) % 2 == 1) & ((i[None, :] // s) % 2 == 0)
        X = X - X @ (A * below.astype(A.dtype)) @ X
        s *= 2
    return X[..., :C, :C]


@mx.custom_function
def _unit_lower_inv(A):
    if mx.default_device() == mx.cpu:
        return mx.linalg.tri_inv(A, upper=False, stream=mx.cpu)
    return unit_lower_inv_blocked(A)


@_unit_lower_inv.vjp
def _unit_lower_inv_vjp(primals, cotangent, output):
    # d(A^-1) = -A^-1 dA A^-1, so dL/dA = -A^-T G A^-T (only the strict lower part is used)
    Tt = mx.swapaxes(output, -1, -2)
    return (mx.tril(-(Tt @ cotangent @ Tt), -1),)


def delta_rule_chunked(q, k, v, a, beta, S0=None, chunk: int = 64, gates=None, all_states: bool = False):
    """The delta rule in chunks of ``chunk`` tokens, each solved in closed form.

    Within a chunk (t = 1..C, state S0 before it), with u_s = beta (v_s - S_{s-1} k_s):
        (I + beta Gm*KK^T) U = beta (V - diag(a^(t-1)) K S0^T)
        O = diag(a^t) Q S0^T + (G * QK^T) U,      S_C = a^C S0 + U^T diag(a^(C-s)) K
    The triangular inverse depends on K only, so it is batched over all chunks and
    only the state hand-off runs chunk by chunk.

    S0 [..., H, hd, hd] or None (zero).  ``gates``: chunk_gates(a, C), precomputed.
    Returns o [..., T, H, hd] and the final state (None when T is not a multiple of
    the chunk: zero-padded tail tokens would still decay it) or, with ``all_states``
    (T <= chunk), the list of the T states after each token, each its own small
    product, so a state nobody reads is never computed.
    """
    *lead, T, H, hd = q.shape
    q, k, v = (mx.swapaxes(x, -3, -2) for x in (q, k, v))                  # [..., H, T, hd]
    C = min(chunk, T)
    pad = (-T) % C
    if pad:
        z = [(0, 0)] * len(lead) + [(0, 0), (0, pad), (0, 0)]
        q, k, v = mx.pad(q, z), mx.pad(k, z), mx.pad(v, z)
    N = (T + pad) // C
    q, k, v = (x.reshape(*lead, H, N, C, hd) for x in (q, k, v))
    g = chunk_gates(a, C) if gates is None else gates
    bcol = beta.reshape(H, 1, 1, 1)
    kk = k @ mx.swapaxes(k, -1, -2)
    Tinv = _unit_lower_inv(mx.eye(C) + bcol * (g["Gm"] * kk))
    W = Tinv @ (bcol * g["d_prev"] * k)                                    # U = Uv - W S0^T
    Uv = Tinv @ (bcol * v)
    QK = g["G"] * (q @ mx.swapaxes(k, -1, -2))
    Qc = g["d_cur"] * q
    S = mx.zeros((*lead, H, hd, hd), q.dtype) if S0 is None else S0
    if all_states:
        if N != 1:
            raise ValueError(f"all_states needs T <= chunk (T={T}, chunk={chunk})")
        St = mx.swapaxes(S, -1, -2)
        U = Uv[..., 0, :, :] - W[..., 0, :, :] @ St
        o = (Qc[..., 0, :, :] @ St + QK[..., 0, :, :] @ U) / math.sqrt(hd)
        uT, k0 = mx.swapaxes(U, -1, -2), k[..., 0, :, :]
        states = [mx.addmm(g["d_cur"][..., 0, j:j + 1, :] * S, uT * g["G"][..., 0, j:j + 1, :], k0)
                  for j in range(T)]
        return mx.swapaxes(o, -3, -2), states
    Ke = g["d_end"] * k
    outs = []
    for n in range(N):
        St = mx.swapaxes(S, -1, -2)
        U = Uv[..., n, :, :] - W[..., n, :, :] @ St
        outs.append(Qc[..., n, :, :] @ St + QK[..., n, :, :] @ U)
        S = g["aC"] * S + mx.swapaxes(U, -1, -2) @ Ke[..., n, :, :]
    o = mx.stack(outs, axis=-3).reshape(*lead, H, N * C, hd)[..., :T, :] / math.sqrt(hd)
    return mx.swapaxes(o, -3, -2), (None if pad else S)
