"""SPEL_SIMD: cap the SIMD level of the C and C++ kernels, to measure or run the paths
of CPUs without AVX-512 (or without SIMD) on a machine that has it.

    SPEL_SIMD=auto     the best the CPU has (default)
    SPEL_SIMD=avx2     no AVX-512: the target's products are the AVX2 tiles (where the CPU has
                       FMA and F16C; else the BLAS), the draft uses its AVX2 kernel
    SPEL_SIMD=none     the scalar references everywhere

SPEL_ATTENTION_HELPER=0 keeps the target's attention over a long cache on one thread
(default 1: its key chunks are shared with a helper thread when the process may use two
CPUs; the same bits either way).

SPEL_HALF_WEIGHTS=0 keeps the target's weight blocks in float32 (default 1: a matrix
whose every weight is exactly a binary16 value, as a float16 checkpoint's are, is read
by the linear tiles as binary16, widened exactly: the same bits, half the bytes).
"""
from __future__ import annotations

from ..settings import SETTINGS, setting

LEVELS = SETTINGS["SPEL_SIMD"].choices


def simd_cap() -> str:
    return setting("SPEL_SIMD")


def attention_helper() -> bool:
    return setting("SPEL_ATTENTION_HELPER")


def half_weights() -> bool:
    return setting("SPEL_HALF_WEIGHTS")
