"""Linear maps and the CPU weight layout their products read.

On the CPU a compiled pass multiplies by a private copy of W laid out for the
BLAS: blocks of 32-64 output rows, each stored transposed and contiguous
([nb, in, rb], one batched matmul node).  MLX hands OpenBLAS a strided W^T as a
transposed operand, which it re-packs on every call, several times the cost for
a few rows (docs/model.md).  Blocking changes only which rows one BLAS call
sees, so the M=1 pass stays the same function for single steps and strict rows.
"""
from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

# Rows per block by batch size (up to 5 rows: 64, more: 32; measured in
# docs/model.md); None turns blocking off.
BLOCK_ROWS = {5: 64, None: 32}
MIN_BLOCK_ROWS = 16


def row_block(rows: int, cols: int, M: int):
    """Rows per block for this weight and batch, or None for one W^T."""
    if BLOCK_ROWS is None or mx.default_device() != mx.cpu:
        return None
    limit = BLOCK_ROWS[5] if M <= 5 else BLOCK_ROWS[None]
    if rows <= limit:
        return None
    rb = max(r for r in range(1, limit + 1) if rows % r == 0)
    return rb if rb >= MIN_BLOCK_ROWS else None


class Linear(nn.Module):
    """y = x W^T with W stored [out, in] (SPEC 2), no bias.

    ``quant`` names the SPEC 3 scheme a draft weight is quantized with ("q8",
    "ternary", None for FP32 weights); only the training forward's fake
    quantization reads it (the quantized draft itself is the C engine)."""

    def __init__(self, d_in: int, d_out: int, quant: str | None = None):
        super().__init__()
        scale = 1.0 / math.sqrt(d_in)
        self.weight = mx.random.uniform(-scale, scale, (d_out, d_in))
        self.quant = quant

    def __call__(self, x):
        if x.ndim != 2:
            return x @ self.weight_view(None)
        M = x.shape[0]
        rb = row_block(*self.weight.shape, M)
        if rb is None:
            return x @ self.weight_view(None)
        y = x @ self.weight_view(rb)                                     # [nb, M, rb]
        return y.reshape(1, -1) if M == 1 else y.transpose(1, 0, 2).reshape(M, -1)

    def _cache(self) -> dict:
        """The layouts built from the current weight (dropped when ``update`` replaces it)."""
        cache = self.__dict__.get("_views")
        if cache is None or cache[0] is not self.weight:
            cache = (self.weight, {})
            object.__setattr__(self, "_views", cache)
        return cache[1]

    def weight_view(self, rb, warm: bool = False):
        """W^T (rb None) or W as row blocks [nb, in, rb].  Traced: strided views of
        the weight (differentiable).  ``warm`` (outside any trace): on the CPU a
        contiguous copy, evaluated and kept, so a compiled pass captures it."""
        cache = self._cache()
        view = cache.get(rb)
        if view is None:
            W = self.weight
            view = W.T if rb is None else W.reshape(W.shape[0] // rb, rb, W.shape[1]).transpose(0, 2, 1)
            if warm:
                if mx.default_device() == mx.cpu:
                    view = mx.contiguous(view)
                mx.eval(view)
                cache[rb] = view
        return view

    def blocks(self, M: int):
        """The warm contiguous [nb, in, rb] blocks of an M-row product, or None."""
        return self._cache().get(("3d", row_block(*self.weight.shape, M)))

    def layouts(self) -> list:
        """The warm layouts built so far (what the CPU products read)."""
        return [v for v in self._cache().values() if isinstance(v, mx.array)]

    def _weight_from_blocks(self, b3, rb, cache: dict) -> None:
        """Let the weight be the blocks read back (a lazy expression, exact: float16
        blocks hold only exactly-binary16 weights), so its float32 copy is freed; a
        path that reads the weight itself evaluates it again.  The layouts stay."""
        R, C = self.weight.shape
        W = (b3.transpose(0, 2, 1).reshape(R, C) if rb is not None else b3[0].T).astype(mx.float32)
        self.weight = W
        object.__setattr__(self, "_views", (W, cache))

    def exactly_half(self, test=None) -> bool:
        """Whether every weight is exactly a binary16 value (a float16 checkpoint's
        are): float16 blocks then hold the same numbers in half the bytes.  ``test``:
        a faster answer for the evaluated contiguous float32 weight (one that stops at
        the first value that is not), else MLX ops over the whole weight."""
        cache = self._cache()
        if "half" not in cache:
            W = self.weight
            if test is not None and W.dtype == mx.float32:
                W = mx.contiguous(W)
                mx.eval(W)
                cache["half"] = bool(test(W))
            else:
                cache["half"] = bool(mx.all(W.astype(mx.float16).astype(W.dtype) == W).item())
        return cache["half"]

    def warm(self, M: int, blocks: bool = False, build=None, half: bool = False, half_test=None) -> None:
        """Build the layout an M-row product uses; ``blocks``: instead, one 3-D
        [nb, in, rb] array (a single block for a plain W^T), what the fused CPU
        primitives read, made by ``build(weight, rb, half)`` where given (one pass from
        the evaluated float32 weight), else by MLX ops; ``half``: as float16 where the
        weights are exactly binary16 (``exactly_half(half_test)``)."""
        rb = row_block(*self.weight.shape, M)
        cache = self._cache()
        if not blocks:
            self.weight_view(rb, warm=True)
            return
        if ("3d", rb) not in cache:
            half = half and self.exactly_half(half_test)
            if build is not None:
                W = mx.contiguous(self.weight)
                mx.eval(W)
                b3 = build(W, W.shape[0] if rb is None else rb, half)
            else:
                # from the strided view: a contiguous float32 layout kept beside the blocks
                # would be a second copy of the weights that no product reads
                view = self.weight_view(rb)
                b3 = mx.contiguous(view if rb is not None else view.reshape(1, *view.shape))
                if half:
                    b3 = b3.astype(mx.float16)
                mx.eval(b3)
            cache[("3d", rb)] = b3
            if build is not None:
                self._weight_from_blocks(b3, rb, cache)
