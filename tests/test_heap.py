"""spel_mlx.platform.heap: after `import spel_mlx` freed buffers stay mapped (glibc on Linux), so a
pass that frees and takes again the same megabytes faults no pages in; switched off, the
same pattern faults them in every time (the negative control)."""
import os
import subprocess
import sys

import pytest

import spel_mlx  # noqa: F401
from spel_mlx.platform import heap

GLIBC = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") is not None

# Three 24 MB buffers taken, written and freed, ten times after three warm-up rounds
# (MLX's pattern: a pass's outputs die when the next pass's replace them).  Under
# glibc's adaptive defaults the trim threshold is at most 64 MB, so the 72 MB freed at
# the heap top go back to the kernel each round and come back as fresh pages.
CHILD = r"""
import ctypes, resource, sys
import spel_mlx
from spel_mlx.platform import heap
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
N = 24 << 20
def cycle():
    ps = [libc.malloc(N) for _ in range(3)]
    assert all(ps)
    for p in ps:
        ctypes.memset(p, 1, N)
    for p in reversed(ps):
        libc.free(p)
for _ in range(3):
    cycle()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    cycle()
print(heap.state(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def run_child(switch: str):
    env = dict(os.environ, SPEL_HEAP_TUNING=switch)
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    state, faults = out.stdout.split("\n")[-2].rsplit(" ", 1)
    return state, int(faults)


@pytest.mark.skipif(not GLIBC, reason="the thresholds are glibc's")
def test_freed_buffers_stay_mapped_and_switched_off_they_fault_in_again():
    page = os.sysconf("SC_PAGESIZE")
    state, faults = run_child("1")
    assert state == "on"
    assert faults < 1000, faults                       # 720 MB written, no page faulted in
    state, faults = run_child("0")
    assert state == "off (SPEL_HEAP_TUNING=0)"
    assert faults > 10 * 72 * (1 << 20) // page // 4, faults   # much of every round faulted in again


def test_state_in_this_process():
    expected = "on" if GLIBC and os.environ.get("SPEL_HEAP_TUNING", "1") in ("1", "on", "") else None
    if expected:
        assert heap.state() == expected
    assert heap.state() == heap.tune()     # once per process: the same answer


def test_a_bad_switch_is_an_error_naming_it():
    """Read at import: the API's first use raises it, a command says it in one line."""
    env = dict(os.environ, SPEL_HEAP_TUNING="maybe")
    out = subprocess.run([sys.executable, "-c", "import spel_mlx; spel_mlx.load"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "SettingError: SPEL_HEAP_TUNING='maybe': expected 0 or 1" in out.stderr
    out = subprocess.run([sys.executable, "-m", "spel_mlx", "info"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and out.stderr == "error: SPEL_HEAP_TUNING='maybe': expected 0 or 1\n"


TRIM_CHILD = r"""
import ctypes, sys
import spel_mlx
from spel_mlx.platform import heap
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss_kb():
    return int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon:")).split()[1])
N = 24 << 20
low, high = libc.malloc(N), libc.malloc(1 << 20)     # a freed chunk below one in use
ctypes.memset(low, 1, N)
ctypes.memset(high, 1, 1 << 20)
libc.free(low)
before = rss_kb()
released = heap.release_free() if sys.argv[1] == "trim" else 0
print(released, before - rss_kb())
"""


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_release_free_returns_freed_chunks_inside_the_heap():
    """A 24 MB chunk freed below one still in use stays resident (the heap keeps it), and
    release_free gives its pages back; without the call they stay (the control)."""
    out = {}
    for how in ("trim", "keep"):
        r = subprocess.run([sys.executable, "-c", TRIM_CHILD, how], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        released, dropped_kb = map(int, r.stdout.split())
        out[how] = (released, dropped_kb)
    assert out["trim"][0] == 1 and out["trim"][1] > 20 << 10, out
    assert out["keep"][1] < 1 << 10, out
