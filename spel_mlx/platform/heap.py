"""The C heap under MLX's CPU buffers (Linux, glibc): freed pass buffers stay mapped.

MLX takes every output buffer from malloc and frees it when the array dies, so each
pass frees and takes again megabytes of buffers (a 16-row prefill pass of the shipped
model: 1 MB of GDN states per layer).  glibc gives the top of its heap back to the
kernel once more than its trim threshold is free there (by default twice an adaptive
mmap threshold: a few MB here), so when a pass's buffers sit at the top, every pass
shrinks the heap and the next one faults the same pages in again, zeroed.  Whether
they sit there is a matter of allocation order, so one of several identical decoders
could run far slower than the others.  `tune` fixes both thresholds once, at import:
buffers up to 32 MB come from the heap, and the heap keeps up to 256 MB free at its top
(what a process already peaked at stays mapped).

SPEL_HEAP_TUNING=0 leaves malloc as it is.  Measured in docs/model.md ("The heap").
"""
from __future__ import annotations

import ctypes
import sys

from ..settings import setting

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3     # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20     # glibc's largest on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 256 << 20

_state: str | None = None


def tune() -> str:
    """Set the thresholds (once per process); returns "on" or "off (why)"."""
    global _state
    if _state is None:
        _state = _apply()
    return _state


def state() -> str:
    return tune()


def _apply() -> str:
    if not sys.platform.startswith("linux"):
        return "off (not Linux)"
    if not setting("SPEL_HEAP_TUNING"):
        return "off (SPEL_HEAP_TUNING=0)"
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version      # glibc's thresholds: musl has no mallopt of these
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "off (not glibc)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the mmap threshold first: a trim threshold alone would switch off the adaptive
    # mmap threshold and leave every buffer over 128 KB to mmap and munmap
    if not mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        return "off (mallopt refused the mmap threshold)"
    mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    return "on"


def release_free() -> int:
    """Give the heap's free memory back to the kernel (glibc's malloc_trim(0): free
    chunks anywhere in the heap, not only at its top); returns 1 if any was released.
    For after a load: the checkpoint's float32 copies, freed as their layouts were
    built, would otherwise stay resident between the layouts."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return 0
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim(0)
