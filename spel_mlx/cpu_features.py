"""SPEL_SIMD: cap the SIMD level of the C and C++ kernels, to measure or run the paths
of CPUs without AVX-512 (or without SIMD) on a machine that has it.

    SPEL_SIMD=auto     the best the CPU has (default)
    SPEL_SIMD=avx2     no AVX-512: the target's products go to BLAS, the draft uses its AVX2 kernel
    SPEL_SIMD=none     the scalar references everywhere

SPEL_ATTENTION_HELPER=0 keeps the target's attention over a long cache on one thread
(default 1: its key chunks are shared with a helper thread when the process may use two
CPUs; the same bits either way).

SPEL_HALF_WEIGHTS=0 keeps the target's weight blocks in float32 (default 1: a matrix
whose every weight is exactly a binary16 value, as a float16 checkpoint's are, is read
by the AVX-512 tiles as binary16, widened exactly: the same bits, half the bytes).
"""
from __future__ import annotations

import os

LEVELS = ("auto", "avx512", "avx2", "none")


def simd_cap() -> str:
    level = os.environ.get("SPEL_SIMD", "auto").strip().lower() or "auto"
    if level not in LEVELS:
        raise ValueError(f"SPEL_SIMD={level!r}: expected one of {', '.join(LEVELS)}")
    return level


def env_switch(name: str) -> bool:
    """An on/off environment variable, on by default: 1/on or 0/off, else a ValueError."""
    raw = os.environ.get(name, "1").strip().lower() or "1"
    if raw not in ("0", "1", "off", "on"):
        raise ValueError(f"{name}={raw!r}: expected 0 or 1")
    return raw in ("1", "on")


def attention_helper() -> bool:
    return env_switch("SPEL_ATTENTION_HELPER")


def half_weights() -> bool:
    return env_switch("SPEL_HALF_WEIGHTS")
