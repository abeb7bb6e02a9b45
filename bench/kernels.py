"""B1: ternary / q8 GEMV kernels of the C draft engine, and draft-only tokens/s.

    python -m bench.kernels [--quick] [--out results.json]

* every kernel available on this CPU on a 4096 x 1536 matrix (the original's B1 shape):
  ternary and q8, at 1 thread and on the pool (2.. threads), GMAC/s and weight GB/s
  (packed bytes streamed per GEMV / time), beside numpy FP32 GEMV (BLAS pinned to one
  thread) and the engine's own FP32 GEMV measured in the same run;
* the draft-only token (``CDraft.step``) at the 21m and 218m shapes (random weights),
  1 and 2 threads, and the MLX target's AR token at 21m for the cost ratio c.

Figures are medians over repeats.  On a shared machine wall-clock time includes time
other processes hold the core, so single-thread rows also give the rate per CPU-second
of the measuring thread (``*_cpu``), which is what the kernel itself achieves.
``run(quick)`` returns the rows for ``python -m bench`` (section b1).

    python -m bench.kernels --metal-ternary [--rows 4096 --cols 1536 --iters 200]

times the custom Metal ternary GEMV (spel_mlx.metal, Apple GPUs only) against MLX's
2-bit affine ``quantized_matmul`` and an FP32 matmul on the same rows; elsewhere only
the MLX baselines run (CPU figures, not the GPU's).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

# numpy's BLAS on one thread: the FP32 baseline is a 1-thread figure like the kernels'
for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402

import spel_mlx  # noqa: E402,F401  (BLAS shim before mlx)

ROWS, COLS = 4096, 1536


def _median(xs):
    return statistics.median(xs) if xs else None


def _time(fn, iters, repeats):
    """(median wall s/call, median thread-CPU s/call) over repeats of iters calls."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(iters):
            fn()
        wall.append((time.perf_counter() - t0) / iters)
        cpu.append((time.thread_time() - c0) / iters)
    return _median(wall), _median(cpu)


def pool_threads():
    n = min(os.cpu_count() or 1, 6)
    return sorted({t for t in (2, 4, n) if 2 <= t <= n})


def bench_gemv(quick: bool) -> list:
    from spel_mlx.native import cdraft as draft

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((ROWS, COLS)) * 0.02).astype(np.float32)
    x = rng.standard_normal(COLS).astype(np.float32)
    macs = ROWS * COLS
    iters, repeats = (20, 5) if quick else (100, 9)
    rows = []

    def row(name, threads, wall, cpu, weight_bytes, **extra):
        r = {"name": name, "threads": threads, "gmac_s": macs / wall / 1e9,
             "weight_gb_s": weight_bytes / wall / 1e9, "us_per_gemv": wall * 1e6}
        if cpu:
            r["gmac_s_cpu"] = macs / cpu / 1e9
            r["us_per_gemv_cpu"] = cpu * 1e6
        r.update(extra)
        rows.append(r)

    # FP32 baselines
    y = np.empty(ROWS, np.float32)
    wall, cpu = _time(lambda: np.matmul(w, x, out=y), max(iters // 4, 5), repeats)
    row("numpy fp32", 1, wall, cpu, w.nbytes)
    with draft.Pool(1) as pool:
        wall, cpu = _time(lambda: draft.f32_gemv(pool, w, x, out=y), max(iters // 4, 5), repeats)
        row("engine fp32", 1, wall, cpu, w.nbytes)

    packed = {True: ROWS * (COLS // 4 + 4), False: ROWS * (COLS + 4)}   # codes/int8 + f32 scale
    for ternary in (True, False):
        m = draft.QMatrix(w, ternary=ternary)
        for k in draft.available_kernels():
            slow = k == "scalar"
            it = max(iters // (20 if slow else 1), 2)
            with draft.Pool(1) as pool:
                wall, cpu = _time(lambda: m.gemv(x, pool, k, out=y), it, repeats)
            row(f"{'ternary' if ternary else 'q8'} {k}", 1, wall, cpu, packed[ternary])
            if slow:
                continue
            for t in pool_threads():
                with draft.Pool(t) as pool:
                    wall, _ = _time(lambda: m.gemv(x, pool, k, out=y), it, repeats)
                row(f"{'ternary' if ternary else 'q8'} {k}", t, wall, None, packed[ternary])
        m.close()
    base = next(r for r in rows if r["name"] == "numpy fp32")
    for r in rows:
        r["x_numpy_fp32"] = r["gmac_s"] / base["gmac_s"]
        if "gmac_s_cpu" in r and "gmac_s_cpu" in base:
            r["x_numpy_fp32_cpu"] = r["gmac_s_cpu"] / base["gmac_s_cpu"]
    return rows


def draft_weights(cfg, seed=0) -> dict:
    """Random draft + shared tensors only (the 218m target is not needed here)."""
    from spel_mlx.layout import draft_specs

    rng = np.random.default_rng(seed)
    d, V = cfg.d_model, cfg.vocab
    out = {"tok_emb.weight": rng.standard_normal((V, d), dtype=np.float32),
           "final_norm.weight": np.ones(d, np.float32),
           "lm_head.weight": rng.standard_normal((V, d), dtype=np.float32) / np.float32(np.sqrt(d))}
    for s in draft_specs(cfg):
        if s.name.endswith("norm.weight"):
            a = np.ones(s.shape, np.float32)
        elif s.name.endswith("mixer.conv"):
            a = np.tile(np.float32([[0.1], [0.2], [0.7]]), (1, d))
        elif s.name.endswith("decay_logit"):
            a = rng.uniform(1, 4, s.shape).astype(np.float32)
        elif s.name.endswith("beta_logit"):
            a = rng.uniform(-1, 1, s.shape).astype(np.float32)
        else:
            a = rng.standard_normal(s.shape, dtype=np.float32) / np.float32(np.sqrt(s.shape[1]))
        out[s.name] = a
    return out


def bench_draft(quick: bool) -> list:
    from spel_mlx.native import cdraft as draft
    from spel_mlx.config import PRESETS

    rows = []
    for shape in ("21m", "218m"):
        cfg = PRESETS[shape].replace(max_seq=1024)
        weights = draft_weights(cfg)
        ntok = (64 if shape == "21m" else 16) * (1 if quick else 4)
        toks = np.random.default_rng(1).integers(0, cfg.vocab, ntok)
        variants = [(1, False), (2, False)] + ([(1, True)] if shape == "21m" else [])
        for threads, q8_head in variants:
            d = draft.CDraft(cfg, weights, threads=threads, q8_head=q8_head)
            packed = d.packed_bytes()
            walls, cpus = [], []
            for _ in range(3 if quick else 5):
                d.reset()
                d.step(int(toks[0]))
                t0, c0 = time.perf_counter(), time.thread_time()
                for t in toks[1:]:
                    d.step(int(t))
                walls.append((time.perf_counter() - t0) / (ntok - 1))
                cpus.append((time.thread_time() - c0) / (ntok - 1))
            r = {"name": f"draft-only {shape}" + (" q8-head" if q8_head else ""), "threads": threads,
                 "tok_s": 1 / _median(walls),
                 "ms_per_token": _median(walls) * 1e3, "kernel": d.kernel,
                 "packed_q8_bytes": packed["q8"], "packed_ternary_bytes": packed["ternary"]}
            if threads == 1:
                r["tok_s_cpu"] = 1 / _median(cpus)
            rows.append(r)
            d.close()
    return rows


def bench_target_token(quick: bool):
    """MLX target AR token time at the 21m shape (random weights), for c."""
    try:
        import mlx.core as mx
        from spel_mlx.config import PRESETS
        from spel_mlx.model import SpelModel, init_weights
    except Exception as e:  # the MLX model is another part of the project
        return {"name": "mlx target AR 21m", "status": "not available", "note": f"{type(e).__name__}: {e}"}
    cfg = PRESETS["21m"].replace(max_seq=1024)
    model = SpelModel.from_weights(cfg, init_weights(cfg, 0))
    state = model.new_state("target")
    toks = np.random.default_rng(2).integers(0, cfg.vocab, 32 if quick else 96)
    for t in toks[:4]:
        mx.eval(model.forward([int(t)], state))
        state.commit(1)
    t0, c0 = time.perf_counter(), time.process_time()
    for t in toks[4:]:
        mx.eval(model.forward([int(t)], state))
        state.commit(1)
    sec = (time.perf_counter() - t0) / (len(toks) - 4)
    cpu = (time.process_time() - c0) / (len(toks) - 4)   # all of MLX's threads
    return {"name": "mlx target AR 21m", "threads": 1, "tok_s": 1 / sec, "ms_per_token": sec * 1e3,
            "tok_s_cpu": 1 / cpu, "ms_per_token_cpu": cpu * 1e3}


def run(quick: bool = True) -> dict:
    rows = bench_gemv(quick) + bench_draft(quick)
    target = bench_target_token(quick)
    rows.append(target)
    if "ms_per_token" in target:
        for r in rows:
            if r["name"].startswith("draft-only 21m"):
                r["c_vs_mlx_target"] = r["ms_per_token"] / target["ms_per_token"]
                if "tok_s_cpu" in r:
                    r["c_vs_mlx_target_cpu"] = target["tok_s_cpu"] / r["tok_s_cpu"]
    return {"rows": rows}


def bench_metal_ternary(rows: int = 4096, cols: int = 1536, iters: int = 200, seed: int = 0) -> dict:
    """Median seconds per call of the custom ternary GEMV (Metal only) and of MLX's 2-bit
    affine quantized_matmul and FP32 matmul on the same ternary rows."""
    import mlx.core as mx
    from spel_mlx import quant
    from spel_mlx.metal.executors import metal_available
    from spel_mlx.metal.formats import mlx_affine_ternary_matmul, ternary_to_mlx_affine
    rng = np.random.default_rng(seed)
    t = rng.integers(-1, 2, size=(rows, cols)).astype(np.int8)
    s = rng.uniform(0.01, 0.05, size=rows).astype(np.float32)
    packed = quant.pack_ternary(t)
    cp = packed.shape[1] * 4
    x = rng.standard_normal(cols).astype(np.float32)
    xpad = np.zeros(cp, np.float32)
    xpad[:cols] = x
    wq, sg, bg = (mx.array(a) for a in ternary_to_mlx_affine(packed, s))
    wf = mx.array(t.astype(np.float32) * s[:, None])
    xm, xpm = mx.array(x), mx.array(xpad)

    def timed(fn):
        mx.eval(fn())
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            mx.eval(fn())
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    res = {"rows": rows, "cols": cols, "device": "gpu" if metal_available() else "cpu",
           "mlx_affine_2bit_s": timed(lambda: mlx_affine_ternary_matmul(xpm[None], wq, sg, bg)),
           "fp32_matmul_s": timed(lambda: wf @ xm)}
    if metal_available():
        from spel_mlx.model.metal_ops import MetalOps
        ops, wm, sm = MetalOps(), mx.array(packed), mx.array(s)
        res["spel_ternary_s"] = timed(lambda: ops.ternary_matmul(xm, wm, sm))
    return res


def format_metal_ternary(r: dict) -> str:
    macs = r["rows"] * r["cols"]
    lines = ["%-20s %9.1f us  %7.2f GMAC/s  (%s)" % (key[:-2], r[key] * 1e6, macs / r[key] / 1e9, r["device"])
             for key in ("spel_ternary_s", "mlx_affine_2bit_s", "fp32_matmul_s") if key in r]
    if "spel_ternary_s" not in r:
        lines.append("custom ternary kernel: not run (Metal unavailable)")
    return "\n".join(lines)


def format_table(rows) -> str:
    lines = [f"{'B1 / draft':<22}{'thr':>4}{'GMAC/s':>9}{'(cpu)':>8}{'GB/s':>8}{'us/GEMV':>9}{'x np':>7}"
             f"{'(cpu)':>7}"]
    for r in rows:
        if "gmac_s" in r:
            cpu = r.get("gmac_s_cpu")
            lines.append(f"{r['name']:<22}{r['threads']:>4}{r['gmac_s']:>9.2f}"
                         f"{(f'{cpu:.2f}' if cpu else '-'):>8}{r['weight_gb_s']:>8.2f}{r['us_per_gemv']:>9.1f}"
                         f"{r['x_numpy_fp32']:>7.2f}"
                         f"{(format(r['x_numpy_fp32_cpu'], '.2f') if 'x_numpy_fp32_cpu' in r else '-'):>7}")
    lines.append("")
    lines.append(f"{'draft / target token':<24}{'thr':>4}{'tok/s':>10}{'(cpu)':>10}{'ms/tok':>9}{'c':>8}"
                 f"{'c(cpu)':>8}")
    for r in rows:
        if "tok_s" in r:
            c = r.get("c_vs_mlx_target")
            cpu = r.get("tok_s_cpu")
            lines.append(f"{r['name']:<24}{r['threads']:>4}{r['tok_s']:>10.1f}"
                         f"{(f'{cpu:.1f}' if cpu else '-'):>10}{r['ms_per_token']:>9.3f}"
                         f"{(f'{c:.4f}' if c else '-'):>8}"
                         f"{(format(r['c_vs_mlx_target_cpu'], '.4f') if 'c_vs_mlx_target_cpu' in r else '-'):>8}")
        elif r.get("status"):
            lines.append(f"{r['name']:<22} {r['status']}: {r.get('note', '')}")
    return "\n".join(lines)


def write_json_atomic(path: str, obj):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".kernels-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats and tokens")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--metal-ternary", action="store_true",
                   help="only the Metal ternary GEMV against MLX's 2-bit quantized_matmul")
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=1536)
    p.add_argument("--iters", type=int, default=200)
    a = p.parse_args(argv)
    if a.metal_ternary:
        if a.rows < 1 or a.cols < 1 or a.iters < 1:
            print("error: --rows, --cols and --iters must be >= 1", file=sys.stderr)
            return 2
        from spel_mlx.model import describe
        print("kernels:", describe())
        print(format_metal_ternary(bench_metal_ternary(a.rows, a.cols, a.iters)))
        return 0
    try:
        res = run(quick=a.quick)
    except ImportError as e:
        print(f"bench.kernels: the C draft engine is not available: {e}", file=sys.stderr)
        return 2
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    res["machine"] = {"cpu_count": os.cpu_count(), "loadavg": load}
    print(format_table(res["rows"]))
    if load:
        print(f"\nload average during the run: {load[0]:.1f} on {os.cpu_count()} CPUs")
    if a.out:
        write_json_atomic(a.out, res)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
