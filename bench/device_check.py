"""The device check behind ``bench/device_check.sh OUTDIR [--dry-run]`` (docs/gpu.md).

On a bare GPU machine: stage the payload carried over one or more calls
(bench/device_payload.py), install MLX's CUDA build and the other wheels, build
spel-mlx there (the C draft, the fused CPU module), then within hard time limits
measure the B2 rows (v at M = 2..17) and B3 rows (AR, raw/governed speculation,
forced ceilings) with the target on the GPU and the C draft on the machine's CPU,
train the 21m shape (target + QAT ternary draft) from the carried corpus, report
its held-out loss and greedy alpha, and pack everything into a few files of OUTDIR.

``--dry-run`` runs the same steps on this machine's CPU in a tiny form (no install,
no build): the test suite's form.  Standard library only here: this runs before
MLX is installed.  Every measurement is a child process with its own time limit
(its whole process group is killed when it overruns), and OUTDIR/device_check.json
records every step's outcome even when later ones fail.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from bench import device_payload as payload  # noqa: E402  (standard library only)
from bench.common import ERROR, merge_runs, unavailable  # noqa: E402
from bench.device_pack import judgement, pack  # noqa: E402

SCHEMA = "spel-mlx-device-check/1"
STEPS = ("install", "build", "check", "bench", "train", "report")
PACK_RESERVE_S = 15
TINY = "d_model=64,n_layers=4,n_heads=2,head_dim=32,d_ff=128,vocab=2048,max_seq=256,draft_map=0:3"
JOB_DEFAULTS = {"level": "device", "run": 0, "runs": 1, "repeats": 1, "K": 4, "K_ceiling": 16,
                "b2_K": list(range(1, 17)), "prompt_len": 64, "warm": 8, "gen": 64, "threads": [1],
                "drafts": ["c"], "b2_repeats": 3, "peers_gen": 0, "targets": ["gpu"]}
# the default limits fit about 8.5 minutes of run time (docs/gpu.md has the budget)
MODES = {
    "device": {
        "budget_s": 510, "caps": {"install": 120, "build": 240, "check": 60, "bench": 150,
                                  "target": 180, "draft": 90, "export": 60, "report": 75},
        "jobs": [
            dict(regime="shipped", sections=["b2", "b3"], targets=["gpu", "cpu"], threads=[1, 2, 4, 6],
                 drafts=["c", "mlx"], b2_repeats=5, timeout=110),
            dict(regime="218m", sections=["b2"], b2_repeats=3, timeout=60),
            dict(regime="218m", sections=["b3"], warm=2, gen=32, threads=[1, 6], K_ceiling=None, timeout=60),
        ],
        "train": {"config": "vocab=2048", "target_min": 1.5, "draft_min": 0.5, "batch": 32, "seq": 256,
                  "target_args": ["--lr", "2e-3", "--warmup", "60", "--eval-every", "200",
                                  "--eval-tokens", "32768", "--ckpt-every", "200", "--log-every", "20"],
                  "draft_args": ["--lr", "1e-3", "--warmup", "20", "--eval-every", "100",
                                 "--eval-tokens", "16384", "--ckpt-every", "100", "--log-every", "20"]},
        "report_prompts": 8, "part_bytes": 15 * 2**20,
    },
    "dry-run": {
        "budget_s": 240, "caps": {"install": 10, "build": 10, "check": 60, "bench": 90,
                                  "target": 60, "draft": 60, "export": 60, "report": 60},
        "jobs": [dict(regime="tiny", sections=["b2", "b3"], targets=["gpu", "cpu"], prompt_len=16, warm=1,
                      gen=4, b2_K=[1, 2], b2_repeats=2, K=2, K_ceiling=3, timeout=80)],
        "train": {"config": TINY, "steps": (6, 4), "batch": 2, "seq": 32,
                  "target_args": ["--warmup", "2", "--eval-every", "3", "--eval-tokens", "128",
                                  "--ckpt-every", "3", "--log-every", "2"],
                  "draft_args": ["--warmup", "2", "--eval-every", "2", "--eval-tokens", "128",
                                 "--ckpt-every", "2", "--log-every", "2"]},
        "report_prompts": 1, "part_bytes": 512 * 2**10,
    },
}


class Check:
    """One run of the check: its deadline, its log, and the summary it builds."""

    def __init__(self, out: str, dry: bool, budget_s: float, python: str):
        self.out, self.dry, self.python = out, dry, python
        self.mode = MODES["dry-run" if dry else "device"]
        self.t0, self.budget = time.monotonic(), budget_s
        self.work = os.environ.get("SPEL_DC_WORK") or (
            tempfile.mkdtemp(prefix="spel-device-") if dry else "/tmp/spel-device-work")
        os.makedirs(self.work, exist_ok=True)
        self.log_path = os.path.join(self.work, "device_check.log")
        self.log = open(self.log_path, "a", encoding="utf-8", errors="replace")
        self.summary = {"schema": SCHEMA, "mode": "dry-run" if dry else "device", "budget_s": budget_s,
                        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": []}
        self.corpus = None

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def say(self, line: str) -> None:
        stamp = f"[{time.monotonic() - self.t0:6.1f}s] "
        print(stamp + line, flush=True)
        self.log.write(stamp + line + "\n")
        self.log.flush()

    def run(self, label: str, cmd: list, cap: float, env: dict | None = None) -> tuple:
        """(return code or "timeout", output tail) of one child process under
        min(cap, what the budget leaves); its process group is killed at the limit."""
        limit = min(cap, self.left() - PACK_RESERVE_S)
        if limit < 3:
            return "timeout", "no time left in the budget"
        self.say(f"$ {' '.join(cmd)}   (limit {limit:.0f} s)")
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
        tail = []

        def pump():
            for line in proc.stdout:
                self.log.write(f"  {label}| {line}")
                tail.append(line)
                del tail[:-40]
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=grace)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            rc = "timeout"
        reader.join(timeout=5)
        self.log.flush()
        self.say(f"  -> {label}: {'timed out after %.0f s' % limit if rc == 'timeout' else 'exit %s' % rc}")
        return rc, "".join(tail)

    def step(self, name: str, fn) -> bool:
        t = time.monotonic()
        rec = {"name": name, "status": "ok", "note": ""}
        self.say(f"== {name} ({self.left():.0f} s left)")
        try:
            note = fn()
            rec["note"] = note or ""
            if isinstance(note, str) and note.startswith("skipped"):
                rec["status"] = "skipped"
        except StepFailed as e:
            rec.update(status=e.status, note=str(e))
        except Exception as e:  # noqa: BLE001  (recorded; the later steps and the pack still run)
            rec.update(status="failed", note=f"{type(e).__name__}: {e}")
        rec["seconds"] = round(time.monotonic() - t, 1)
        self.summary["steps"].append(rec)
        self.say(f"   {name}: {rec['status']}{': ' + rec['note'] if rec['note'] else ''}")
        return rec["status"] in ("ok", "skipped")

    def save(self) -> None:
        self.summary["wall_s"] = round(time.monotonic() - self.t0, 1)
        with open(os.path.join(self.work, "summary.json"), "w") as f:
            json.dump(self.summary, f, indent=1, default=str)


class StepFailed(RuntimeError):
    def __init__(self, msg: str, status: str = "failed"):
        super().__init__(msg)
        self.status = status


def _must(rc, tail: str, what: str) -> None:
    if rc == "timeout":
        raise StepFailed(f"{what} timed out", "timeout")
    if rc != 0:
        raise StepFailed(f"{what} failed (exit {rc}): {tail.strip().splitlines()[-1] if tail.strip() else ''}")


# --- the steps ----------------------------------------------------------------------------
def stage_payload(ck: Check, carried: str, stage_dir: str) -> str:
    """Keep what this call carried; once every call's pieces are there, rebuild the
    wheels and the corpus."""
    st = payload.stage(carried, stage_dir)
    ck.summary["payload"] = st
    if st["calls"] is None:
        return "none carried or staged"
    if not st["complete"]:
        raise StepFailed(f"still missing the pieces of call(s) {st['missing_calls']}", "incomplete")
    got = payload.assemble(stage_dir, os.path.join(ck.work, "payload"))
    st.update(got)
    ck.corpus = got["corpus"]
    here = os.path.join(REPO, "data", "corpus")
    if ck.corpus and not ck.dry and not os.path.exists(here):   # the benchmark's held-out prompts
        shutil.copytree(ck.corpus, here)
    return f"{len(got['wheels'])} wheels, corpus {'yes' if ck.corpus else 'no'}"


def install(ck: Check) -> str:
    wheels = ck.summary.get("payload", {}).get("wheels") or []
    paths = [os.path.join(ck.work, "payload", "wheels", w) for w in wheels]
    if ck.dry:
        return f"skipped (dry run): would install {', '.join(wheels) or 'nothing'}"
    if not paths:
        return "skipped: no wheels carried (a warm machine keeps the last install)"
    rc, tail = ck.run("pip", [ck.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                              "--no-cache-dir", "--force-reinstall", *paths], ck.mode["caps"]["install"])
    _must(rc, tail, "pip install")
    return f"installed {', '.join(wheels)}"


def _cudnn_prefixes() -> str:
    """Folders holding include/cudnn.h under the environment's nvidia packages: MLX's
    CMake config looks for cuDNN there through CMAKE_PREFIX_PATH."""
    import site
    dirs = []
    for sp in site.getsitepackages():
        dirs += [os.path.dirname(os.path.dirname(h)) for h in glob.glob(os.path.join(sp, "nvidia", "**", "cudnn.h"),
                                                                        recursive=True)]
    return os.pathsep.join(dict.fromkeys(dirs))


def build(ck: Check) -> str:
    if ck.dry:
        return "skipped (dry run): the extensions built here are used"
    env = {"CMAKE_PREFIX_PATH": _cudnn_prefixes()}
    rc, tail = ck.run("build", [ck.python, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                                "--no-index", "-e", REPO], ck.mode["caps"]["build"], env)
    _must(rc, tail, "pip install -e . (C draft, fused CPU module)")
    return "built"


CHECK_CODE = r"""
import json, time, numpy as np, spel_mlx, mlx.core as mx
from spel_mlx.config import resolve_config
from spel_mlx.model import SpelModel, backends, cpu_ops, init_weights
from spel_mlx.native import clib
from bench.common import machine_info
ok, why = cpu_ops.status()
gpu = backends.gpu_backend()
info = {"mlx": mx.__version__, "gpu_backend": gpu, "default_device": str(mx.default_device()),
        "no_gpu_reason": None if gpu else backends.no_gpu_reason(), "cpu_ops": ok, "cpu_ops_note": why,
        "c_draft": clib.available(), "ops": backends.describe(), "machine": machine_info()}
if gpu:   # the same M=5 pass on both devices: the GPU path agrees with the CPU one
    cfg = resolve_config(overrides="d_model=64,n_layers=4,n_heads=2,head_dim=32,d_ff=128,vocab=256,max_seq=128,draft_map=0:3")
    model = SpelModel.from_weights(cfg, init_weights(cfg, seed=3))
    out = {}
    for dev in ("cpu", "gpu"):
        with backends.device_scope(dev):
            t = time.perf_counter()
            out[dev] = np.array(model.forward([5, 17, 3, 9, 200], model.new_state()))
            info[dev + "_first_pass_s"] = round(time.perf_counter() - t, 3)
    info["gpu_ops"] = type(model.ops_for("gpu")).__name__
    info["gpu_vs_cpu_max_abs"] = float(np.abs(out["gpu"] - out["cpu"]).max())
print("CHECK " + json.dumps(info))
"""


def check(ck: Check) -> str:
    rc, tail = ck.run("check", [ck.python, "-c", CHECK_CODE], ck.mode["caps"]["check"])
    _must(rc, tail, "the environment check")
    info = json.loads(next(ln for ln in tail.splitlines() if ln.startswith("CHECK "))[6:])
    smi = shutil.which("nvidia-smi")
    if smi:
        r = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version,clocks.sm",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = r.stdout.strip() or r.stderr.strip()
    ck.summary["machine"] = info
    if not ck.dry and not info["gpu_backend"]:
        raise StepFailed(f"MLX sees no GPU: {info['no_gpu_reason']}")
    if info.get("gpu_vs_cpu_max_abs", 0.0) > 1e-2:
        raise StepFailed(f"the GPU pass disagrees with the CPU pass (max |diff| {info['gpu_vs_cpu_max_abs']:.3g})")
    return (f"MLX {info['mlx']}, GPU {info['gpu_backend'] or 'none'}"
            + (f" (agrees with the CPU to {info['gpu_vs_cpu_max_abs']:.2g})" if "gpu_vs_cpu_max_abs" in info else "")
            + f", fused CPU module {'yes' if info['cpu_ops'] else 'no'}, C draft {'yes' if info['c_draft'] else 'NO'}")


def bench(ck: Check) -> str:
    jobs, rows, metas = [], [], []
    doc_path = os.path.join(ck.work, "benchmarks.json")
    deadline = time.monotonic() + min(ck.mode["caps"]["bench"], ck.left() - PACK_RESERVE_S)
    for spec in ck.mode["jobs"]:
        job = {**JOB_DEFAULTS, **spec}
        jobs.append(job)
        jpath, rpath = os.path.join(ck.work, f"job{len(jobs)}.json"), os.path.join(ck.work, f"rows{len(jobs)}.json")
        with open(jpath, "w") as f:
            json.dump(job, f)
        cap = min(job["timeout"], deadline - time.monotonic())
        rc, tail = ck.run(f"bench{len(jobs)}", [ck.python, "-m", "bench", "--worker", jpath, "--worker-out", rpath],
                          cap, {"OPENBLAS_NUM_THREADS": "1"})
        if rc == 0 and os.path.isfile(rpath):
            with open(rpath) as f:
                res = json.load(f)
        else:
            why = "timed out" if rc == "timeout" else f"exit {rc}: {tail.strip()[-300:]}"
            res = {"rows": [unavailable(s, f"{s} section", f"device check job {why}", status=ERROR,
                                        regime=job["regime"]) for s in job["sections"]],
                   "meta": {"job": job, "error": why}}
        rows += res["rows"]
        metas.append(res["meta"])
        _write_bench_doc(doc_path, jobs, rows, metas, ck)
    gpu_ok = sum(1 for r in rows if r.get("status") == "ok" and "mlx-gpu" in (r.get("placement") or ""))
    errors = sum(1 for r in rows if r.get("status") == "error")
    ck.summary["bench"] = {"file": "benchmarks.json", "rows": len(rows), "gpu_rows_ok": gpu_ok, "errors": errors}
    return f"{len(rows)} rows, {gpu_ok} GPU rows measured, {errors} errors"


def _write_bench_doc(path, jobs, rows, metas, ck) -> None:
    """The rows as a results document of ``python -m bench`` (render it with
    ``python -m bench --from-json``)."""
    regimes = {}
    for m in metas:
        if "regime" in m:
            regimes.setdefault(m["regime"]["name"], m["regime"])
    names = list(dict.fromkeys(j["regime"] for j in jobs))
    params = {"regimes": names, "runs": 1, "K": jobs[0]["K"], "K_ceiling": jobs[0]["K_ceiling"],
              "timeout": max(j["timeout"] for j in jobs), "sections": sorted({s for j in jobs for s in j["sections"]}),
              "b2_K": jobs[0]["b2_K"], "regime_notes": ["device check: " + ck.summary["mode"]],
              "per_regime": {n: next(j for j in jobs if j["regime"] == n) for n in names}}
    doc = {"schema": "spel-mlx-bench/1", "level": "device", "params": params,
           "created": ck.summary["created"], "wall_s": round(time.monotonic() - ck.t0, 1),
           "machine": ck.summary.get("machine", {}).get("machine", {}), "regimes": regimes,
           "rows": merge_runs([rows]), "process_meta": metas}
    with open(path, "w") as f:
        json.dump(doc, f, default=str)


def _corpus(ck: Check) -> str:
    if ck.corpus:
        return ck.corpus
    here = os.path.join(REPO, "data", "corpus")
    if os.path.isfile(os.path.join(here, "heldout.txt")):
        return here
    raise StepFailed("no corpus: carry it in the payload (bench/device_wheels.sh packs data/corpus)")


def train(ck: Check) -> str:
    t, caps = ck.mode["train"], ck.mode["caps"]
    corpus, runs = _corpus(ck), os.path.join(ck.work, "runs")
    tok = os.path.join(REPO, "spel_mlx", "assets", "tokenizer.model")
    common = ["--data", corpus, "--tokenizer", tok, "--batch", str(t["batch"]), "--seq", str(t["seq"])]
    length = (lambda i: ["--steps", str(t["steps"][i])]) if "steps" in t else \
        (lambda i: ["--budget-min", str(float(os.environ.get(("SPEL_DC_TARGET_MIN", "SPEL_DC_DRAFT_MIN")[i])
                                               or (t["target_min"], t["draft_min"])[i]))])
    target, draft, model = (os.path.join(runs, n) for n in ("target", "draft", "model"))
    config = os.environ.get("SPEL_DC_CONFIG") or t["config"]
    ck.summary["train"] = {"config": config, "batch": t["batch"], "seq": t["seq"]}
    py = [ck.python, "-m", "spel_mlx.train"]
    rc, tail = ck.run("target", py + ["target", "--run", target, "--config", config, *common, *length(0),
                                      *t["target_args"]], caps["target"])
    ck.summary["train"]["target"] = _run_events(target)
    if not os.path.isfile(os.path.join(target, "ckpt", "state.json")):
        _must(rc if rc != 0 else 1, tail, "target training (no checkpoint)")
    rc, tail = ck.run("draft", py + ["draft", "--run", draft, "--init", target, *common, *length(1),
                                     *t["draft_args"]], caps["draft"])
    ck.summary["train"]["draft"] = _run_events(draft)
    if not os.path.isfile(os.path.join(draft, "ckpt", "state.json")):
        _must(rc if rc != 0 else 1, tail, "draft training (no checkpoint)")
    rc, tail = ck.run("export", py + ["export", "--run", draft, "--out", model, "--data", corpus, "--force"], caps["export"])
    _must(rc, tail, "export")
    ck.summary["train"]["model_dir"] = model
    tr, dr = ck.summary["train"]["target"], ck.summary["train"]["draft"]
    return (f"target {tr.get('step')} steps, held-out {tr.get('heldout_nats')} nats/token; "
            f"draft {dr.get('step')} steps, KL {dr.get('heldout_kl')}")


def _run_events(run: str) -> dict:
    """The run's last step/eval figures and its budget event, from log.jsonl."""
    out = {"evals": []}
    try:
        with open(os.path.join(run, "log.jsonl")) as f:
            for line in f:
                rec = json.loads(line)
                ev = rec.get("event")
                if ev == "step":
                    out.update(step=rec["step"], loss=rec["loss"], tok_s=rec.get("tok_s"))
                elif ev == "eval":
                    out["evals"].append({k: rec[k] for k in rec if k not in ("event", "time")})
                    out.update({k: rec[k] for k in ("heldout_nats", "heldout_kl", "heldout_top1_agree") if k in rec})
                elif ev in ("budget", "start", "done"):
                    out[ev] = {k: v for k, v in rec.items() if k not in ("event", "model", "train")}
    except (OSError, ValueError):
        pass
    return out


def report(ck: Check) -> str:
    model = ck.summary.get("train", {}).get("model_dir")
    if not model or not os.path.isdir(model):
        raise StepFailed("no exported model to report on", "skipped")
    out = os.path.join(ck.work, "report.json")
    rc, tail = ck.run("report", [ck.python, "-m", "spel_mlx.train_report", "--checkpoint", model,
                                 "--data", _corpus(ck), "--prompts", str(ck.mode["report_prompts"]),
                                 "--skip", "samples", "--out", out], ck.mode["caps"]["report"])
    rep = {}
    if os.path.isfile(out):
        with open(out) as f:
            rep = json.load(f)
    else:    # cut short: keep the parts it printed
        for line in tail.splitlines():
            if line.startswith("{"):
                part = json.loads(line)
                rep["alpha" if "alpha" in part else "heldout"] = part
    ck.summary["report"] = rep
    _must(rc, tail, "train_report")
    return "held-out and alpha measured"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench/device_check.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--dry-run", action="store_true", help="this machine's CPU, tiny shapes, no install")
    ap.add_argument("--budget-s", type=float, default=None, help="run time of the whole check (default: 510, "
                                                                  "dry run 240; SPEL_DC_BUDGET_S)")
    ap.add_argument("--only", default="", help="comma list of steps to run (of %s)" % ",".join(STEPS))
    a = ap.parse_args(argv)
    mode = MODES["dry-run" if a.dry_run else "device"]
    budget = a.budget_s or float(os.environ.get("SPEL_DC_BUDGET_S") or mode["budget_s"])
    only = [s for s in a.only.split(",") if s]
    bad = [s for s in only if s not in STEPS]
    if bad:
        print(f"device_check: unknown step {bad[0]!r} (steps: {', '.join(STEPS)})", file=sys.stderr)
        return 2
    os.makedirs(a.outdir, exist_ok=True)
    ck = Check(a.outdir, a.dry_run, budget, os.environ.get("SPEL_DC_PYTHON") or sys.executable)
    carried = os.environ.get("SPEL_DC_CARRIED") or os.path.join(REPO, ".whl")
    stage_dir = os.environ.get("SPEL_DC_STAGE") or os.path.join(
        tempfile.gettempdir(), "spel-device-stage" + ("-dry" if a.dry_run else ""))
    ck.say(f"device check ({ck.summary['mode']}): budget {budget:.0f} s, work {ck.work}, out {a.outdir}")
    payload_ok = ck.step("payload", lambda: stage_payload(ck, carried, stage_dir))
    pl = ck.summary.get("payload", {})
    if pl.get("calls") and not pl.get("complete"):
        nxt = pl["missing_calls"][0]
        ck.say(f"PAYLOAD INCOMPLETE: {pl['calls'] - len(pl['missing_calls'])} of {pl['calls']} calls staged in "
               f"{stage_dir}; now run the same command carrying .whl/call{nxt}")
        ck.summary["next"] = f"carry .whl/call{nxt}"
        ck.save()
        pack(ck.summary, a.outdir, None, ck.log_path, ck.mode["part_bytes"], None)
        return 3
    # a damaged payload, no MLX (install) or no GPU (check) ends the check; a failed
    # build leaves the source tree's pure-Python package, without the parts it could not build
    for name, fn in (("install", install), ("build", build), ("check", check)):
        if not payload_ok or (not only or name in only or name == "check") and \
                not ck.step(name, lambda fn=fn: fn(ck)) and name != "build":
            break
    else:
        for name, fn in (("bench", bench), ("train", train), ("report", report)):
            if not only or name in only:
                ck.step(name, lambda fn=fn: fn(ck))
    model_dir = ck.summary.get("train", {}).get("model_dir")
    ck.summary["judgement"] = judgement(ck.summary, model_dir)
    ck.save()
    files = pack(ck.summary, a.outdir, model_dir, ck.log_path, ck.mode["part_bytes"],
                 os.path.join(ck.work, "benchmarks.json"))
    ck.say("wrote " + ", ".join(files))
    if a.dry_run and not os.environ.get("SPEL_DC_WORK"):
        shutil.rmtree(ck.work, ignore_errors=True)
    return 0 if all(s["status"] in ("ok", "skipped") for s in ck.summary["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
