"""``python -m bench``: B1/B2/B3 of the original SPEL, peers, cost model, report.

The parent process only orchestrates: every measurement runs in a fresh worker process
(``python -m bench --worker JOB.json --worker-out ROWS.json``), so a crash in one
section (the C draft, say) becomes an error row instead of ending the run, and headline
rows are measured over several independent process runs (``--runs``), as the original
reported ranges over process runs. Workers run one after another: they would distort
each other's timings if they shared the cores.

Levels: ``--smoke`` (a tiny synthetic shape; the test suite's form), ``--quick`` (both
regimes, few tokens, under 3 minutes on a small CPU machine), default full.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from . import common
from .common import ERROR, REPO, unavailable
from .protocol import LEVELS, SECTIONS, auto_threads, build_jobs
from .regimes import regime_config, resolve_regimes
from .worker import run_worker


def spawn(job: dict, timeout: float, log) -> dict:
    """Run one job in a fresh process; a crash or timeout becomes an error row."""
    with tempfile.TemporaryDirectory(prefix="spel-bench-") as tmp:
        job_path, out_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "rows.json")
        common.write_json_atomic(job_path, job)
        cmd = [sys.executable, "-m", "bench", "--worker", job_path, "--worker-out", out_path]
        env = dict(os.environ)
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        # the target path is single-threaded, as in the original (SPEC 8 / seed 1.4): and a
        # threaded OpenBLAS GEMM on a busy machine spins its workers (10x slower batches)
        env.setdefault("OPENBLAS_NUM_THREADS", str(job.get("blas_threads", 1)))
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=timeout)
            rc, err = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, err = "timeout", (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        wall = time.perf_counter() - t0
        if rc == 0 and os.path.isfile(out_path):
            with open(out_path) as f:
                res = json.load(f)
            res["meta"]["process_wall_s"] = round(wall, 3)
            return res
        tail = " | ".join(err.strip().splitlines()[-3:]) if err else ""
        why = (f"worker timed out after {timeout:.0f} s" if rc == "timeout"
               else f"worker exited with code {rc}") + (f": {tail}" if tail else "")
        log(f"  ! {why}")
        rows = [unavailable(s, f"{s} section", why, status=ERROR, regime=job["regime"])
                for s in job["sections"]]
        return {"rows": rows, "meta": {"job": job, "error": why, "process_wall_s": round(wall, 3)}}


def run_all(level: str, params: dict, log=print) -> dict:
    jobs = build_jobs(level, params)
    t0 = time.perf_counter()
    per_run, metas = {}, []
    for n, job in enumerate(jobs, 1):
        log(f"[{n}/{len(jobs)}] run {job['run'] + 1}/{params['runs']} regime {job['regime']}: "
            f"{', '.join(job['sections'])}")
        res = spawn(job, params["timeout"], log)
        log(f"  done in {res['meta'].get('process_wall_s', 0):.1f} s")
        per_run.setdefault(job["run"], []).extend(res["rows"])
        metas.append(res["meta"])
    rows = common.merge_runs([per_run[k] for k in sorted(per_run)])
    regimes = {}
    for m in metas:
        if "regime" in m:
            regimes.setdefault(m["regime"]["name"], m["regime"])
    return {"schema": common.SCHEMA, "level": level, "params": params,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "wall_s": round(time.perf_counter() - t0, 1), "machine": common.machine_info(),
            "regimes": regimes, "rows": rows, "process_meta": metas}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    lv = p.add_mutually_exclusive_group()
    lv.add_argument("--quick", action="store_true", help="short run (under 3 minutes)")
    lv.add_argument("--smoke", action="store_true", help="tiny synthetic shape (the test form)")
    p.add_argument("--out", help="output folder (default: docs/ for a full run, "
                                 "a temporary folder for --quick/--smoke)")
    p.add_argument("--runs", type=int, help="process runs for headline rows")
    p.add_argument("--regimes", help="comma list of shipped,21m,218m,tiny")
    p.add_argument("--sections", help="comma list of " + ",".join(SECTIONS))
    p.add_argument("--threads", help="draft thread counts, comma list (1..6)")
    p.add_argument("--K", type=int, help="speculation depth for B3 (1..16)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--from-json", help="only regenerate the report from results JSON file(s); "
                                       "a comma list combines runs of different regimes")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def level_params(args) -> tuple:
    level = "smoke" if args.smoke else "quick" if args.quick else "full"
    params = json.loads(json.dumps(LEVELS[level]))
    if args.runs is not None:
        if not 1 <= args.runs <= 20:
            raise ValueError(f"--runs {args.runs}: must be in 1..20")
        params["runs"] = args.runs
        params.setdefault("override", {})["runs"] = args.runs
    if args.regimes:
        regs = [r.strip() for r in args.regimes.split(",") if r.strip()]
        if not regs:
            raise ValueError(f"--regimes: no regime given in {args.regimes!r}")
        for r in regs:
            regime_config(r)
        params["regimes"] = regs
    params["regimes"], params["regime_notes"] = resolve_regimes(params["regimes"])
    if args.sections:
        secs = [s.strip() for s in args.sections.split(",") if s.strip()]
        if not secs:
            raise ValueError(f"--sections: no section given in {args.sections!r}")
        bad = [s for s in secs if s not in SECTIONS]
        if bad:
            raise ValueError(f"--sections: unknown {bad[0]!r} (known: {', '.join(SECTIONS)})")
        params["sections"] = secs
        params["only_sections"] = True     # the report leaves the others out
    if args.threads:
        try:
            th = [int(t) for t in args.threads.split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"--threads {args.threads!r}: expected a comma list of integers") from None
        if not th or any(not 1 <= t <= 6 for t in th):
            raise ValueError(f"--threads {args.threads!r}: each must be in 1..6")
        params.setdefault("override", {})["threads"] = th
    # resolve "auto" here so the results JSON records the thread counts that ran
    for proto in params["per_regime"].values():
        if proto.get("threads") == "auto":
            proto["threads"] = auto_threads()
    if args.K is not None:
        if not 1 <= args.K <= 16:
            raise ValueError(f"--K {args.K}: must be in 1..16")
        params["K"] = args.K
    return level, params


def read_results(path: str) -> dict:
    try:
        with open(path) as f:
            results = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a results JSON (line {e.lineno}: {e.msg})") from None
    except UnicodeDecodeError:  # a binary file (e.g. a checkpoint) given by mistake
        raise ValueError(f"{path}: not a results JSON (not UTF-8 text)") from None
    if not isinstance(results, dict) or results.get("schema") != common.SCHEMA:
        raise ValueError(f"{path}: not a {common.SCHEMA} results file")
    return results


def combine_results(parts: list) -> dict:
    """One results document from runs of different regimes (``--from-json a.json,b.json``):
    rows of a regime come from the first part that has it; B1 from the first part with B1."""
    first = parts[0]
    out = json.loads(json.dumps(first))
    seen = set(first["params"]["regimes"])
    has_b1 = any(r["section"] == "b1" for r in first["rows"])
    for part in parts[1:]:
        if part["level"] != first["level"]:
            raise ValueError(f"cannot combine a {part['level']} run with a {first['level']} run")
        new = [g for g in part["params"]["regimes"] if g not in seen]
        seen.update(new)
        out["params"]["regimes"] += new
        for g in new:
            if g in part["params"].get("per_regime", {}):
                out["params"]["per_regime"][g] = part["params"]["per_regime"][g]
            if g in part.get("regimes", {}):
                out["regimes"][g] = part["regimes"][g]
        out["rows"] += [r for r in part["rows"]
                        if r.get("regime") in new or (r["section"] == "b1" and not has_b1)]
        has_b1 = has_b1 or any(r["section"] == "b1" for r in part["rows"])
        out["params"]["regime_notes"] = list(dict.fromkeys(
            out["params"].get("regime_notes", []) + part["params"].get("regime_notes", [])))
        out["process_meta"] += part.get("process_meta", [])
        out["wall_s"] = round(out["wall_s"] + part["wall_s"], 1)
    return out


def check_writable(folder: str) -> None:
    """Fail before measuring, not after, when the report cannot be written."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
    except OSError as e:
        raise OSError(f"output folder {folder}: cannot write there ({e.strerror or e})") from None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        with open(args.worker) as f:
            job = json.load(f)
        res = run_worker(job)
        common.write_json_atomic(args.worker_out, res)
        return 0
    try:
        from . import report
        if args.from_json:
            paths = [p for p in args.from_json.split(",") if p.strip()]
            parts = [read_results(p) for p in paths]
            results = combine_results(parts) if len(parts) > 1 else parts[0]
            out = args.out or os.path.dirname(os.path.abspath(paths[0]))
            if len(parts) > 1:
                common.write_json_atomic(os.path.join(out, "benchmarks.json"), results)
        else:
            level, params = level_params(args)
            out = args.out or (os.path.join(REPO, "docs") if level == "full"
                               else os.path.join(tempfile.gettempdir(), f"spel-bench-{level}"))
            check_writable(out)
            log = (lambda s: print(s, file=sys.stderr, flush=True))
            log(f"spel-mlx bench ({level}): regimes {', '.join(params['regimes'])}, "
                f"{params['runs']} process runs; output in {out}")
            results = run_all(level, params, log)
            common.write_json_atomic(os.path.join(out, "benchmarks.json"), results)
        paths = report.write_report(results, out, plots=not args.no_plots)
        for p in paths:
            print(p)
        errors = [r for r in results["rows"] if r["status"] == ERROR]
        if errors:
            print(f"{len(errors)} row(s) failed; see the report's notes", file=sys.stderr)
        return 0
    except (ValueError, OSError) as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a bug in the report must not end in a traceback
        print(f"bench: internal error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
