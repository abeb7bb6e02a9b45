"""The benchmark harness: a smoke run end to end (JSON + markdown structure, the cost
model beside every speculative row, unavailable rows kept), and its pure parts."""
import json
import os
import statistics
import subprocess
import sys

import pytest

import spel_mlx  # noqa: F401  (BLAS before mlx.core)
from bench import common, context_tables, peers, regimes, run, worker
from bench.b2_context import prefill_repeats

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run([sys.executable, "-m", "bench", "--smoke", "--runs", "2", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with open(out / "benchmarks.json") as f:
        results = json.load(f)
    md = (out / "benchmarks.md").read_text()
    return out, results, md, proc


def test_smoke_json_structure(smoke):
    _, res, _, _ = smoke
    assert res["schema"] == common.SCHEMA
    assert res["level"] == "smoke" and res["params"]["runs"] == 2
    assert len(res["process_meta"]) == 3  # one worker process per run, and B2 by context's own
    for r in res["rows"]:
        for k in common.KEY_FIELDS + ("status", "note", "metrics"):
            assert k in r, (k, r)
        assert r["status"] in (common.OK, common.NOT_AVAILABLE, common.SKIPPED, common.ERROR)
        if r["status"] != common.OK:
            assert r["note"], r  # a row without a figure always says why
            continue
        assert r["metrics"], r
        for name, m in r["metrics"].items():
            if m["median"] is None:
                continue
            assert m["min"] <= m["median"] <= m["max"], (r["name"], name, m)
            assert len(m["runs"]) == r["process_runs"] or len(m["runs"]) <= r["process_runs"]
    keys = [common.row_key(r) for r in res["rows"]]
    assert len(keys) == len(set(keys)), "merged rows must be unique per key"
    # what a machine lacks is "not available"; an error row is a bug in a section
    errors = [(r["section"], r["name"], r["note"]) for r in res["rows"] if r["status"] == common.ERROR]
    assert not errors, errors


def test_smoke_headline_rows_span_process_runs(smoke):
    _, res, _, _ = smoke
    ar = [r for r in res["rows"] if r["section"] == "b3" and r["name"] == "AR target"
          and r["placement"] == "target=mlx-cpu"]
    assert len(ar) == 1 and ar[0]["status"] == common.OK
    assert ar[0]["process_runs"] == 2 and len(ar[0]["metrics"]["tok_s"]["runs"]) == 2
    # B2: strict and fast at every K, each with v = verify time / AR time of its run
    b2 = {(r["mode"], r["K"]): r for r in res["rows"] if r["section"] == "b2"
          and r["placement"] == "target=mlx-cpu" and r["mode"] in ("strict", "fast")}
    assert set(b2) == {(m, k) for m in ("strict", "fast") for k in res["params"]["b2_K"]}
    for r in b2.values():
        assert r["status"] == common.OK
        for ms, ar_ms, v in zip(r["metrics"]["ms"]["runs"], r["metrics"]["ar_ms"]["runs"],
                                r["metrics"]["v"]["runs"]):
            assert v == pytest.approx(ms / ar_ms, rel=1e-9)
    assert not any(r["section"] == "b1" for r in res["rows"])  # B1 is left out of the smoke form
    # peers run once; they are not headline rows
    assert all(r.get("process_runs", 0) <= 1 for r in res["rows"] if r["section"] in ("b1", "peers"))


def test_smoke_b2_by_context(smoke):
    """B2 by context: a pass row per (context, M) with v = pass / AR pass of its context
    and a split that adds up to the wall time; AR decode, prefill and ngram rows."""
    out, res, md, _ = smoke
    rows = [r for r in res["rows"] if r["section"] == "b2ctx"]
    passes = {(r["context"], r["metrics"]["M"]["median"]): r for r in rows if r["name"].startswith("target pass, c")}
    half = {(r["context"], r["metrics"]["M"]["median"]): r for r in rows
            if r["name"].startswith("target pass, float16")}
    proto = res["params"]["per_regime"]["tiny"]
    assert set(passes) == {(c, M) for c in proto["contexts"] for M in proto["ctx_M"]}
    assert set(half) == {(c, M) for c in proto["contexts"] for M in proto["ctx_M"] if M in (1, 5)}
    for (ctx, M), r in half.items():
        assert r["metrics"]["v"]["median"] == pytest.approx(
            r["metrics"]["ms"]["median"] / half[(ctx, 1)]["metrics"]["ms"]["median"], rel=1e-9)
    for (ctx, M), r in passes.items():
        m = {k: v["median"] for k, v in r["metrics"].items()}
        assert r["status"] == common.OK and r["process_runs"] == 1
        assert m["v"] == pytest.approx(m["ms"] / passes[(ctx, 1)]["metrics"]["ms"]["median"], rel=1e-9)
        parts = [m[f"split {p}"] for p in ("products", "attention", "delta rule", "other bodies", "overhead")]
        assert min(parts) >= 0 and sum(parts) == pytest.approx(m["ms"], rel=1e-6) and parts[0] > 0
    ar = [r for r in rows if r["name"].startswith("AR decode")]
    assert len(ar) == len(proto["contexts"]) and all(r["metrics"]["tok_s"]["median"] > 0 for r in ar)
    for r in ar:
        m = {k: v["median"] for k, v in r["metrics"].items()}
        assert m["tok_s_half"] > 0 and m["half_gain"] == pytest.approx(m["tok_s_half"] / m["tok_s"], rel=1e-9)
    pre = {(r["K"], r["mode"]) for r in rows if r["name"].startswith("prefill")}
    assert pre == {(n, m) for n in proto["prefill_lengths"] for m in ("ar", "spec", "mlx-lm")}
    timed = {(r["K"], r["mode"]): r for r in rows if r["name"].startswith("prefill") and r["mode"] != "mlx-lm"}
    for n in proto["prefill_lengths"]:
        a, s = timed[(n, "ar")]["samples"], timed[(n, "spec")]["samples"]
        assert len(a) == len(s) == prefill_repeats(n, max(1, proto["ctx_repeats"] // 5)) > 1
        assert timed[(n, "spec")]["metrics"]["vs_ar"]["median"] == pytest.approx(
            statistics.median(y / x for x, y in zip(a, s)), rel=1e-9)
    ngram = [r for r in rows if r["name"].startswith("ngram")]
    assert len(ngram) == 1 and ngram[0]["status"] == common.SKIPPED     # random weights: said why
    assert "## B2 by context" in md and "| context | AR pass ms | v(M=2) | v(M=5) |" in md
    # the goal figures read the FP32 passes, and the float16 ones only where named so
    assert {id(r) for r in context_tables.context_passes(rows, half=False)} == {id(r) for r in passes.values()}
    assert {id(r) for r in context_tables.context_passes(rows, half=True)} == {id(r) for r in half.values()}
    figures = context_tables.context_figures(rows)
    assert 64 in proto["contexts"] and figures["v5@64"] == passes[(64, 5)]["metrics"]["v"]["median"]
    assert figures["v5@64"] != half[(64, 5)]["metrics"]["v"]["median"]    # two timings differ


def test_smoke_cost_model_beside_every_speculative_row(smoke):
    _, res, _, _ = smoke
    spec = [r for r in res["rows"] if r["section"] == "b3" and r["status"] == common.OK
            and r["mode"] in ("spec", "forced", "oracle")]
    assert spec, "at least the MLX-draft and oracle rows run everywhere"
    for r in spec:
        m = r["metrics"]
        runs = zip(m["alpha"]["runs"], m["c"]["runs"], m["v"]["runs"], m["projected"]["runs"],
                   m["tokens"]["runs"], m["spec_rounds"]["runs"], m["ar_rounds"]["runs"])
        for alpha, c, v, proj, tokens, spec_rounds, ar_rounds in runs:
            if r["name"] == "default spec" and spec_rounds == 0:   # shadow probes verified nothing
                assert proj == 1.0 and ar_rounds == tokens
            elif r["name"] == "default spec":     # governed: drafting and AR rounds weighted
                cost = spec_rounds * ((r["K"] + 1) * c + v) + ar_rounds
                assert proj == pytest.approx(tokens / cost, rel=1e-9)
            else:
                assert proj == pytest.approx(common.cost_model_speedup(alpha, r["K"], c, v), rel=1e-9)
        assert 0.0 <= m["alpha"]["median"] <= 1.0
    forced = [r for r in spec if r["mode"] == "forced" and r.get("forced_alpha") == 1.0]
    assert forced and all(r["metrics"]["alpha"]["median"] == 1.0 for r in forced)


def test_smoke_gpu_rows_do_not_vanish(smoke):
    _, res, _, _ = smoke
    gpu_rows = [r for r in res["rows"] if "mlx-gpu" in (r.get("placement") or "")]
    assert any(r["section"] == "b2" for r in gpu_rows)
    assert any(r["section"] == "b3" and "target=mlx-gpu" in r["placement"] for r in gpu_rows)
    assert any(r["section"] == "b3" and "draft=mlx-gpu" in r["placement"] for r in gpu_rows)
    if not common.gpu_available():
        assert all(r["status"] == common.NOT_AVAILABLE for r in gpu_rows)


def test_smoke_markdown_and_plots(smoke):
    out, res, md, _ = smoke
    for heading in ("# spel-mlx benchmarks", "## Headline", "## B1: kernels",
                    "## B2: verification cost", "## B3: decode", "## Peers", "## Plots"):
        assert heading in md
    assert "| figure | tiny (0.2M, synthetic) | original (Apple M5, C11, FP32 target) |" in md
    assert "× AR (cost model)" in md and "not available" in md
    try:
        import matplotlib  # noqa: F401
        for name in ("bench_decode_tok_s.png", "bench_c_v_by_placement.png", "bench_speedup_vs_alpha.png"):
            data = (out / "img" / name).read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n"
            assert f"img/{name}" in md
    except ImportError:
        assert "Plots skipped: matplotlib is not installed" in md


def test_report_regenerates_from_json(smoke, tmp_path):
    out, res, _, _ = smoke
    rc = run.main(["--from-json", str(out / "benchmarks.json"), "--out", str(tmp_path), "--no-plots"])
    assert rc == 0
    md = (tmp_path / "benchmarks.md").read_text()
    assert "Plots skipped (--no-plots)." in md and "## Headline" in md


def test_results_of_two_runs_combine_by_regime(smoke, tmp_path):
    out, res, _, _ = smoke
    other = json.loads(json.dumps(res))
    other["params"]["regimes"] = ["other"]
    other["regimes"] = {"other": dict(res["regimes"]["tiny"], name="other")}
    other["params"]["per_regime"] = {"other": res["params"]["per_regime"]["tiny"]}
    for r in other["rows"]:
        r["regime"] = "other"
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(res))
    b.write_text(json.dumps(other))
    assert run.main(["--from-json", f"{a},{b}", "--out", str(tmp_path / "o"), "--no-plots"]) == 0
    comb = json.loads((tmp_path / "o" / "benchmarks.json").read_text())
    assert comb["params"]["regimes"] == ["tiny", "other"]
    assert len(comb["rows"]) == 2 * len(res["rows"])
    assert "| figure | tiny (0.2M, synthetic) | other (0.2M, synthetic) |" in \
        (tmp_path / "o" / "benchmarks.md").read_text()


def test_cost_model_reproduces_the_originals_projection():
    # the original's 21m K=16 serial-draft figures: c = 0.12, v = 2.69..2.74 -> 3.51..3.56x at alpha 1
    assert common.cost_model_speedup(1.0, 16, 0.12, 2.69) == pytest.approx(17 / (17 * 0.12 + 2.69))
    assert 3.50 < common.cost_model_speedup(1.0, 16, 0.12, 2.69) < 3.60
    assert common.cost_model_speedup(0.0, 4, 0.0, 1.0) == 1.0  # nothing accepted, free draft: AR


def test_merge_runs_medians_ranges_and_failed_runs():
    a = [common.make_row("b3", "x", regime="r", metrics={"tok_s": 10.0}),
         common.make_row("b3", "y", regime="r", metrics={"tok_s": 1.0})]
    b = [common.make_row("b3", "x", regime="r", metrics={"tok_s": 14.0}),
         common.unavailable("b3", "y", "boom", status=common.ERROR, regime="r")]
    c = [common.make_row("b3", "x", regime="r", metrics={"tok_s": 11.0})]
    merged = {r["name"]: r for r in common.merge_runs([a, b, c])}
    x = merged["x"]["metrics"]["tok_s"]
    assert (x["median"], x["min"], x["max"], x["runs"]) == (11.0, 10.0, 14.0, [10.0, 14.0, 11.0])
    assert merged["x"]["process_runs"] == 3
    assert merged["y"]["process_runs"] == 1 and "1 of 2 runs failed: boom" in merged["y"]["note"]
    assert common.fmt_range(x) == "11 (10–14)"  # whole numbers (counts) print as integers
    assert common.fmt_range({"median": 11.5, "min": 10.25, "max": 14.0, "runs": [1, 2, 3]}) == \
        "11.50 (10.25–14)"


def test_peer_ratios_only_between_rows_of_equal_acceptance():
    from bench import tables
    spel = common.make_row("b3", "raw spec", regime="r", K=4, metrics={"tok_s": 100.0, "alpha": 0.85})
    oracle = common.make_row("b3", "oracle", regime="r", K=4, metrics={"tok_s": 100.0, "alpha": 1.0})
    weak = common.make_row("peers", "p", regime="r", mode="spec", K=4,
                           metrics={"tok_s": 50.0, "draft_token_share": 0.0})
    same = common.make_row("peers", "q", regime="r", mode="oracle", K=4,
                           metrics={"tok_s": 50.0, "draft_token_share": 0.797})
    assert "SPEL 0.77" in tables._acceptance_differs(spel, weak)
    assert tables._acceptance_differs(oracle, same) is None          # 4/5 both
    ar = common.make_row("peers", "a", regime="r", mode="ar", metrics={"tok_s": 50.0})
    assert tables._acceptance_differs(spel, ar) is None               # no draft: nothing to differ


def test_findings_name_raw_speculation_and_the_default_apart():
    from bench import tables
    row = lambda name, mode, **m: common.make_row(  # noqa: E731
        "b3", name, regime="r", mode=mode, placement="target=mlx-cpu draft=c-cpu", threads=1, K=4, metrics=m)
    results = {"params": {"regimes": ["r"], "K": 4}, "regimes": {}, "rows": [
        row("AR target", "ar", tok_s=100.0) | {"placement": "target=mlx-cpu"},
        row("raw spec", "spec", tok_s=70.0, speedup=0.70, alpha=0.01, projected=0.71),
        row("default spec", "spec", tok_s=97.0, speedup=0.97, alpha=0.0, projected=0.95),
        row("default spec", "spec", tok_s=99.0, speedup=0.99, alpha=0.0, projected=0.96)]}
    results["rows"].append(common.make_row("peers", "mlx-lm Llama-style greedy (random weights)", regime="r",
                                           mode="ar", metrics={"tok_s": 50.0}))
    text = tables.findings(results)
    assert "raw speculation accepts alpha = 0.010 of the proposals and runs at 0.700× AR" in text
    assert "SPEL's AR is 2.00× mlx-lm's same-shape Llama greedy" in text
    assert "its raw speculation" not in text      # no peer ratio across differing acceptance
    assert "spec's default (cost governor) runs at 0.970–0.990× AR" in text


def test_write_json_atomic_leaves_no_temp(tmp_path):
    p = tmp_path / "sub" / "r.json"
    common.write_json_atomic(str(p), {"a": (1, 2)})
    assert json.loads(p.read_text()) == {"a": [1, 2]}
    assert os.listdir(p.parent) == ["r.json"]


def test_b1_rows_normalized_from_the_kernel_module_shapes():
    rows = worker.normalize_b1([{"name": "dotprod", "threads": 1, "gmac_s": 17.7, "weight_gb_s": 4.4}])
    assert rows[0]["section"] == "b1" and rows[0]["primary"] == "gmac_s"
    assert rows[0]["metrics"] == {"gmac_s": 17.7, "weight_gb_s": 4.4}
    rows = worker.normalize_b1({"rows": [{"kernel": "scalar", "ms_per_gemv": 2.5, "isa": "x86"}]})
    assert rows[0]["name"] == "scalar" and '"isa": "x86"' in rows[0]["note"]
    rows = worker.normalize_b1({"fp32": {"gmac_s": 6.0}})
    assert rows[0]["name"] == "fp32"


def test_peers_skipped_with_reason_when_mlx_lm_missing(monkeypatch):
    from spel_mlx.config import PRESETS
    monkeypatch.setitem(sys.modules, "mlx_lm", None)  # import mlx_lm -> ImportError
    rows = peers.run({"regime": "21m", "cfg": PRESETS["21m"], "prompt": [1, 2, 3], "gen_tokens": 4,
                      "repeats": 1, "K": 4})
    assert len(rows) == 5 and all(r["status"] == common.SKIPPED for r in rows)
    assert all("mlx-lm not installed" in r["note"] for r in rows)


def test_cli_unwritable_output_and_bad_json_fail_before_measuring(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert run.main(["--smoke", "--out", str(blocker / "sub")]) == 2
    assert "cannot write there" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert run.main(["--from-json", str(bad)]) == 2
    assert "not a results JSON (line" in capsys.readouterr().err
    binary = tmp_path / "model.spelw"  # e.g. a checkpoint passed by mistake
    binary.write_bytes(b"SPELW001" + bytes(range(128, 256)))
    assert run.main(["--from-json", str(binary)]) == 2
    assert f"{binary}: not a results JSON" in capsys.readouterr().err


@pytest.mark.parametrize("args,msg", [(["--threads", "9"], "each must be in 1..6"),
                                      (["--K", "0"], "must be in 1..16"),
                                      (["--regimes", "99m"], "unknown regime"),
                                      (["--sections", "b7"], "unknown 'b7'"),
                                      # an empty list used to measure nothing and exit 0
                                      (["--regimes", ","], "--regimes: no regime given"),
                                      (["--sections", " "], "--sections: no section given")])
def test_cli_bad_arguments_are_clear_errors(args, msg, capsys):
    assert run.main(["--smoke", *args]) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


# --------------------------------------------------------------------------- placement

@pytest.fixture(scope="module")
def tiny_model():
    from spel_mlx.model import SpelModel, init_weights
    cfg = regimes.regime_config("tiny")
    weights = init_weights(cfg, seed=3)
    return SpelModel.from_weights(cfg, weights), weights


def test_calibrate_placement_ranks_by_the_cost_model(tiny_model):
    from spel_mlx.decoding import placement
    model, weights = tiny_model
    ranked = placement.calibrate_placement(model, weights, k=4,
                                           how=placement.Calibration(threads=[1, 2], alpha=0.5, reps=3))
    avail = [p for p in ranked if p.available]
    names = [p.name for p in ranked]
    assert len(names) == len(set(names))
    # every target device x every draft option is listed, available or not
    n_targets, n_drafts = 2, 2 + 2  # gpu/cpu x (C at 1 and 2 threads, MLX on gpu/cpu)
    assert len(ranked) == n_targets * n_drafts
    assert avail and ranked[:len(avail)] == avail  # available ones first
    costs = [p.round_cost for p in avail]
    assert costs == sorted(costs)
    for p in avail:
        assert p.c == pytest.approx(p.draft_token_s / p.ar_token_s)
        assert p.v == pytest.approx(p.verify_s / p.ar_token_s)
        assert p.round_cost == pytest.approx(5 * p.c + p.v)
        assert p.projected == pytest.approx(common.cost_model_speedup(0.5, 4, p.c, p.v))
    for p in ranked[len(avail):]:
        assert p.reason
    if not placement.gpu_available():
        assert all(p.target_device == "cpu" and p.draft_device == "cpu" for p in avail)
        assert {p.draft for p in avail} == {"c", "mlx"}
    d = avail[0].to_dict()
    assert d["name"] == avail[0].name and "c" in d and "v" in d
    assert placement.choose_placement(model, weights, k=4, how=placement.Calibration(threads=[1], reps=2)).available
    assert "rank" in placement.format_ranking(ranked)


def test_calibrate_placement_without_weights_and_bad_requests(tiny_model):
    from spel_mlx.decoding import placement
    model, _ = tiny_model
    ranked = placement.calibrate_placement(model, None, k=2, how=placement.Calibration(threads=[1], reps=2))
    c_rows = [p for p in ranked if p.draft == "c" and p.target_device == "cpu"]
    assert c_rows and all(not p.available and "no weights" in p.reason for p in c_rows)
    with pytest.raises(placement.PlacementError, match="K=0"):
        placement.calibrate_placement(model, None, k=0)
    with pytest.raises(placement.PlacementError, match="threads 7"):
        placement.calibrate_placement(model, None, how=placement.Calibration(threads=[7]))


def test_apply_placement_returns_a_working_draft(tiny_model):
    from spel_mlx.decoding import placement
    from spel_mlx.decoding import SpeculativeDecoder
    model, weights = tiny_model
    best = placement.choose_placement(model, weights, k=2, how=placement.Calibration(threads=[1], reps=2))
    engine = placement.apply_placement(best, model, weights)
    try:
        dec = SpeculativeDecoder(model, engine, mode="spec", k=2)
        ar = SpeculativeDecoder(model, None, mode="ar", k=2)
        prompt = [5, 9, 13, 2, 7]
        assert dec.generate(prompt, 6) == ar.generate(prompt, 6)  # greedy spec == AR
    finally:
        engine.close()
    off = placement.Placement("gpu", "c", "cpu", 1, available=False, reason="no GPU")
    with pytest.raises(placement.PlacementError, match="no GPU"):
        placement.apply_placement(off, model, weights)


def random_spelw(tmp_path):
    """A small random-weight SPELW001 checkpoint (4 layers, vocab 128) in tmp_path."""
    from spel_mlx.checkpoints import write_spelw
    from spel_mlx.config import ModelConfig
    from spel_mlx.model import init_weights
    cfg = ModelConfig(d_model=64, n_layers=4, n_heads=2, head_dim=32, d_ff=96, vocab=128, max_seq=256,
                      draft_map=(0, 3)).validate()
    ck = tmp_path / "m.spelw"
    write_spelw(str(ck), cfg, init_weights(cfg, seed=2))
    return ck


def test_wall_pairs_default_and_ar_processes(tmp_path):
    """bench/wall.py: held-out prompts without end-of-text marks, and interleaved pairs of
    fresh processes whose greedy outputs agree (a random-weight model, a few tokens)."""
    from bench import wall
    (tmp_path / "heldout.txt").write_text("first line\n<|endoftext|>\nCHAPTER 2\n" + "word " * 400 + "\n" * 3 +
                                         "more words here " * 100 + "\n")
    prompts = wall.held_out_prompts(str(tmp_path), 2, chars=80)
    assert len(prompts) == 2 and all(p and "endoftext" not in p and len(p) <= 80 for p in prompts)
    ck = random_spelw(tmp_path)
    pf = tmp_path / "p.txt"
    pf.write_text(prompts[0])
    env = {**os.environ, "SPEL_GOVERNOR_STORE": "0"}
    r = wall.measure(str(pf), ["--max-tokens", "6", "--temperature", "0", "--checkpoint", str(ck)], 2, env)
    assert r["same_output"] and len(r["ratios"]) == 2 and r["default_wall_s"] > 0 and r["ar_wall_s"] > 0


def test_ttft_times_fresh_processes_against_the_page_in(tmp_path):
    """bench/ttft.py: one run per mode in fresh processes (a random-weight model), each
    phase timed and positive, the page-in reading exactly the file's bytes."""
    from bench import ttft
    ck = random_spelw(tmp_path)
    out = tmp_path / "t.json"
    assert ttft.main(["--model", str(ck), "--runs", "1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["summary"]["bytes"] == ck.stat().st_size and got["summary"]["read_s"] > 0
    for mode in ("default", "ar"):
        s = got["summary"]["modes"][mode]
        assert all(s[k] > 0 for k in ("import", "load", "first", "wall")) and s["wall"] > s["load"] + s["first"]


def test_decode_profile_per_round_subtracts_the_prefill():
    from bench.decode_profile import per_round
    before = {"block": (4, 0.010), "block.linear": (8, 0.006), "linear": (1, 0.001)}
    prof = {"block": (24, 0.050), "block.linear": (48, 0.030), "block.delta": (9, 0.012),
            "block.attend": (3, 0.004), "linear": (6, 0.006), "rowwise": (2, 0.002)}
    got = per_round(prof, before, 10)
    want = {"products": 2.4, "delta": 1.2, "attention": 0.4, "head": 0.5, "bodies": 4.0 + 0.5 + 0.2}
    assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-9 for k in want), got


def test_decode_profile_times_both_modes(tmp_path):
    """bench/decode_profile.py on a random-weight model: every call's pass bodies hold
    their parts, and the verification rows have their wall time."""
    from bench import decode_profile
    from spel_mlx.model import cpu_ops
    if os.environ.get("SPEL_REQUIRE_CPU_EXT") != "1" and not cpu_ops.available():
        pytest.skip("spel_mlx._spel_cpu not built: " + cpu_ops.status()[1])
    (tmp_path / "heldout.txt").write_text("a line of held-out text\n" * 200)
    ck = random_spelw(tmp_path)
    out = tmp_path / "p.json"
    assert decode_profile.main(["--model", str(ck), "--data", str(tmp_path), "--texts", "1", "--gen", "12",
                                "--prompt", "16", "--repeats", "1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    for mode in ("spec", "ar"):
        (call,) = got["calls"][mode]
        parts = call["products"] + call["delta"] + call["attention"] + call["head"]
        assert 0 < parts <= call["bodies"] + 1e-9 and call["round"] > 0, (mode, call)
        assert (call["verify"] is None) == (mode == "ar")
