"""The report's PNG plots (matplotlib, the optional extra ``plots``)."""
from __future__ import annotations

import os

from . import common
from .common import metric, select_rows
from .context_tables import context_passes


def make_plots(results, img_dir) -> tuple:
    """([(title, path)], note). Needs matplotlib (optional extra ``plots``)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return [], (f"Plots skipped: matplotlib is not installed ({type(e).__name__}); "
                    "`pip install spel-mlx[plots]` to get them.")
    os.makedirs(img_dir, exist_ok=True)
    made = []
    p = results["params"]
    if not p.get("only_sections") or {"b2", "b3", "placement"} & set(p["sections"]):
        made += decode_plots(results, img_dir, plt)
    if select_rows(results, "b2ctx"):
        made.append(("B2 by context: v(M) and AR decode against context", context_plot(results, img_dir, plt)))
    return made, ""


def decode_plots(results, img_dir, plt) -> list:
    """B3 decode tok/s, c and v by placement, measured against projected speedup."""
    made = []
    regimes = results["params"]["regimes"]
    K = results["params"]["K"]

    # 1. decode tok/s by mode (CPU target, each draft placement), per regime
    fig, axes = plt.subplots(1, len(regimes), figsize=(6.5 * len(regimes), 4.2), squeeze=False)
    for ax, g in zip(axes[0], regimes):
        rows = [r for r in select_rows(results, "b3", g)
                if r["status"] == common.OK and r["mode"] not in ("rollback", "kv-copy", "draft-only")
                and (r.get("K") in (None, K))]
        labels, meds, lo, hi = [], [], [], []
        for r in rows:
            m = r["metrics"]["tok_s"]
            pl = r["placement"].replace("target=mlx-cpu", "").replace("draft=", "").strip()
            th = f" t{r['threads']}" if r.get("threads") else ""
            labels.append(f"{r['name']}\n{pl}{th}".strip())
            meds.append(m["median"])
            lo.append(m["median"] - m["min"])
            hi.append(m["max"] - m["median"])
        if meds:
            ax.barh(range(len(meds)), meds, xerr=[lo, hi], color="#4c72b0", capsize=2)
            ax.set_yticks(range(len(meds)))
            ax.set_yticklabels(labels, fontsize=6)
            ax.invert_yaxis()
        ax.set_xlabel("tok/s (median, min–max over process runs)")
        ax.set_title(f"B3 decode, {g} (target MLX CPU, K={K})", fontsize=9)
    p = save(fig, plt, img_dir, "bench_decode_tok_s.png")
    made.append(("Decode tok/s by mode and placement", p))

    # 2. c and v by placement (the calibration rows; B3 draft-only rows if it did not run)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(regimes))

    def c_rows(g):
        rs = [r for r in select_rows(results, "placement", g) if r["status"] == common.OK]
        return rs or [r for r in select_rows(results, "b3", g, mode="draft-only") if r["status"] == common.OK]

    def lab_of(r):
        return (r["placement"].replace("target=", "T:").replace(" draft=", "\nD:")
                + (f" t{r['threads']}" if r.get("threads") else ""))
    cats = []
    for g in regimes:
        for r in c_rows(g):
            if lab_of(r) not in cats:
                cats.append(lab_of(r))
    for i, g in enumerate(regimes):
        by = {lab_of(r): metric(r, "c") for r in c_rows(g)}
        axes[0].bar([x + i * width for x in range(len(cats))], [by.get(c) or 0.0 for c in cats],
                    width, label=g)
    axes[0].set_xticks([x + width * (len(regimes) - 1) / 2 for x in range(len(cats))])
    axes[0].set_xticklabels(cats, fontsize=7)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("c = draft token / AR token (log)")
    axes[0].set_title("draft cost c by placement (available placements)", fontsize=9)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8)
    for g in regimes:
        for mode, style in (("fast", "-o"), ("strict", "--s")):
            rs = [r for r in select_rows(results, "b2", g, mode=mode)
                  if r["status"] == common.OK and r["placement"] == "target=mlx-cpu"]
            if rs:
                axes[1].plot([r["K"] + 1 for r in rs], [metric(r, "v") for r in rs], style,
                             label=f"{g} {mode}")
    axes[1].set_xlabel("M = K+1")
    axes[1].set_ylabel("v = verify(M) / AR token")
    axes[1].set_title("verification cost v, target MLX on CPU", fontsize=9)
    if axes[1].get_legend_handles_labels()[0]:
        axes[1].legend(fontsize=8)
    p = save(fig, plt, img_dir, "bench_c_v_by_placement.png")
    made.append(("c and v by placement", p))

    # 3. measured vs projected speedup across alpha
    fig, axes = plt.subplots(1, len(regimes), figsize=(6 * len(regimes), 4.2), squeeze=False)
    alphas = [i / 50 for i in range(51)]
    for ax, g in zip(axes[0], regimes):
        for r in select_rows(results, "b3", g, mode="spec"):
            if r["status"] != common.OK or metric(r, "c") is None or metric(r, "v") is None:
                continue
            c, v, Kr = metric(r, "c"), metric(r, "v"), r["K"]
            lab = r["placement"].split("draft=")[-1] + (f" t{r['threads']}" if r.get("threads") else "")
            line, = ax.plot(alphas, [common.cost_model_speedup(a, Kr, c, v) for a in alphas],
                            label=f"model {lab} (c={c:.2f}, v={v:.2f})")
            pts = [x for x in select_rows(results, "b3", g, placement=r["placement"], threads=r.get("threads"), K=Kr)
                   if x["status"] == common.OK and x["mode"] in ("spec", "forced", "governed")]
            ax.plot([metric(x, "alpha") for x in pts], [metric(x, "speedup") for x in pts], "o",
                    color=line.get_color(), label=f"measured {lab}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("alpha (accepted / proposed)")
        ax.set_ylabel("× AR")
        ax.set_title(f"{g}: measured vs cost model, K={K}", fontsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    p = save(fig, plt, img_dir, "bench_speedup_vs_alpha.png")
    made.append(("Measured vs projected speedup across alpha", p))
    return made


def save(fig, plt, img_dir, name) -> str:
    fig.tight_layout()
    path = os.path.join(img_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def context_plot(results, img_dir, plt) -> str:
    """v(M) against context (one line per regime and M) and AR decode tok/s relative to
    the shortest context, with issue 14's goals as dotted marks."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for g in results["params"]["regimes"]:
        rows = [r for r in select_rows(results, "b2ctx", g) if r["status"] == common.OK]
        for kv, style in (("", "-o"), ("float16", "--^")):
            passes = context_passes(rows, half=bool(kv))
            for M in sorted({int(metric(r, "M")) for r in passes} - {1}):
                pts = sorted((metric(r, "context"), metric(r, "v")) for r in passes if metric(r, "M") == M)
                axes[0].plot([p[0] for p in pts], [p[1] for p in pts], style,
                             label=f"{g} M={M}" + (f", {kv} K/V" if kv else ""))
        for key, style, label in (("vs_shortest", "-o", g), ("half_vs_shortest", "--^", f"{g}, float16 K/V")):
            ar = sorted((metric(r, "context"), metric(r, key)) for r in rows
                        if r["name"].startswith("AR decode") and metric(r, key) is not None)
            if ar:
                axes[1].plot([p[0] for p in ar], [p[1] for p in ar], style, label=label)
    axes[0].plot([64, 2048], [1.25, 1.35], "k_", ms=20, label="goal for M=5 (at most)")
    axes[0].set_xlabel("context (tokens)")
    axes[0].set_ylabel("v = pass(M) / pass(1)")
    axes[0].set_title("verification cost by context, target on CPU", fontsize=9)
    axes[1].plot([2048, 4000], [0.85, 0.75], "k_", ms=20, label="goal (at least)")
    axes[1].set_xlabel("context (tokens)")
    axes[1].set_ylabel("AR decode tok/s / at the shortest context")
    axes[1].set_title("AR decode by context", fontsize=9)
    for ax in axes:
        ax.set_xscale("log", base=2)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    return save(fig, plt, img_dir, "bench_b2_context.png")
