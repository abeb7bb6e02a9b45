"""What the cost governor learned, kept across processes on this machine.

A fresh process has no AR round time and no verdict on the draft, so its first call
would spend AR rounds timing the target and drafting rounds probing a draft that may
not pay.  After each call the governor's memory (``GovernorMemory``) is written to a
small JSON file in the user's cache folder, keyed by CPU, checkpoint (path, size,
modification time), draft, K and greedy/sampled; the next process's first call starts
from it.  An entry older than ``MAX_AGE_S``, from another spel_mlx version, or a file
that does not parse is ignored (and replaced on the next write).  SPEL_GOVERNOR_STORE=0
turns the store off; SPEL_CACHE_DIR moves it (default $XDG_CACHE_HOME/spel-mlx or
~/.cache/spel-mlx).
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, fields

from ..settings import setting
from .governor import GovernorMemory

FILE = "governor.json"
FORMAT = 1
MAX_AGE_S = 14 * 24 * 3600     # two weeks: a changed machine or load outlives none
MAX_ENTRIES = 64


def enabled() -> bool:
    return setting("SPEL_GOVERNOR_STORE")


def path() -> str:
    base = setting("SPEL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "spel-mlx")
    return os.path.join(base, FILE)


# /proc/cpuinfo fields that tell CPUs apart: VMs on different EPYC generations all
# report the model name "AMD EPYC", and their costs differ
CPU_FIELDS = ("model name", "cpu family", "model", "stepping", "cache size")


def _cpu(cpuinfo: str | None = None) -> str:
    """The CPU this process runs on: its first processor's CPU_FIELDS and the CPUs it
    may use (the drafting-ahead choices depend on a second core)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    found = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if found:
                break           # the first processor's block is enough
            continue
        name, _, value = line.partition(":")
        name = name.strip()
        if name in CPU_FIELDS and name not in found:
            found[name] = value.strip()
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    if not found:
        return f"{platform.processor() or platform.machine()}, {cpus} cpus"
    return ", ".join(f"{n}={found[n]}" for n in CPU_FIELDS if n in found) + f", {cpus} cpus"


def _checkpoint(source: str) -> str:
    """The checkpoint's path, size and modification time (a folder: its weights file)."""
    p = os.path.join(source, "model.safetensors") if os.path.isdir(source) else source
    try:
        st = os.stat(p)
    except OSError:
        return os.path.abspath(source)
    return f"{os.path.abspath(p)}:{st.st_size}:{st.st_mtime_ns}"


def key(source: str, draft: str, k: int, sampled: bool, device: str = "cpu") -> str:
    return " | ".join([_cpu(), device, _checkpoint(source), draft, f"k={k}", "sampled" if sampled else "greedy"])


def _version() -> str:
    from .. import __version__
    return __version__


def _read() -> dict:
    try:
        with open(path(), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


def recall(k: str) -> GovernorMemory | None:
    """The memory stored under `k`, or None (none, stale, another version, unreadable)."""
    if not enabled():
        return None
    e = _read().get(k)
    try:
        if e["version"] != _version() or not 0 <= time.time() - e["saved"] <= MAX_AGE_S:
            return None
        m = GovernorMemory(**{f.name: e["memory"][f.name] for f in fields(GovernorMemory)})
    except (KeyError, TypeError, ValueError):
        return None
    if m.ar_seconds is not None and not (isinstance(m.ar_seconds, (int, float)) and 0 < m.ar_seconds < 60):
        return None
    if m.cost is not None and not (isinstance(m.cost, (int, float)) and 0 < m.cost < 1000):
        return None
    return m


def remember(k: str, memory: GovernorMemory | None) -> None:
    """Store `memory` under `k` (atomically; the oldest entries beyond MAX_ENTRIES go).
    A file that cannot be written is left alone: the store is an optimisation."""
    if not enabled() or memory is None or memory.ar_seconds is None:
        return
    from ..atomic import write_json
    entries = _read()
    entries[k] = {"version": _version(), "saved": time.time(), "memory": asdict(memory)}
    keep = sorted(entries.items(), key=lambda kv: kv[1].get("saved", 0) if isinstance(kv[1], dict) else 0)
    try:
        os.makedirs(os.path.dirname(path()), exist_ok=True)
        write_json(path(), {"format": FORMAT, "entries": dict(keep[-MAX_ENTRIES:])})
    except OSError:
        pass
