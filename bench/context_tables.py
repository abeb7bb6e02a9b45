"""The report's section on B2 by context (issue 14): v(M) and AR decode by context, where
a pass goes, prefill, the n-gram draft on a repetitive document, and the goal line."""
from __future__ import annotations

from . import common
from .common import fmt_num, metric
from .tables import _cell, _ok, _per_regime, _table, _why


def b2ctx_section(results) -> str:
    return "\n".join(_per_regime(results, "b2ctx", _b2ctx_regime))


# issue 14's goals: (label, the figure, the bound, "<=" or ">=")
CONTEXT_GOALS = (("v(K+1=5) at 64 tokens", "v5@64", 1.25, "<="), ("v(K+1=5) at 2k", "v5@2048", 1.35, "<="),
                 ("AR tok/s at 2k / at 64", "ar@2048", 0.85, ">="), ("AR tok/s at 4k / at 64", "ar@4000", 0.75, ">="),
                 ("with a float16 K/V cache: v(K+1=5) at 2k", "half v5@2048", 1.35, "<="),
                 ("AR at 2k / at 64", "half ar@2048", 0.85, ">="), ("AR at 4k / at 64", "half ar@4000", 0.75, ">="),
                 ("ngram / AR on a repetitive document", "ngram", 3.0, ">="),
                 ("spec prefill / ar prefill (each length)", "prefill", 1.05, "<="))


def context_passes(rows, half: bool) -> list:
    """The b2ctx pass rows of the FP32 cache, or (half) of the float16 one."""
    return [r for r in rows if r["name"].startswith("target pass") and ("float16" in r["name"]) == half]


def _b2ctx_regime(g, rows) -> list:
    ok = _ok(rows)
    parts = [f"**{g}**", ""]
    if not ok:
        return parts + [f"- {_why(rows[0])}", ""]
    passes = context_passes(ok, half=False)
    half = {(int(metric(r, "context")), int(metric(r, "M"))): r for r in context_passes(ok, half=True)}
    ctxs = sorted({int(metric(r, "context")) for r in passes})
    Ms = sorted({int(metric(r, "M")) for r in passes})
    at = {(int(metric(r, "context")), int(metric(r, "M"))): r for r in passes}
    ar = {int(metric(r, "context")): r for r in ok if r["name"].startswith("AR decode")}
    body = [[c, _cell(at.get((c, 1)), "ms")] + [_cell(at.get((c, M)), "v") for M in Ms if M > 1] +
            [_cell(ar.get(c), "tok_s"), _cell(ar.get(c), "vs_shortest"), _cell(ar.get(c), "helper_gain")]
            for c in ctxs]
    parts.append(_table(["context", "AR pass ms"] + [f"v(M={M})" for M in Ms if M > 1] +
                        ["AR decode tok/s", "AR / shortest", "helper on / off"], body))
    if half:
        body = [[c, _cell(half.get((c, 1)), "ms"), _cell(half.get((c, 5)), "v"), _cell(ar.get(c), "tok_s_half"),
                 _cell(ar.get(c), "half_vs_shortest"), _cell(ar.get(c), "half_gain")] for c in ctxs]
        parts += ["", "With a float16 K/V cache (`--kv-cache float16`: k and v rounded once as written, "
                  "half the bytes a token reads; the same calls interleaved):", ""]
        parts.append(_table(["context", "AR pass ms", "v(M=5)", "AR decode tok/s", "AR / shortest",
                             "float16 / float32 tok/s"], body))
    parts += ["", "Where a pass goes (ms, medians): the fused primitives' bodies by part, and the rest of "
              "the wall time (graph dispatch, Python, waiting).", ""]
    names = ["products", "attention", "delta rule", "other bodies", "overhead"]
    body = [[c, M, _cell(at[(c, M)], "ms")] + [_cell(at[(c, M)], f"split {n}") for n in names]
            for c in ctxs for M in Ms if (c, M) in at]
    parts.append(_table(["context", "M", "wall"] + names, body))
    pre = [r for r in rows if r["name"].startswith("prefill")]
    if pre:
        lengths = sorted({int(r["K"]) for r in pre})
        by = {(int(r["K"]), r["mode"]): r for r in pre}
        body = [[n, _cell(by.get((n, "ar")), "tok_s"), _cell(by.get((n, "spec")), "tok_s"),
                 _cell(by.get((n, "spec")), "vs_ar"),
                 _cell(by.get((n, "mlx-lm")), "tok_s")] for n in lengths]
        parts += ["", "Prefill (prompt tokens per second, medians; spec = the C draft's prefill beside the "
                  "target's; spec / ar time = the median over repeats of a spec call's time over the ar "
                  "call's beside it):", ""]
        parts.append(_table(["prompt tokens", "ar tok/s", "spec tok/s", "spec / ar time",
                             "mlx-lm GDN hybrid tok/s"], body))
    for r in rows:
        if r["name"].startswith("ngram"):
            parts += ["", f"- ngram (K={r['K']}) on a repetitive document: " + (
                f"{int(metric(r, 'context'))} tokens, {_cell(r, 'tok_s')} tok/s vs AR {_cell(r, 'ar_tok_s')} "
                f"({_cell(r, 'speedup')}×), alpha {_cell(r, 'alpha')}, {_cell(r, 'tokens_per_round')} "
                f"tokens/round, v {_cell(r, 'v')}"
                + (f", longest proposal {int(metric(r, 'longest'))}" if metric(r, "longest") else "")
                if r["status"] == common.OK else _why(r))]
    figures = context_figures(rows)
    marks = []
    for label, key, bound, op in CONTEXT_GOALS:
        x = figures.get(key)
        if x is not None:
            met = x <= bound if op == "<=" else x >= bound
            marks.append(f"{label}: {fmt_num(x)} (goal {op} {bound}: {'met' if met else 'not met'})")
    if marks:
        parts += ["", "Goals: " + "; ".join(marks) + "."]
    return parts + [""]


def context_figures(rows) -> dict:
    """The goal figures of one regime's b2ctx rows (medians)."""
    out = {}
    ok = _ok(rows)
    for half, key, ctxs in ((False, "v5@{}", (64, 2048)), (True, "half v5@{}", (2048,))):
        for r in context_passes(ok, half):
            if metric(r, "M") == 5 and r.get("context") in ctxs:
                out[key.format(r["context"])] = metric(r, "v")
    for r in ok:
        ctx = r.get("context")
        if r["name"].startswith("AR decode") and ctx in (2048, 4000):
            out[f"ar@{ctx}"] = metric(r, "vs_shortest")
            if metric(r, "half_vs_shortest") is not None:
                out[f"half ar@{ctx}"] = metric(r, "half_vs_shortest")
        elif r["name"].startswith("ngram"):
            out["ngram"] = metric(r, "speedup")
        elif r["name"].startswith("prefill") and r["mode"] == "spec":
            out["prefill"] = max(out.get("prefill", 0.0), metric(r, "vs_ar") or 0.0)
    return out
