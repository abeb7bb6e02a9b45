"""The per-position noise stream of sampled decoding (docs/decoding.md, "Coupled sampling").

A counter-based stream: 64 bits of (seed, sequence index, slot), each word absorbed
through the splitmix64 mixer, so any (index, token) is drawn on demand without a
state to advance.  Slots >= 0 are token ids (Gumbel noise of that token at that
index); the negative slots ``ACCEPT`` and ``DRAW`` are the per-index uniforms of the
residual rule.  The C functions (neon/sampling.c) are what decoding uses on both the
draft and the target side; the numpy functions here are their reference (the bits
and uniforms are identical, the Gumbel values agree to ~1 ulp of the logarithms) and
the fallback when the C module is not built.
"""
from __future__ import annotations

import secrets

import numpy as np

from ..native import clib

ACCEPT = -1      # the residual rule's accept test at an index
DRAW = -2        # its draw from the residual at an index

_MASK = (1 << 64) - 1
_C = clib.lib if clib.lib is not None and hasattr(clib.lib, "spel_noise_bits") else None


def seed64(seed: int | None) -> int:
    """The stream's 64-bit seed: ``seed`` itself below 2^64 (larger ones are hashed by
    numpy's SeedSequence), a fresh random one for None."""
    if seed is None:
        return secrets.randbits(64)
    seed = int(seed)
    if 0 <= seed <= _MASK:
        return seed
    return int(np.random.SeedSequence(seed).generate_state(1, np.uint64)[0])


def _u64(x: int) -> np.ndarray:
    return np.array([x & _MASK], dtype=np.uint64)


def _mix64(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def bits_reference(seed: int, index: int, slots) -> np.ndarray:
    """uint64 noise bits of (seed, index, slot) for each slot (numpy; arrays wrap mod 2^64)."""
    h = _mix64(_u64(seed) ^ np.uint64(0x9E3779B97F4A7C15))
    h = _mix64(h ^ (_u64(index) * np.uint64(0xD1B54A32D192ED03) + np.uint64(0x8CB92BA72F3D8DD7)))
    s = np.asarray(slots, dtype=np.int64).astype(np.uint64)
    return _mix64(h ^ (s * np.uint64(0xAEF17502108EF2D9) + np.uint64(0x3C6EF372FE94F82B)))


def uniform_reference(seed: int, index: int, slots) -> np.ndarray:
    """Uniforms in (0, 1) from the top 53 bits."""
    return ((bits_reference(seed, index, slots) >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0 ** -53


def gumbel_reference(seed: int, index: int, tokens) -> np.ndarray:
    return -np.log(-np.log(uniform_reference(seed, index, tokens)))


def uniform(seed: int, index: int, slot: int) -> float:
    """One uniform of the stream (the C function when built)."""
    if _C is not None:
        return float(_C.spel_noise_uniform(seed & _MASK, int(index), int(slot)))
    return float(uniform_reference(seed, index, [slot])[0])


def gumbel(seed: int, index: int, tokens) -> np.ndarray:
    """Gumbel noise of `tokens` at sequence index `index` (the C function when built)."""
    if _C is None:
        return gumbel_reference(seed, index, tokens)
    s = seed & _MASK
    return np.array([_C.spel_noise_gumbel(s, int(index), int(t)) for t in tokens], dtype=np.float64)
