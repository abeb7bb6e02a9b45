"""spel_mlx.platform.huge_pages: the memory under the arrays a step streams is mapped with 2 MB
pages where the kernel can, without changing an address or a bit."""
import json
import subprocess
import sys

import numpy as np
import pytest

import spel_mlx  # noqa: F401
import mlx.core as mx
from spel_mlx.platform import huge_pages


KPF_THP = 1 << 22    # /proc/kpageflags: the page is part of a transparent huge page


def thp_bytes(start: int, end: int):
    """Bytes of [start, end) on transparent huge pages, page by page (/proc/self/pagemap
    gives each page's frame, /proc/kpageflags its flags); None where this user may not
    read frames (the pagemap then shows them as 0). smaps cannot say it: advice splits a
    mapping and the parts merge again, with their neighbours too."""
    page, done = 4096, 0
    try:
        with open("/proc/self/pagemap", "rb") as pm, open("/proc/kpageflags", "rb") as kf:
            for v in range(start // page * page, end, page):
                pm.seek(v // page * 8)
                entry = int.from_bytes(pm.read(8), "little")
                pfn = entry & ((1 << 55) - 1)
                if not entry >> 63:          # not present
                    continue
                if pfn == 0:
                    return None
                kf.seek(pfn * 8)
                if int.from_bytes(kf.read(8), "little") & KPF_THP:
                    done += page
    except OSError:
        return None
    return done


def assert_on_huge_pages(a, least: int):
    address = np.frombuffer(memoryview(a), dtype=np.uint8).ctypes.data
    got = thp_bytes(address, address + a.nbytes)
    if got is not None:
        assert got >= least, f"{got >> 20} MB of the array on 2 MB pages, expected at least {least >> 20}"


def test_switch_and_bad_value(monkeypatch):
    monkeypatch.setenv("SPEL_HUGE_PAGES", "sometimes")
    with pytest.raises(ValueError, match="SPEL_HUGE_PAGES='sometimes'"):
        huge_pages.state()
    monkeypatch.setenv("SPEL_HUGE_PAGES", "0")
    assert huge_pages.state() == "off (SPEL_HUGE_PAGES=0)"
    assert huge_pages.back([mx.zeros((1 << 20,))]) == 0
    monkeypatch.delenv("SPEL_HUGE_PAGES")
    if sys.platform.startswith("linux") and huge_pages.thp_mode() in ("always", "madvise"):
        # an invalid advice is refused (the probe would see it), a kernel without collapse is "off"
        assert huge_pages._libc_madvise()(huge_pages.HUGE, 0, 999) == -1
        monkeypatch.setattr(huge_pages, "_collapse", False)
        assert huge_pages.state() == "off (the kernel has no MADV_COLLAPSE: Linux 6.1 or later)"
        assert huge_pages.back([mx.zeros((1 << 20,))]) == 0


def test_back_maps_an_array_with_huge_pages_and_keeps_it(monkeypatch):
    monkeypatch.delenv("SPEL_HUGE_PAGES", raising=False)
    if huge_pages.state() != "on":
        pytest.skip(huge_pages.state())
    values = np.random.default_rng(0).standard_normal(3 << 20).astype(np.float32)   # 12 MB
    a = mx.array(values)
    mx.eval(a)
    address = np.frombuffer(memoryview(a), dtype=np.uint8).ctypes.data
    middle = -(-(address + (4 << 20)) // huge_pages.HUGE) * huge_pages.HUGE
    # one advised page in the middle splits the mapping in three: the array spans them all
    assert huge_pages._libc_madvise()(middle, huge_pages.HUGE, huge_pages.MADV_HUGEPAGE) == 0
    assert huge_pages.back([a]) >= 8 << 20       # at least the whole 2 MB pages inside it
    assert_on_huge_pages(a, 8 << 20)
    assert np.frombuffer(memoryview(a), dtype=np.uint8).ctypes.data == address
    assert np.array_equal(np.array(a), values)


PROBE = r"""
import json, spel_mlx
from spel_mlx.api import load, generate
m, tok = load()
prompt = "And God said unto Moses, I AM THAT I AM: and he said, Thus shalt thou say. " * 30
text = generate(m, tok, prompt, max_tokens=24, temperature=0)
huge = [int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages")]
print(json.dumps({"text": text, "huge_kb": huge[0]}))
"""


def test_decoding_maps_weights_and_caches_with_huge_pages():
    """A decode backs the target's weight layouts and KV caches (tens of MB) with huge
    pages, and gives the same text as with SPEL_HUGE_PAGES=0."""
    if huge_pages.state() != "on":
        pytest.skip(huge_pages.state())
    runs = {}
    for value in ("0", "1"):
        env = {"SPEL_HUGE_PAGES": value, "PATH": "/usr/bin:/bin"}
        out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        runs[value] = json.loads(out.stdout.strip().splitlines()[-1])
    assert runs["0"]["text"] == runs["1"]["text"] and len(runs["1"]["text"]) > 20
    assert runs["1"]["huge_kb"] - runs["0"]["huge_kb"] >= 16 << 10


def test_back_soon_maps_on_another_thread_and_back_leaves_those_arrays_to_it(monkeypatch):
    """back_soon returns at once; back() leaves an array handed to it alone (0 bytes)
    until its thread is done; then the array is on huge pages with its address and bits."""
    import threading
    monkeypatch.delenv("SPEL_HUGE_PAGES", raising=False)
    if huge_pages.state() != "on":
        pytest.skip(huge_pages.state())
    go, original = threading.Event(), huge_pages._back_extents

    def held(extents):            # the thread waits until the test has called back()
        if threading.current_thread().name == "spel-huge-pages":
            go.wait(30)
        return original(extents)

    monkeypatch.setattr(huge_pages, "_back_extents", held)
    values = np.random.default_rng(1).standard_normal(3 << 20).astype(np.float32)   # 12 MB
    a = mx.array(values)
    mx.eval(a)
    address = np.frombuffer(memoryview(a), dtype=np.uint8).ctypes.data
    huge_pages.back_soon([a])
    assert huge_pages.back([a]) == 0 and huge_pages._soon
    go.set()
    huge_pages.wait_soon()
    assert not huge_pages._soon
    assert_on_huge_pages(a, 8 << 20)
    assert np.frombuffer(memoryview(a), dtype=np.uint8).ctypes.data == address
    assert np.array_equal(np.array(a), values)
    assert huge_pages.back([a]) >= 8 << 20          # its own again: already huge, counted


def test_back_soon_holds_until_released_or_its_time(monkeypatch):
    """hold_soon keeps the background thread from starting (a load's layouts wait for the
    first call's first token); release_soon lets it go at once, and a hold ends by itself
    after HOLD_S; without a hold it starts at once (the control)."""
    import time
    monkeypatch.delenv("SPEL_HUGE_PAGES", raising=False)
    if huge_pages.state() != "on":
        pytest.skip(huge_pages.state())
    started = []
    original = huge_pages._back_extents

    def seen(extents):
        started.append(time.perf_counter())
        return original(extents)
    monkeypatch.setattr(huge_pages, "_back_extents", seen)

    def fresh():
        a = mx.array(np.ones(1 << 20, dtype=np.float32))
        mx.eval(a)
        return a
    try:
        for hold, release, waits in ((True, True, False), (True, False, True), (False, False, False)):
            if hold:
                huge_pages.hold_soon()
            started.clear()
            t0 = time.perf_counter()
            huge_pages.back_soon([fresh()])
            time.sleep(0.3)
            assert bool(started) == (not hold), (hold, release)
            if release:
                huge_pages.release_soon()
            deadline = time.perf_counter() + huge_pages.HOLD_S + 5
            while not started and time.perf_counter() < deadline:
                time.sleep(0.01)
            assert started and ((started[0] - t0 >= huge_pages.HOLD_S * 0.9) == waits), (hold, release)
            huge_pages.wait_soon()
    finally:
        huge_pages.release_soon()


def test_only_the_runs_of_arrays_are_advised_not_the_memory_between(monkeypatch):
    """Arrays a few KB apart form one run; a run's whole 2 MB pages are advised and
    collapsed, and the memory between two runs (where malloc puts later buffers) is not:
    advised, its first writes would fault 2 MB pages."""
    M = huge_pages.HUGE
    base = 64 * M
    a = (base + 100, 3 * M)                       # two arrays 4 KB apart: one run
    b = (base + 100 + 3 * M + 4096, 2 * M)
    far = (base + 20 * M + 5, 4 * M)              # another run, 15 MB further on
    assert huge_pages._runs([far, a, b]) == [(a[0], b[0] + b[1]), (far[0], far[0] + far[1])]
    calls = []
    monkeypatch.setattr(huge_pages, "_libc_madvise", lambda: (lambda p, n, advice: calls.append((p, n, advice)) or 0))
    monkeypatch.setattr(huge_pages, "_writable_regions", lambda: [(base, base + 40 * M)])
    done = huge_pages._back_extents([a, b, far])
    advised = [(p, p + n) for p, n, advice in calls if advice == huge_pages.MADV_HUGEPAGE]
    assert advised == [(base + M, base + 5 * M), (base + 21 * M, base + 24 * M)]
    collapsed = [p for p, n, advice in calls if advice == huge_pages.MADV_COLLAPSE]
    assert collapsed == [base + i * M for i in (1, 2, 3, 4, 21, 22, 23)] and done == 7 * M
    gap = (base + 5 * M, base + 21 * M)
    assert not any(lo < gap[1] and hi > gap[0] for lo, hi in advised)
