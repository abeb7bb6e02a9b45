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
import traceback

from . import common
from .common import ERROR, NOT_AVAILABLE, SKIPPED, make_row, unavailable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Per level: what runs, and the protocol of each regime (prompt tokens, warm tokens,
# generated tokens, draft threads, draft kinds, B2 repeats, peer tokens). The 218m
# shape runs fewer tokens: each of its target tokens costs ~10x a 21m one.
LEVELS = {
    # smoke leaves B1 out: bench/kernels.py has no form small enough for the test suite
    "smoke": {"regimes": ["tiny"], "runs": 2, "K": 4, "K_ceiling": None, "timeout": 120,
              "sections": ["b2", "b3", "placement", "peers"], "b2_K": [1, 2, 4],
              "per_regime": {"tiny": {"prompt_len": 16, "warm": 2, "gen": 8, "threads": [1, 2],
                                      "drafts": ["c", "mlx"], "b2_repeats": 3, "peers_gen": 8}}},
    "quick": {"regimes": ["shipped", "218m"], "runs": 2, "K": 4, "K_ceiling": None, "timeout": 240,
              "sections": ["b1", "b2", "b3", "placement", "peers"], "b2_K": [1, 2, 4, 8, 16],
              "per_regime": {"shipped": {"prompt_len": 32, "warm": 4, "gen": 24, "threads": "auto",
                                         "drafts": ["c", "mlx"], "b2_repeats": 3, "peers_gen": 16},
                             "218m": {"prompt_len": 12, "warm": 2, "gen": 6, "threads": "auto",
                                      "drafts": ["c"], "b2_repeats": 2, "peers_gen": 0,
                                      "runs": 1, "b2_K": [1, 4, 16]}}},
    # full: the original's decode protocol (64-token prompt, 8 warm tokens, 64 generated)
    "full": {"regimes": ["shipped", "21m", "218m"], "runs": 3, "K": 4, "K_ceiling": 16, "timeout": 600,
             "sections": ["b1", "b2", "b3", "placement", "peers"], "b2_K": [1, 2, 4, 8, 16],
             "per_regime": {"shipped": {"prompt_len": 64, "warm": 8, "gen": 64, "threads": "auto",
                                        "drafts": ["c", "mlx"], "b2_repeats": 5, "peers_gen": 64},
                            "21m": {"prompt_len": 64, "warm": 8, "gen": 64, "threads": "auto",
                                    "drafts": ["c", "mlx"], "b2_repeats": 5, "peers_gen": 64},
                            "218m": {"prompt_len": 64, "warm": 8, "gen": 64, "threads": "auto",
                                     "drafts": ["c"], "b2_repeats": 3, "peers_gen": 16}}},
}
DEFAULT_PROTOCOL = {"prompt_len": 32, "warm": 4, "gen": 16, "threads": "auto", "drafts": ["c", "mlx"],
                    "b2_repeats": 3, "peers_gen": 16}
PLACEMENT_ALPHA = 0.6  # the projected figure of the calibration table (ranking is alpha-free)
SECTIONS = ("b1", "b2", "b3", "placement", "peers")
# sections measured once (in the first process run) rather than in every run
ONCE = ("b1", "peers")

REGIME_LABELS = {
    "shipped": "the shipped trained checkpoint (or the one SPEL_WEIGHTS names)",
    "21m": "21m shape (the original's default)",
    "218m": "218m shape, synthetic random weights (systems behaviour only)",
    "tiny": "tiny shape, synthetic random weights (smoke test only)",
}
SHAPE_FIELDS = ("d_model", "n_layers", "n_heads", "head_dim", "d_ff", "attn_period")


# --------------------------------------------------------------------------- regimes

def regime_config(name: str):
    from spel_mlx.config import PRESETS, ModelConfig
    if name == "shipped":
        return PRESETS["21m"]  # its stand-in shape when no checkpoint is installed
    if name == "tiny":
        return ModelConfig(d_model=64, n_layers=4, n_heads=2, head_dim=32, d_ff=128,
                           max_seq=256, draft_map=(0, 3))
    if name in PRESETS:
        return PRESETS[name]
    raise ValueError(f"unknown regime {name!r} (known: shipped, 21m, 218m, tiny)")


def shipped_checkpoint_dir() -> str:
    import spel_mlx
    return os.path.join(os.path.dirname(os.path.abspath(spel_mlx.__file__)), "assets", "default")


def synthetic_weights(cfg, seed: int = 0) -> dict:
    """Random weights for a systems-only regime, drawn tensor by tensor exactly as
    ``python -m spel_mlx.synth`` draws them (same seed -> same model as its file)."""
    from spel_mlx.layout import tensor_specs
    try:
        from spel_mlx.synth import synth_tensor
    except ImportError:  # older trees: the model's own initialiser (same scales)
        from spel_mlx.model import init_weights
        return init_weights(cfg, seed=seed)
    return {spec.name: synth_tensor(spec, seed, i) for i, spec in enumerate(tensor_specs(cfg))}


def trained_checkpoint() -> tuple:
    """(Checkpoint, None) for the shipped default (or $SPEL_WEIGHTS), else (None, reason)."""
    try:
        from spel_mlx.checkpoints import load_checkpoint
        return load_checkpoint(None), None
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


def same_shape(a, b) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in SHAPE_FIELDS)


def shape_text(cfg) -> str:
    return (f"d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, d_ff {cfg.d_ff}, "
            f"vocab {cfg.vocab}, {cfg.target_params() / 1e6:.2f}M target parameters")


def resolve_regimes(regimes: list) -> tuple:
    """(regimes, notes): the 21m row is left out when it would repeat the shipped one
    (the shipped checkpoint has the 21m shape, or there is none and its stand-in is 21m)."""
    if "shipped" not in regimes or "21m" not in regimes:
        return regimes, []
    ck, why = trained_checkpoint()
    if ck is None:
        return [r for r in regimes if r != "21m"], [
            "21m: not run separately: no trained checkpoint, so the shipped regime already "
            "runs the 21m shape with synthetic weights"]
    if same_shape(ck.cfg, regime_config("21m")):
        return [r for r in regimes if r != "21m"], [
            "21m: not run separately: the shipped checkpoint has the 21m shape"]
    return regimes, []


def load_regime(name: str) -> dict:
    """cfg, weights, and labels saying where the weights came from."""
    cfg = regime_config(name)
    if name in ("shipped", "21m"):
        ck, why = trained_checkpoint()
        if ck is not None and (name == "shipped" or same_shape(ck.cfg, cfg)):
            src = os.path.relpath(ck.source, REPO) if ck.source.startswith(REPO) else ck.source
            tok = os.path.join(ck.source, "tokenizer.model") if os.path.isdir(ck.source) else None
            return {"name": name, "cfg": ck.cfg, "weights": ck.weights, "systems_only": False,
                    "weights_source": f"trained checkpoint {src} ({ck.format}, stored "
                                      f"{ck.stored_dtype}; {shape_text(ck.cfg)})",
                    "tokenizer": tok if tok and os.path.isfile(tok) else None,
                    "label": REGIME_LABELS[name] if name == "shipped" else
                    "21m shape, the shipped trained checkpoint"}
        if name == "shipped":
            return {"name": name, "cfg": cfg, "weights": synthetic_weights(cfg), "systems_only": True,
                    "weights_source": "synthetic random weights: no trained checkpoint could be "
                                      f"loaded ({why})",
                    "label": "no shipped checkpoint: the 21m shape with synthetic weights stands "
                             "in (systems behaviour only)"}
        return {"name": name, "cfg": cfg, "weights": synthetic_weights(cfg), "systems_only": True,
                "weights_source": "synthetic random weights (the shipped checkpoint has another "
                                  "shape" + (f": {shape_text(ck.cfg)})" if ck is not None else ")"),
                "label": "21m shape, synthetic random weights (systems behaviour only)"}
    return {"name": name, "cfg": cfg, "weights": synthetic_weights(cfg), "systems_only": True,
            "weights_source": "synthetic random weights", "label": REGIME_LABELS[name]}


FALLBACK_TEXT = (
    "It was the best part of the morning, and the family had gathered in the small parlour "
    "to hear the news that the letter had brought. Nobody spoke at first; then the eldest "
    "daughter set down her work and asked, with a composure she did not feel, whether the "
    "gentleman intended to return before the end of the summer. ")


def heldout_text() -> tuple:
    """(text, label): held-out prose the model never trained on.

    Looked for, in order: data/corpus/heldout.txt (``python -m spel_mlx.corpus``), a
    heldout.txt beside the shipped checkpoint, the corpus sources split on the fly;
    otherwise a fixed English paragraph, labelled as such."""
    for path in (os.path.join(REPO, "data", "corpus", "heldout.txt"),
                 os.path.join(shipped_checkpoint_dir(), "heldout.txt")):
        if os.path.isfile(path):
            with open(path, encoding="ascii", errors="replace") as f:
                text = f.read(1 << 16)
            if len(text) > 256:
                return text, f"held-out text ({os.path.relpath(path, REPO)})"
    try:
        from spel_mlx.training import corpus
        _, held = corpus.split_heldout(corpus.load_source("austen"))
        if len(held) > 256:
            return held, "held-out text (austen, split on the fly)"
    except Exception:
        pass
    return FALLBACK_TEXT * 8, "fixed English paragraph (held-out corpus not available)"


def prompt_tokens(cfg, n: int, tokenizer_path=None) -> tuple:
    """(tokens, label): n tokens of held-out text for the trained regime; for synthetic
    weights the text matters little, but the same source keeps the rows comparable."""
    text, label = heldout_text()
    # start after the first line break: a prompt that begins on a whole line
    cut = text.find("\n")
    if 0 <= cut < len(text) // 2:
        text = text[cut + 1:]
    try:
        from spel_mlx.tokenizer import load_tokenizer
        tok = load_tokenizer(cfg.vocab, tokenizer_path)
        ids = list(tok.encode(text[: 8 * n + 64]))
    except Exception as e:
        ids = [o if o < 128 else 63 for o in map(ord, text[: 8 * n + 64])]
        label += f"; tokenizer unavailable ({type(e).__name__}), ASCII byte ids"
    ids = [i % cfg.vocab for i in ids]
    return ids[:n], label


# --------------------------------------------------------------------------- worker

def run_worker(job: dict) -> dict:
    """Measure the sections of one job in this process; never raises."""
    rows, meta = [], {"job": job, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    t_start = time.perf_counter()
    try:
        regime = load_regime(job["regime"])
        cfg = regime["cfg"]
        prompt, prompt_label = prompt_tokens(cfg, job["prompt_len"], regime.get("tokenizer"))
        regime.update(prompt=prompt, prompt_source=prompt_label)
        meta["regime"] = {k: regime[k] for k in ("name", "label", "weights_source",
                                                  "systems_only", "prompt_source")}
        meta["regime"]["config"] = cfg.to_dict()
        meta["regime"]["target_params"] = cfg.target_params()
        meta["regime"]["draft_params"] = cfg.draft_params()
    except Exception as e:
        rows.append(unavailable("setup", f"load regime {job['regime']}",
                                f"{type(e).__name__}: {e}", status=ERROR, regime=job["regime"]))
        meta["traceback"] = traceback.format_exc()
        return {"rows": rows, "meta": meta}
    for section in job["sections"]:
        t0 = time.perf_counter()
        try:
            rows += run_section(section, job, regime)
        except Exception as e:
            rows.append(unavailable(section, f"{section} section", f"{type(e).__name__}: {e}",
                                    status=ERROR, regime=job["regime"]))
            meta.setdefault("tracebacks", {})[section] = traceback.format_exc()
        meta.setdefault("section_s", {})[section] = round(time.perf_counter() - t0, 3)
    meta["wall_s"] = round(time.perf_counter() - t_start, 3)
    return {"rows": rows, "meta": meta}


def run_section(section: str, job: dict, regime: dict) -> list:
    if section == "b1":
        return run_b1(job)
    if section == "b2":
        from . import b2_verify
        return b2_verify.run(job, regime)
    if section == "b3":
        from . import b3_decode
        return b3_decode.run(job, regime)
    if section == "placement":
        return run_placement(job, regime)
    if section == "peers":
        from . import peers
        return peers.run({"regime": job["regime"], "cfg": regime["cfg"], "prompt": regime["prompt"],
                          "gen_tokens": job["peers_gen"], "repeats": max(1, job["repeats"]),
                          "K": job["K"]})
    raise ValueError(f"unknown section {section!r}")


def run_placement(job: dict, regime: dict) -> list:
    """The calibration behind ``--placement auto``: c and v per placement, ranked."""
    from spel_mlx.decoding.placement import calibrate_placement
    from .b2_verify import get_model
    ranked = calibrate_placement(get_model(regime), regime["weights"], k=job["K"],
                                 threads=job["threads"], alpha=PLACEMENT_ALPHA,
                                 prompt=regime["prompt"], reps=max(3, job["b2_repeats"]))
    rows, rank = [], 0
    for p in ranked:
        fields = dict(regime=regime["name"], placement=p.name.rsplit(" threads=", 1)[0],
                      threads=p.threads, K=p.k, mode="calibration")
        if not p.available:
            rows.append(unavailable("placement", "calibration", p.reason.replace("not available: ", ""),
                                    **fields))
            continue
        rank += 1
        rows.append(make_row("placement", "calibration", primary="round_cost",
                             metrics={"rank": rank, "c": p.c, "v": p.v, "round_cost": p.round_cost,
                                      "projected": p.projected, "ar_ms": p.ar_token_s * 1e3,
                                      "draft_ms": p.draft_token_s * 1e3,
                                      "verify_ms": p.verify_s * 1e3}, **fields))
    return rows


def run_b1(job: dict) -> list:
    """B1 kernels come from bench/kernels.py (the neon engineer's): ``run(quick=...)``
    returning rows (dicts) or ``{"rows": [...]}``; anything else is wrapped as one row."""
    try:
        from . import kernels
    except ImportError as e:
        return [unavailable("b1", "ternary GEMV kernels", f"bench/kernels.py not available ({e})")]
    fn = getattr(kernels, "run", None)
    if fn is None:
        return [unavailable("b1", "ternary GEMV kernels", "bench/kernels.py has no run()")]
    quick = job["level"] != "full"
    try:
        out = fn(quick=quick)
    except TypeError:
        out = fn()
    return normalize_b1(out)


def normalize_b1(out) -> list:
    if isinstance(out, dict) and "rows" in out:
        out = out["rows"]
    if isinstance(out, dict):  # {kernel: {metric: value}}
        out = [dict(name=k, **(v if isinstance(v, dict) else {"value": v})) for k, v in out.items()]
    rows = []
    for r in out or []:
        if "section" in r and "metrics" in r:
            rows.append(r)
            continue
        r = dict(r)
        name = str(r.pop("name", r.pop("kernel", "kernel")))
        threads = r.pop("threads", None)
        note = str(r.pop("note", ""))
        status = r.pop("status", common.OK)
        metrics = {k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        extra = {k: v for k, v in r.items() if k not in metrics}
        if extra:
            note = (note + " " + json.dumps(extra, default=str)).strip()
        primary = "gmac_s" if "gmac_s" in metrics else (next(iter(metrics), None))
        rows.append(make_row("b1", name, threads=threads, primary=primary, metrics=metrics,
                             note=note, status=status))
    return rows


# --------------------------------------------------------------------------- orchestration

def auto_threads() -> list:
    """Draft thread counts to measure: 1 and 2, and 4 and 6 where the cores exist
    (the original reported 1 and 4; the pool takes 1..6)."""
    cores = os.cpu_count() or 1
    return sorted({t for t in (1, 2, 4, 6) if t <= max(cores, 2)})


def protocol(params: dict, regime: str) -> dict:
    proto = {**DEFAULT_PROTOCOL, **params["per_regime"].get(regime, {}), **params.get("override", {})}
    if proto["threads"] == "auto":
        proto["threads"] = auto_threads()
    return proto


def build_jobs(level: str, params: dict) -> list:
    jobs = []
    for run_idx in range(params["runs"]):
        for i, regime in enumerate(params["regimes"]):
            proto = protocol(params, regime)
            if run_idx >= proto.get("runs", params["runs"]):
                continue
            sections = [s for s in params["sections"]
                        if (s not in ONCE or run_idx == 0) and (s != "b1" or i == 0)
                        and (s != "peers" or proto["peers_gen"] > 0)]
            if not sections:
                continue
            jobs.append({"level": level, "run": run_idx, "regime": regime, "sections": sections,
                         "b2_K": params["b2_K"], "K": params["K"], "K_ceiling": params["K_ceiling"],
                         "repeats": 1, **proto})
            jobs[-1]["runs"] = proto.get("runs", params["runs"])
    return jobs


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
