"""One worker process of the benchmark (``python -m bench --worker JOB.json``): it
measures the sections of one job and returns their rows; a failing section becomes an
error row, never the end of the run."""
from __future__ import annotations

import json
import time
import traceback

from . import common
from .common import ERROR, make_row, unavailable
from .protocol import PLACEMENT_ALPHA
from .regimes import load_regime, prompt_tokens


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
    if section == "b2ctx":
        from . import b2_context
        return b2_context.run(job, regime)
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
    from spel_mlx.decoding.placement import Calibration, calibrate_placement
    from .b2_verify import get_model
    ranked = calibrate_placement(get_model(regime), regime["weights"], k=job["K"],
                                 how=Calibration(threads=job["threads"], alpha=PLACEMENT_ALPHA,
                                                 prompt=regime["prompt"], reps=max(3, job["b2_repeats"])))
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

