"""Shared pieces of the benchmark: timing, summaries, result rows, JSON, the cost model.

A *row* is one measured (or unavailable) figure, a plain dict:

    {"section": "b3", "name": "raw spec", "regime": "21m", "placement": "target=mlx-cpu draft=c-cpu",
     "mode": "spec", "threads": 1, "K": 4, "status": "ok" | "not available" | "skipped" | "error",
     "note": "...", "primary": "tok_s", "metrics": {"tok_s": 71.3, "alpha": 0.4, ...}}

Inside one process every metric is a single number (the median of that process's
internal repeats; the raw repeats go to ``samples``). ``merge_runs`` turns the rows of
several process runs into one row whose metrics are ``{"median", "min", "max", "runs"}``:
the headline protocol of the original (ranges over process runs, medians).
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import tempfile
import time

SCHEMA = "spel-mlx-bench/1"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OK, NOT_AVAILABLE, SKIPPED, ERROR = "ok", "not available", "skipped", "error"

# the fields that identify a row across process runs
KEY_FIELDS = ("section", "name", "regime", "placement", "mode", "threads", "K")


# --------------------------------------------------------------------------- timing

def now() -> float:
    return time.perf_counter()


def time_calls(fn, repeats: int, warmup: int = 1) -> list:
    """Seconds per call of ``fn()`` for ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def time_loop(fn, iters: int, repeats: int, warmup: int = 1) -> list:
    """Seconds per call of a very cheap ``fn`` measured over ``iters`` calls per repeat
    (so the timer's own cost is amortised)."""
    for _ in range(warmup):
        for _ in range(iters):
            fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        out.append((time.perf_counter() - t0) / iters)
    return out


def median(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(xs) if xs else None


def summarize(xs) -> dict:
    """``{"median", "min", "max", "runs"}`` of the numeric values in ``xs`` (None ignored)."""
    vals = [float(x) for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not vals:
        return {"median": None, "min": None, "max": None, "runs": []}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "runs": vals}


# --------------------------------------------------------------------------- cost model

def cost_model_speedup(alpha: float, K: int, c: float, v: float) -> float:
    """SPEC 5: ``(1 + alpha*K) / ((K+1)*c + v)`` -- tokens per round over the round's cost
    in AR-token units (K+1 draft forwards at c each, one K+1 verification at v)."""
    return (1.0 + alpha * K) / ((K + 1) * c + v)


# --------------------------------------------------------------------------- rows

def make_row(section: str, name: str, *, regime=None, placement=None, mode=None, threads=None,
             K=None, primary=None, metrics=None, samples=None, note="", status=OK, **extra) -> dict:
    row = {"section": section, "name": name, "regime": regime, "placement": placement,
           "mode": mode, "threads": threads, "K": K, "status": status, "note": note,
           "primary": primary, "metrics": dict(metrics or {})}
    if samples is not None:
        row["samples"] = [float(s) for s in samples]
    row.update(extra)
    return row


def unavailable(section: str, name: str, reason: str, status: str = NOT_AVAILABLE, **fields) -> dict:
    """A row that is kept (so it does not silently vanish) and says why it has no figure."""
    return make_row(section, name, status=status, note=reason, **fields)


def row_key(row: dict) -> tuple:
    return tuple(row.get(k) for k in KEY_FIELDS)


def merge_runs(runs: list) -> list:
    """Rows of several process runs (a list of row lists) -> one row per key, metrics
    summarised over the runs. Order follows the first appearance of each key. A row
    that failed in some runs keeps the figures of the runs that worked and says so."""
    order, groups = [], {}
    for rows in runs:
        for r in rows:
            k = row_key(r)
            if k not in groups:
                groups[k] = []
                order.append(k)
            groups[k].append(r)
    merged = []
    for k in order:
        rs = groups[k]
        good = [r for r in rs if r["status"] == OK]
        base = dict(good[0] if good else rs[0])
        base["process_runs"] = len(good)
        if good:
            names = []
            for r in good:
                names += [n for n in r["metrics"] if n not in names]
            base["metrics"] = {n: summarize([r["metrics"].get(n) for r in good]) for n in names}
            samples = [s for r in good for s in r.get("samples", [])]
            if samples:
                base["samples"] = samples
            if len(good) < len(rs):
                bad = [r for r in rs if r["status"] != OK]
                base["note"] = (base.get("note") or "") + \
                    f" ({len(bad)} of {len(rs)} runs failed: {bad[0].get('note', '')})"
        else:
            base["metrics"] = {}
        merged.append(base)
    return merged


def select_rows(results: dict, section=None, regime=None, **eq) -> list:
    """The rows of a results document in one section and regime with the given fields."""
    out = []
    for r in results["rows"]:
        if section is not None and r["section"] != section:
            continue
        if regime is not None and r.get("regime") != regime:
            continue
        if any(r.get(k) != v for k, v in eq.items()):
            continue
        out.append(r)
    return out


def metric(row: dict, name: str, stat: str = "median"):
    """A merged row's metric statistic, or None."""
    m = row.get("metrics", {}).get(name)
    if m is None:
        return None
    if isinstance(m, dict):
        return m.get(stat)
    return m


# --------------------------------------------------------------------------- files

def write_json_atomic(path: str, obj) -> None:
    """Write ``obj`` as JSON to ``path`` via a temporary file in the same folder + rename."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=False, default=_json_default)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str, text: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _json_default(o):
    try:
        import numpy as np
        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(o, tuple):
        return list(o)
    return str(o)


def machine_info() -> dict:
    info = {"platform": platform.platform(), "machine": platform.machine(),
            "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        import spel_mlx  # noqa: F401  (loads the BLAS before mlx.core)
        import mlx.core as mx
        info["mlx"] = getattr(mx, "__version__", "?")
        info["mlx_default_device"] = str(mx.default_device())
        info["gpu"] = gpu_available()
    except Exception as e:  # pragma: no cover - reported, not fatal
        info["mlx"] = f"unavailable: {e}"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def gpu_available() -> bool:
    """Whether MLX can place arrays on a GPU here (Metal on Apple, CUDA elsewhere)."""
    import spel_mlx  # noqa: F401
    import mlx.core as mx
    try:
        return bool(mx.is_available(mx.gpu))
    except Exception:
        return False


def fmt_num(x, digits: int = 3) -> str:
    if x is None:
        return "—"
    x = float(x)
    if x == 0:
        return "0"
    a = abs(x)
    if x.is_integer() and a < 1e6:  # counts (rounds, trips, ranks) print as integers
        return f"{int(x):,}"
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 100:
        return f"{x:.1f}"
    if a >= 10:
        return f"{x:.2f}"
    if a >= 0.01:
        return f"{x:.{digits}f}"
    return f"{x:.3g}"


def fmt_range(m) -> str:
    """'median (min–max)' of a merged metric, or the single value."""
    if m is None:
        return "—"
    if not isinstance(m, dict):
        return fmt_num(m)
    if m.get("median") is None:
        return "—"
    if len(m.get("runs", [])) <= 1 or m["min"] == m["max"]:
        return fmt_num(m["median"])
    return f"{fmt_num(m['median'])} ({fmt_num(m['min'])}–{fmt_num(m['max'])})"
