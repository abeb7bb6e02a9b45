"""Transparent huge pages under the arrays a decode step streams (Linux, CPU).

Every token reads the target's weights and its KV caches.  With 4 KB pages that
stream misses the TLB every 4 KB and the hardware prefetchers stop at each page
edge; on a virtual machine each miss is a two-level page walk.  `back` asks the
kernel to map the memory under some arrays with 2 MB pages (MADV_HUGEPAGE, then
MADV_COLLAPSE to do it now).  The addresses and the bits stay as they were; only
the page tables change.  Elsewhere (macOS, THP off, an older kernel) it does nothing.

SPEL_HUGE_PAGES=0 switches it off.  Measured in docs/model.md ("Huge pages").
"""
from __future__ import annotations

import ctypes
import functools
import sys
import threading

import mlx.core as mx
import numpy as np

from ..settings import setting

HUGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"

_madvise = None
_collapse = None   # whether MADV_COLLAPSE exists (asked once)


@functools.lru_cache(maxsize=None)
def thp_mode() -> str | None:
    """The kernel's THP mode ("always", "madvise", "never"), None where there is none
    (read once: every pass and cache growth asks)."""
    try:
        with open(THP_MODE) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def state() -> str:
    """What `back` does here: "on", or "off (why)"."""
    if not sys.platform.startswith("linux"):
        return "off (not Linux)"
    if not setting("SPEL_HUGE_PAGES"):
        return "off (SPEL_HUGE_PAGES=0)"
    mode = thp_mode()
    if mode in (None, "never"):
        return f"off (transparent huge pages {'absent' if mode is None else 'never'} in this kernel)"
    if not _has_collapse():
        return "off (the kernel has no MADV_COLLAPSE: Linux 6.1 or later)"
    return "on"


def _has_collapse() -> bool:
    """Whether the kernel knows MADV_COLLAPSE: it checks the advice before the length,
    so an empty range answers without touching memory."""
    global _collapse
    if _collapse is None:
        _collapse = _libc_madvise()(HUGE, 0, MADV_COLLAPSE) == 0
    return _collapse


def _libc_madvise():
    global _madvise
    if _madvise is None:
        fn = ctypes.CDLL(None, use_errno=True).madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _madvise = fn
    return _madvise


def _writable_regions():
    """(start, end) of the private anonymous mappings (the heap included): where
    malloc puts MLX's CPU buffers."""
    regions = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if fields[1] != "rw-p" or (len(fields) > 5 and fields[5] != "[heap]"):
                continue
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            regions.append((lo, hi))
    return regions


def _extent(a):
    """(address, bytes) of an evaluated, row-contiguous CPU array, else None."""
    try:
        view = np.frombuffer(memoryview(a), dtype=np.uint8)
    except (TypeError, ValueError, BufferError):
        return None
    return view.ctypes.data, view.nbytes


def back(arrays) -> int:
    """Map the memory under `arrays` (evaluated CPU arrays) with 2 MB pages where the
    kernel can: the whole 2 MB pages inside each run of them (`_back_extents`).
    Returns the bytes now mapped that way (0 where `state()` is off).  Arrays handed
    to `back_soon` are left to it."""
    return _back_extents([e for _, e in _not_handed(arrays)])


def _not_handed(arrays) -> list:
    """(array, extent) of the arrays with memory here not yet handed to `back_soon`;
    none where `state()` is off."""
    if state() != "on" or mx.default_device() != mx.cpu:
        return []
    return [(a, e) for a, e in ((a, _extent(a)) for a in arrays if a.nbytes) if e is not None and e not in _soon]


_soon = set()       # extents the background thread has yet to back (back() leaves them)
_work = None        # its queue.Queue: lists of arrays, kept alive until backed
_go = threading.Event()   # clear: the thread holds (hold_soon) until release_soon or HOLD_S
_go.set()
HOLD_S = 2.0


def hold_soon() -> None:
    """Let the background thread wait, before its next arrays, until `release_soon` (at
    most HOLD_S seconds): a collapse stalls whatever touches that memory meanwhile, so a
    load holds it and the first call releases it once its first token is out."""
    _go.clear()


def release_soon() -> None:
    _go.set()


def back_soon(arrays) -> None:
    """`back` on a background thread, so the caller goes on at once (on 4 KB pages
    until it is done; the addresses and bits never change).  For what a load
    prepares: collapsing a large model's layouts costs seconds on this kind of VM."""
    global _work
    todo = _not_handed(arrays)
    if not todo:
        return
    _soon.update(e for _, e in todo)
    if _work is None:
        import queue
        _work = queue.Queue()
        threading.Thread(target=_backer, args=(_work,), name="spel-huge-pages", daemon=True).start()
    _work.put(todo)


def _backer(work) -> None:
    while True:
        todo = work.get()
        _go.wait(HOLD_S)
        try:
            _back_extents([e for _, e in todo])
        finally:
            _soon.difference_update(e for _, e in todo)    # done: a later back() finds them huge
            del todo
            work.task_done()


def wait_soon() -> None:
    """Wait until everything handed to `back_soon` is backed (tests, benchmarks); a hold
    ends."""
    release_soon()
    if _work is not None:
        _work.join()


def _runs(extents, gap: int = 64 << 10) -> list:
    """The extents merged into runs where less than `gap` bytes lie between them (the
    small arrays a load makes one after another), as (start, end)."""
    runs = []
    for p, n in sorted(extents):
        if runs and p - runs[-1][1] < gap:
            runs[-1][1] = max(runs[-1][1], p + n)
        else:
            runs.append([p, p + n])
    return [(a, b) for a, b in runs]


def _back_extents(extents) -> int:
    """The whole 2 MB pages inside each run of the arrays (`_runs`), advised huge and
    collapsed.  Memory between runs is left alone: advised, the buffers malloc later
    puts there would be faulted on 2 MB pages, which on a VM stalls their first writes."""
    if not extents:
        return 0
    madvise, done = _libc_madvise(), 0
    runs = _runs(extents)
    for lo, hi in _writable_regions():   # an array may span several (madvise splits them)
        for a, b in runs:
            start = -(-max(a, lo) // HUGE) * HUGE
            end = min(b, hi) // HUGE * HUGE
            if end <= start:
                continue
            madvise(start, end - start, MADV_HUGEPAGE)
            for page in range(start, end, HUGE):   # one by one: a page that cannot (shared, pinned) stops none other
                if madvise(page, HUGE, MADV_COLLAPSE) == 0:
                    done += HUGE
    return done
