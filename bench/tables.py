"""The report's tables: the cross-regime headline, the findings in words, and one table
per section.  Every figure is ``median (min–max)`` over process runs; a row with no
figure says why ("not available", "skipped", "error")."""
from __future__ import annotations

from . import common
from .common import fmt_num, fmt_range, metric, select_rows
from .protocol import PLACEMENT_ALPHA, protocol

# SPEC 9: the original's figures (Apple M5, C11, FP32 target), for the side-by-side column
ORIGINAL = {
    "ar": "21m 366.5–371.0; 218m 29.5–29.9 tok/s",
    "draft1": "21m 2974–2982 (c 0.12); 218m 333–354 (c 0.08–0.09)",
    "draft4": "at 4 threads: 21m 4395–4628 (c 0.08); 218m 734–1000 (c 0.03–0.04)",
    "raw": "21m 1.45–1.48× at 4 threads (alpha 0.618, in-domain prompt, K=4)",
    "v5": "21m 1.98–2.02 (fast, M=5)",
    "forced16": "21m 3.45–3.52×; 218m 5.50–5.61× (K=16)",
    "oracle": "21m 0.82–0.85×; 218m 0.88× (K=16)",
    "rollback": "~0.5 ns vs 108–113 µs (21m, 4.5 MiB KV)",
    "b1": "dotprod 17.7–17.9 GMAC/s, 2.66–3.06× FP32 (M5 NEON)",
}

STATUS_MARK = {common.NOT_AVAILABLE: "not available", common.SKIPPED: "skipped",
               common.ERROR: "error"}


def _why(r, limit: int = 0) -> str:
    note = r.get("note", "") or ""
    if limit and len(note) > limit:
        note = note[:limit - 1] + "…"
    return f"{STATUS_MARK.get(r['status'], r['status'])}: {note}".strip().rstrip(":")


def _table(header, body) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for b in body:
        lines.append("| " + " | ".join(str(x).replace("|", "/") for x in b) + " |")
    return "\n".join(lines)


def _cell(r, name, suffix=""):
    """'median (min–max)' of a row's metric, or the row's status."""
    if r is None:
        return "—"
    if r["status"] != common.OK:
        return STATUS_MARK.get(r["status"], r["status"])
    m = r["metrics"].get(name)
    if m is None or (isinstance(m, dict) and m.get("median") is None):
        return "—"
    return fmt_range(m) + suffix


def _first(rows):
    return rows[0] if rows else None


def _ok(rows):
    return [r for r in rows if r["status"] == common.OK]


def _per_regime(results, section: str, render) -> list:
    """The lines render(regime, rows) gives for each regime with rows of the section."""
    parts = []
    for g in results["params"]["regimes"]:
        rows = select_rows(results, section, g)
        if rows:
            parts += render(g, rows)
    return parts


# --------------------------------------------------------------------------- sections

def headline(results) -> tuple:
    """(markdown table, list of regimes) of the cross-regime summary."""
    regimes = [g for g in results["params"]["regimes"]]
    K = results["params"]["K"]

    def b3(regime, name, placement_prefix="target=mlx-cpu", threads=None, Kv=None):
        for r in select_rows(results, "b3", regime, name=name):
            if not (r.get("placement") or "").startswith(placement_prefix):
                continue
            if threads is not None and r.get("threads") != threads:
                continue
            if Kv is not None and r.get("K") != Kv:
                continue
            return r
        return None

    threads = sorted({t for g in regimes for t in protocol(results["params"], g)["threads"]})
    spec_cell = lambda r: "—" if r is None else (  # noqa: E731
        _cell(r, "tok_s") + " tok/s, " + _cell(r, "speedup") + "× AR, alpha " + _cell(r, "alpha")
        + (", projected " + _cell(r, "projected") + "×" if r["status"] == common.OK else "")
        if r["status"] == common.OK else _why(r, 70))
    body = []
    b1 = [r for r in select_rows(results, "b1") if r["status"] == common.OK and r.get("threads") == 1
          and r["name"].startswith("ternary") and "scalar" not in r["name"] and metric(r, "gmac_s")]
    if b1:
        best = max(b1, key=lambda r: metric(r, "gmac_s"))
        x, xc = metric(best, "x_numpy_fp32"), metric(best, "x_numpy_fp32_cpu")
        cell = (f"{best['name']}: {fmt_num(metric(best, 'gmac_s'))} GMAC/s"
                + (f", {fmt_num(x)}× numpy FP32 GEMV" if x else "")
                + (f" ({fmt_num(xc)}× per CPU-second)" if xc else ""))
        body.append(["B1 ternary GEMV 4096×1536, best kernel, 1 thread"] +
                     [cell if i == 0 else "(same machine)" for i, _ in enumerate(regimes)] + [ORIGINAL["b1"]])
    body.append(["AR target tok/s (MLX, CPU)"] +
                [_cell(b3(g, "AR target"), "tok_s") for g in regimes] +
                [ORIGINAL["ar"]])
    for t in threads:
        body.append([f"draft-only tok/s, C draft, {t} thread{'s' if t > 1 else ''} (c)"] +
                    [(_cell(r, "tok_s") + f" (c = {_cell(r, 'c')})") if r and r["status"] == common.OK
                     else (_why(r, 70) if r else "—")
                     for r in (b3(g, "draft only", "target=mlx-cpu draft=c-cpu", t) for g in regimes)] +
                    [ORIGINAL["draft1"] if t == 1 else (ORIGINAL["draft4"] if t == 4 else "")])
    v_rows = {g: _first([r for r in select_rows(results, "b2", g, mode="fast", K=K)
                         if r.get("placement") == "target=mlx-cpu"]) for g in regimes}
    vs_rows = {g: _first([r for r in select_rows(results, "b2", g, mode="strict", K=K)
                          if r.get("placement") == "target=mlx-cpu"]) for g in regimes}
    body.append([f"v at M=K+1={K+1}, fast (strict)"] +
                [f"{_cell(v_rows[g], 'v')} ({_cell(vs_rows[g], 'v')})" for g in regimes] +
                [ORIGINAL["v5"]])
    for name, label in (("raw spec", "raw speculation"), ("default spec", "default (cost governor)"),
                        ("governed spec", "governed"),
                        ("forced 0.75", "forced 0.75 (ceiling)"), ("forced 1.00", "forced 1.00 (ceiling)")):
        for t in threads:
            body.append([f"{label}, K={K}, C draft {t} thr"] +
                        [spec_cell(b3(g, name, "target=mlx-cpu draft=c-cpu", t, K)) for g in regimes] +
                        [ORIGINAL["raw"] if (name == "raw spec" and t == threads[-1]) else ""])
        if name in ("raw spec", "default spec", "governed spec"):
            body.append([f"{label}, K={K}, C draft 1 thr, drafting ahead"] +
                        [spec_cell(b3(g, name, "target=mlx-cpu draft=c-cpu ahead", 1, K)) for g in regimes] +
                        [""])
    Kc = results["params"].get("K_ceiling")
    if Kc:
        body.append([f"forced 1.00, K={Kc}, C draft 1 thr"] +
                    [spec_cell(b3(g, "forced 1.00", "target=mlx-cpu draft=c-cpu", 1, Kc)) for g in regimes] +
                    [ORIGINAL["forced16"]])
    body.append(["full-target oracle (draft = target)"] +
                [spec_cell(b3(g, "full-target oracle")) for g in regimes] + [ORIGINAL["oracle"]])
    rb = {g: (b3(g, "rollback primitive (commit of K+1 pending)"), b3(g, "copy the attention KV cache"))
          for g in regimes}
    body.append(["rollback primitive vs KV copy"] +
                [(f"{_cell(p, 'us')} µs vs {_cell(c, 'us')} µs ({_cell(c, 'mib')} MiB)"
                  if p and c and p["status"] == common.OK and c["status"] == common.OK else "—")
                 for p, c in rb.values()] + [ORIGINAL["rollback"]])
    peer = {g: _first(select_rows(results, "peers", g, mode="ar", name="mlx-lm Llama-style greedy (random weights)"))
            for g in regimes}
    peer_gdn = {g: _first(select_rows(results, "peers", g, mode="ar",
                                name="mlx-lm GDN hybrid (qwen3_next) greedy (random weights)")) for g in regimes}
    body.append(["mlx-lm Llama-style greedy, same shape"] +
                [_cell(peer[g], "tok_s") if peer[g] else "—" for g in regimes] + [""])
    body.append(["mlx-lm GDN hybrid greedy, same shape"] +
                [_cell(peer_gdn[g], "tok_s") if peer_gdn[g] else "—" for g in regimes] + [""])
    header = ["figure"] + [column_name(results, g) for g in regimes] + \
        ["original (Apple M5, C11, FP32 target)"]
    return _table(header, body), regimes


def findings(results) -> str:
    """A few sentences computed from the rows: what the numbers say, per regime."""
    out = []
    for g in results["params"]["regimes"]:
        b3 = [r for r in select_rows(results, "b3", g) if r["status"] == common.OK]
        ar = _first([r for r in b3 if r["name"] == "AR target" and r["placement"] == "target=mlx-cpu"])
        if ar is None:
            continue
        s = [f"**{g}**: AR {fmt_range(ar['metrics']['tok_s'])} tok/s"]
        cs = [r for r in b3 if r["mode"] == "draft-only" and "c-cpu" in r["placement"]]
        if cs:
            best = min(cs, key=lambda r: metric(r, "c"))
            s.append(f"the C draft runs at c = {fmt_num(metric(best, 'c'))} "
                     f"({best['threads']} thread(s), {fmt_num(metric(best, 'tok_s'))} tok/s)")
        c_spec = lambda name: [r for r in b3 if r["mode"] == "spec" and r["name"] == name  # noqa: E731
                               and "c-cpu" in r["placement"]]
        raw = c_spec("raw spec")
        if raw:
            best = max(raw, key=lambda r: metric(r, "speedup"))
            s.append(f"raw speculation accepts alpha = {fmt_num(metric(best, 'alpha'))} of the "
                     f"proposals and runs at {fmt_num(metric(best, 'speedup'))}× AR "
                     f"(cost model {fmt_num(metric(best, 'projected'))}×)")
        default = [metric(r, "speedup") for r in c_spec("default spec")]
        if default:
            s.append(f"spec's default (cost governor) runs at {fmt_num(min(default))}–{fmt_num(max(default))}× AR")
        f1 = [r for r in b3 if r["mode"] == "forced" and r.get("forced_alpha") == 1.0
              and r.get("K") == results["params"]["K"] and "c-cpu" in r["placement"]]
        if f1:
            best = max(f1, key=lambda r: metric(r, "speedup"))
            s.append(f"the forced-1.00 ceiling is {fmt_num(metric(best, 'speedup'))}× AR")
        ratios = [metric(r, "speedup") / metric(r, "projected") for r in b3
                  if r["mode"] in ("spec", "forced", "oracle") and metric(r, "projected")]
        if ratios:
            ratios.sort()
            s.append(f"measured/projected over {len(ratios)} speculative rows: median "
                     f"{fmt_num(ratios[len(ratios) // 2])} (range {fmt_num(ratios[0])}–{fmt_num(ratios[-1])})")
        peer = _first([r for r in select_rows(results, "peers", g, mode="ar") if r["status"] == common.OK
                       and "Llama" in r["name"]])
        if peer:   # engine against engine: a speculative row over plain greedy would measure the draft
            s.append(f"SPEL's AR is {metric(ar, 'tok_s') / metric(peer, 'tok_s'):.2f}× mlx-lm's "
                     f"same-shape Llama greedy")
        info = results.get("regimes", {}).get(g, {})
        if info.get("systems_only"):
            s.append("weights are random, so alpha and decoding rows show systems behaviour only")
        out.append("- " + "; ".join(s) + ".")
    return "\n".join(out)


def column_name(results, g) -> str:
    info = results.get("regimes", {}).get(g)
    if not info:
        return g
    kind = "synthetic" if info.get("systems_only") else "trained"
    return f"{g} ({info['target_params'] / 1e6:.1f}M, {kind})"


def regime_section(results) -> str:
    out = [f"- {n}" for n in results["params"].get("regime_notes", [])]
    for name, info in results.get("regimes", {}).items():
        cfg = info.get("config", {})
        out.append(f"- **{name}** — {info['label']}. Weights: {info['weights_source']}. "
                   f"Prompts: {info['prompt_source']}. Target {info['target_params']:,} parameters, "
                   f"draft {info['draft_params']:,} (d_model {cfg.get('d_model')}, "
                   f"{cfg.get('n_layers')} layers, d_ff {cfg.get('d_ff')}, draft_map "
                   f"{cfg.get('draft_map')}).")
    return "\n".join(out)


def b1_section(results) -> str:
    rows = select_rows(results, "b1")
    if not rows:
        return "_B1 was not run at this level._"
    parts = []
    # GEMV rows (GMAC/s) and the rest (draft-only tokens, target token) in separate tables
    for group in ([r for r in rows if "gmac_s" in r.get("metrics", {})],
                  [r for r in rows if "gmac_s" not in r.get("metrics", {})]):
        if not group:
            continue
        names = []
        for r in group:
            for n in r.get("metrics", {}):
                if n not in names:
                    names.append(n)
        body = []
        for r in group:
            if r["status"] != common.OK:
                body.append([r["name"], r.get("threads") or "—"] + ["—"] * len(names) + [_why(r)])
            else:
                body.append([r["name"], r.get("threads") or "—"] + [_cell(r, n) for n in names] +
                            [r.get("note", "")])
        parts.append(_table(["kernel", "threads"] + names + ["note"], body))
        parts.append("")
    return "\n".join(parts)


def b2_section(results) -> str:
    return "\n".join(_per_regime(results, "b2", _b2_regime))


def _b2_regime(g, rows) -> list:
    parts = [f"**{g}**"]
    for placement in dict.fromkeys(r["placement"] for r in rows):
        pr = [r for r in rows if r["placement"] == placement]
        ar = _first([r for r in pr if r["mode"] == "ar"])
        if not _ok(pr):
            parts.append(f"- {placement}: {_why(pr[0])}")
            continue
        parts.append(f"- {placement}: one AR token {_cell(ar, 'ms')} ms")
        body = []
        for K in sorted({r["K"] for r in pr if r.get("K")}):
            s = _first([r for r in pr if r["mode"] == "strict" and r["K"] == K])
            f = _first([r for r in pr if r["mode"] == "fast" and r["K"] == K])
            body.append([K, K + 1, _cell(s, "ms"), _cell(s, "v"), _cell(f, "ms"), _cell(f, "v")])
        parts.append("")
        parts.append(_table(["K", "M", "strict ms", "strict v", "fast ms", "fast v"], body))
        parts.append("")
    return parts


def b3_section(results) -> str:
    return "\n".join(_per_regime(results, "b3", _b3_regime))


def _b3_regime(g, rows) -> list:
    parts = [f"**{g}**\n"]
    body = []
    rows_main = [r for r in rows if r["mode"] not in ("rollback", "kv-copy")]
    i = 0
    while i < len(rows_main):
        r = rows_main[i]
        th = r.get("threads") or "—"
        if r["status"] != common.OK:
            # consecutive rows with no figure for the same reason: one line
            j = i
            while (j + 1 < len(rows_main) and rows_main[j + 1]["status"] == r["status"]
                   and rows_main[j + 1].get("note") == r.get("note")
                   and (rows_main[j + 1]["placement"] or "").split()[:1]
                   == (r["placement"] or "").split()[:1]):
                j += 1
            group = rows_main[i:j + 1]
            names = ", ".join(dict.fromkeys(x["name"] for x in group))
            places = ", ".join(dict.fromkeys(x["placement"] or "—" for x in group))
            ths = ", ".join(dict.fromkeys(str(x.get("threads") or "—") for x in group))
            body.append([names, places, ths, r.get("K") or "—", _why(r)] + [""] * 7)
            i = j + 1
            continue
        i += 1
        spec = r["mode"] in ("spec", "governed", "forced", "oracle")
        extra = ""
        if r["mode"] == "governed" or r["name"] == "default spec":
            extra = f"trips {_cell(r, 'governor_trips')}, AR rounds {_cell(r, 'ar_rounds')}"
        if r.get("note"):
            extra = (extra + "; " if extra else "") + r["note"]
        body.append([r["name"], r["placement"] or "—", th, r.get("K") or "—", _cell(r, "tok_s"),
                     _cell(r, "speedup") if r["mode"] != "draft-only" else "—",
                     _cell(r, "alpha") if spec else "—",
                     _cell(r, "c"), _cell(r, "v") if spec else "—",
                     _cell(r, "projected") if spec else "—",
                     _cell(r, "tokens_per_round") if spec else "—", extra])
    parts.append(_table(["path", "placement", "threads", "K", "tok/s", "× AR (measured)", "alpha",
                         "c", "v", "× AR (cost model)", "tokens/round", "note"], body))
    rb = [r for r in rows if r["mode"] in ("rollback", "kv-copy")]
    if rb:
        parts.append("")
        parts.append(_table(["rollback", "µs", "note"],
                            [[r["name"], _cell(r, "us") if r["status"] == common.OK else _why(r),
                              (r.get("note", "") + (f"; {_cell(r, 'mib')} MiB, "
                                                     f"{_cell(r, 'ratio_to_primitive')}× the primitive"
                                                     if r["mode"] == "kv-copy" and r["status"] == common.OK
                                                     else ""))] for r in rb]))
    parts.append("")
    return parts


def placement_section(results) -> str:
    parts = _per_regime(results, "placement", _placement_regime)
    return "\n".join(parts) if parts else "_The placement calibration was not run._"


def _placement_regime(g, rows) -> list:
    body = []
    for r in sorted(rows, key=lambda r: (r["status"] != common.OK, metric(r, "rank") or 0)):
        th = r.get("threads") or "—"
        if r["status"] != common.OK:
            body.append(["—", r["placement"], th, _why(r), "", "", "", "", ""])
            continue
        body.append([f"{metric(r, 'rank'):g}", r["placement"], th, _cell(r, "c"), _cell(r, "v"),
                     _cell(r, "round_cost"), _cell(r, "projected"), _cell(r, "ar_ms"),
                     _cell(r, "draft_ms")])
    parts = [f"**{g}** (K={rows[0].get('K')})\n"]
    parts.append(_table(["rank", "placement", "threads", "c", "v", "(K+1)c+v",
                         f"projected × AR at alpha {PLACEMENT_ALPHA}", "AR ms", "draft ms"], body))
    parts.append("")
    return parts


def _acceptance_differs(spel, peer):
    """Why a speculative SPEL row and a peer's are not comparable by tok/s (their drafts'
    share of the emitted tokens differ by more than 0.05), else None: a ratio of two
    rows with different acceptance measures the drafts, not the engines."""
    share = metric(peer, "draft_token_share") if "draft_token_share" in peer["metrics"] else None
    alpha, K = metric(spel, "alpha") if "alpha" in spel["metrics"] else None, spel.get("K")
    if share is None or alpha is None or not K:
        return None
    ours = alpha * K / (1 + alpha * K)
    if abs(ours - share) <= 0.05:
        return None
    return f"the drafts' share of tokens differs (SPEL {ours:.2f}, alpha {alpha:.2f}; peer {share:.2f})"


def peers_section(results) -> str:
    rows = select_rows(results, "peers")
    if not rows:
        return "_Peers were not run._"
    body = []
    # the SPEL row each peer row is compared with
    counterpart = {"ar": ("AR target", "target=mlx-cpu", None),
                   "spec": ("raw spec", "target=mlx-cpu draft=c-cpu", 1),
                   "oracle": ("full-target oracle", "target=mlx-cpu draft=target", None)}
    for r in rows:
        ratio = "—"
        if r["status"] == common.OK and r["mode"] in counterpart:
            name, place, th = counterpart[r["mode"]]
            spel = _first([x for x in select_rows(results, "b3", r["regime"], name=name)
                           if x["placement"] == place and x.get("threads") == th
                           and x["status"] == common.OK])
            a, b = (metric(spel, "tok_s") if spel else None), metric(r, "tok_s")
            differs = spel and _acceptance_differs(spel, r)
            if differs:
                ratio = f"not compared: {differs}"
            elif a and b:
                ratio = f"{a / b:.2f}× ({name}{', C draft 1 thread' if th else ''})"
        if r["status"] != common.OK:
            body.append([r["regime"], r["name"], r.get("K") or "—", _why(r), "", "", ""])
        else:
            body.append([r["regime"], r["name"], r.get("K") or "—", _cell(r, "tok_s"),
                         _cell(r, "draft_token_share") if "draft_token_share" in r["metrics"] else "—",
                         fmt_num(metric(r, "params")) if "params" in r["metrics"] else "—", ratio])
    return _table(["regime", "peer", "K", "tok/s", "draft share of tokens", "params",
                   "SPEL / peer tok/s"], body)


def problems_section(results) -> str:
    bad = [r for r in results["rows"] if r["status"] == common.ERROR]
    if not bad:
        return "No row failed."
    return "\n".join(f"- {r['section']} / {r.get('regime')} / {r['name']} / {r.get('placement')}: "
                     f"{r.get('note', '')}" for r in bad)
