"""Trainer: loss goes down, a killed run resumes with the same losses, draft
distillation, controller, export, corpus (the training forward's math: test_model_training.py)."""
import json
import math
import os

import numpy as np
import pytest

import spel_mlx  # noqa: F401  (BLAS before mlx)
import mlx.core as mx
from spel_mlx.model import copy_target_to_draft, init_params
from spel_mlx.training import (config, corpus, data, export, loop, onpolicy, pipeline, runs, schedule,
                               steps)
from spel_mlx import layout, quant
from spel_mlx.config import ModelConfig
from spel_mlx.tokenizer import ByteTokenizer

# 4 layers with attn_period 2: GDN, attention, GDN, attention; draft of 3 layers
TINY = ModelConfig(d_model=32, n_layers=4, n_heads=2, head_dim=16, d_ff=48, vocab=128,
                   max_seq=256, attn_period=2, draft_map=(0, 1, 2))


# --- training runs on synthetic text ------------------------------------------
@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "it", "was", "red"]
    text = "\n".join(" ".join(rng.choice(words, 12)) + "." for _ in range(600)) + "\n"
    tr, he = corpus.split_heldout(text, every=5, phase=2)
    (d / "train.txt").write_text(tr)
    (d / "heldout.txt").write_text(he)
    return str(d)


def _tc(data_dir, **kw):
    base = dict(steps=12, batch=4, seq=32, lr=3e-3, warmup=3, eval_every=6, eval_tokens=512,
                ckpt_every=100, log_every=1, chunk=16, data=data_dir)
    base.update(kw)
    return config.TrainConfig(**base)


def _losses(run):
    return [r["loss"] for r in map(json.loads, open(os.path.join(run, "log.jsonl"))) if r["event"] == "step"]


@pytest.fixture(scope="module")
def target_run(tmp_path_factory, data_dir):
    run = str(tmp_path_factory.mktemp("runs") / "full")
    s = loop.train(run, TINY, _tc(data_dir, steps=30), tokenizer=ByteTokenizer(), quiet=True)
    return run, s


def test_training_reduces_loss(target_run):
    run, s = target_run
    losses = _losses(run)
    assert len(losses) == 30 and s["step"] == 30
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
    evals = [r for r in map(json.loads, open(os.path.join(run, "log.jsonl"))) if r["event"] == "eval"]
    assert [e["step"] for e in evals] == [6, 12, 18, 24, 30]
    assert evals[-1]["heldout_nats"] < evals[0]["heldout_nats"]


def test_killed_run_resumes_with_same_losses(tmp_path, data_dir):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    loop.train(full, TINY, _tc(data_dir), tokenizer=ByteTokenizer(), quiet=True)
    s = loop.train(part, TINY, _tc(data_dir), tokenizer=ByteTokenizer(), quiet=True, stop_after=5)
    assert s["step"] == 5
    assert runs.load_checkpoint_dir(part)[0]["step"] == 5
    loop.train(part, None, _tc(data_dir), tokenizer=ByteTokenizer(), quiet=True)   # resume
    a, b = _losses(full), _losses(part)
    assert len(a) == len(b) == 12
    assert a == b                                                                # bit-identical
    pa, pb = runs.load_checkpoint_dir(full)[2], runs.load_checkpoint_dir(part)[2]
    assert all(np.array_equal(np.array(pa[n]), np.array(pb[n])) for n in pa)


def test_batches_depend_only_on_seed_and_step():
    toks = np.arange(10000, dtype=np.int32)
    x1, y1 = data.batch_at(toks, 17, 3, 4, 8)
    x2, y2 = data.batch_at(toks, 17, 3, 4, 8)
    assert np.array_equal(x1, x2) and np.array_equal(y1[:, :-1], x1[:, 1:])
    assert not np.array_equal(data.batch_at(toks, 18, 3, 4, 8)[0], x1)


def test_draft_distillation(tmp_path, target_run, data_dir):
    trun, _ = target_run
    _, cfg, tparams, _, _ = runs.load_checkpoint_dir(trun)
    init = copy_target_to_draft(cfg, dict(tparams))
    assert np.array_equal(np.array(init["draft.layers.1.mixer.wqkv.weight"]),
                          np.array(tparams["layers.1.mixer.wqkv.weight"]))
    run = str(tmp_path / "draft")
    loop.train(run, None, _tc(data_dir, mode="draft", init=trun, steps=12, lr=2e-3),
               tokenizer=ByteTokenizer(), quiet=True)
    _, _, dparams, _, _ = runs.load_checkpoint_dir(run)
    for n in tparams:   # target, embedding and head frozen
        if not n.startswith("draft."):
            assert np.array_equal(np.array(tparams[n]), np.array(dparams[n])), n
    evals = [r for r in map(json.loads, open(os.path.join(run, "log.jsonl"))) if r["event"] == "eval"]
    assert evals[-1]["heldout_kl"] < evals[0]["heldout_kl"]
    assert 0.0 <= evals[-1]["heldout_top1_agree"] <= 1.0


def test_onpolicy_windows_and_mixture(tmp_path, target_run, data_dir):
    """Target-generated windows: prompt from the training text + the target's own
    greedy (even rows) continuation, reproducible; a draft batch mixes them in
    deterministically; a draft run trains on them and can continue a draft run."""
    from spel_mlx.model import SpelModel
    from spel_mlx.decoding import SpeculativeDecoder
    trun, _ = target_run
    out = str(tmp_path / "op.npy")
    r = onpolicy.generate_onpolicy(trun, out, minutes=5, data_dir=data_dir, seq=32, prompt_len=8,
                                   max_rows=4, quiet=True)
    rows = np.load(out)
    assert r["rows"] == 4 and rows.shape == (4, 33) and rows.dtype == np.int32
    _, cfg, params, _, _ = runs.load_checkpoint_dir(trun)
    model = SpelModel.from_weights(cfg, {n: params[n] for n in params})
    assert SpeculativeDecoder(model, None, "ar").generate(rows[0, :8].tolist(), 25) == rows[0, 8:].tolist()
    onpolicy.generate_onpolicy(trun, out + "2.npy", minutes=5, data_dir=data_dir, seq=32, prompt_len=8,
                               max_rows=4, quiet=True)
    assert np.array_equal(np.load(out + "2.npy"), rows)
    x, y = data.batch_at(np.arange(1000, dtype=np.int32), 3, 0, 4, 32)
    mx_, my = data.mix_onpolicy(x, y, rows, 3, 0, 0.5)
    assert all(any(np.array_equal(mx_[i], w[:-1]) and np.array_equal(my[i], w[1:]) for w in rows)
               for i in range(2))
    assert np.array_equal(mx_[2:], x[2:]) and np.array_equal(data.mix_onpolicy(x, y, rows, 3, 0, 0.5)[0], mx_)
    d1 = str(tmp_path / "d1")
    loop.train(d1, None, _tc(data_dir, mode="draft", init=trun, steps=6, lr=2e-3, onpolicy=out),
               tokenizer=ByteTokenizer(), quiet=True)
    d1p = runs.load_checkpoint_dir(d1)[2]
    d2 = str(tmp_path / "d2")   # continue the distilled draft: starts from d1's draft weights
    loop.train(d2, None, _tc(data_dir, mode="draft", init=d1, steps=1, lr=0.0, warmup=0, onpolicy=out),
               tokenizer=ByteTokenizer(), quiet=True)
    d2p = runs.load_checkpoint_dir(d2)[2]
    n = "draft.layers.1.mixer.wqkv.weight"
    assert np.array_equal(np.array(d1p[n]), np.array(d2p[n]))
    fresh = copy_target_to_draft(cfg, dict(params))[n]   # what a target init would give
    assert not np.array_equal(np.array(d1p[n]), np.array(fresh))
    with pytest.raises(config.TrainError, match="onpolicy data is for draft"):
        loop.train(str(tmp_path / "bad"), TINY, _tc(data_dir, onpolicy=out), tokenizer=ByteTokenizer(), quiet=True)


def test_export_spelw_and_f16_folder(tmp_path, target_run, data_dir):
    run, _ = target_run
    out = export.export_run(run, str(tmp_path / "model"), dtype="float16", data_dir=data_dir,
                            spelw_path=str(tmp_path / "m.spelw"))
    from spel_mlx.reader import load_checkpoint
    _, _, params, _, _ = runs.load_checkpoint_dir(run)
    full = load_checkpoint(str(tmp_path / "m.spelw"))
    half = load_checkpoint(out)
    assert full.cfg == half.cfg == TINY
    assert list(full.golden.tokens) == list(export.golden_tokens_from_heldout(data_dir, ByteTokenizer()))
    snapped = export.snap_draft({n: np.array(a) for n, a in params.items()})
    n_snapped = 0
    for n, a in params.items():
        a = np.array(a)
        if layout.draft_quant(n):   # the draft as it runs: on its grid, stored packed without loss
            n_snapped += 1
            assert not np.array_equal(snapped[n], a) and quant.on_grid(snapped[n], layout.draft_quant(n)), n
            assert np.array_equal(full.weights[n], snapped[n]) and np.array_equal(half.weights[n], snapped[n]), n
        else:
            assert np.array_equal(full.weights[n], a), n
            assert np.array_equal(half.weights[n], a.astype(np.float16).astype(np.float32)), n
    assert n_snapped > 3 * TINY.n_draft   # the MLP and the mixer projections of every draft layer
    assert not os.path.exists(os.path.join(out, "tokenizer.model"))   # vocab 128: ASCII bytes


# --- controller -----------------------------------------------------------------
def test_controller_schedule_plateau_and_spikes():
    tc = config.TrainConfig(steps=100, warmup=10, lr=1e-3, min_lr_frac=0.1, plateau_patience=2,
                            plateau_factor=0.5, spike_factor=4.0)
    c = schedule.Controller()
    assert c.lr(tc, 0) == pytest.approx(1e-4)
    assert c.lr(tc, 10) == pytest.approx(1e-3)
    assert c.lr(tc, 100) == pytest.approx(1e-4)
    assert c.observe_eval(tc, 10, 3.0) == ""
    assert c.observe_eval(tc, 20, 2.995) == ""          # not a real gain, 1 bad eval
    assert "plateau" in c.observe_eval(tc, 30, 3.1)     # 2nd bad eval -> LR halved
    assert c.lr_scale == 0.5 and c.lr(tc, 10) == pytest.approx(5e-4)
    d = schedule.Controller()                           # draft: relative gain on the KL
    tcd = config.TrainConfig(mode="draft", plateau_patience=1, plateau_min_delta=0.01)
    assert d.observe_eval(tcd, 1, 0.20) == ""
    assert d.observe_eval(tcd, 2, 0.197) == ""          # 1.5% better: a real gain
    assert "plateau" in d.observe_eval(tcd, 3, 0.1965)  # 0.25% better: not
    assert c.spike_threshold(tc) == math.inf            # no statistics yet
    for i in range(25):
        c.observe_step(tc, i, 3.0, 0.5, True)
    assert c.spike_threshold(tc) == pytest.approx(2.0)
    assert "skipped" in c.observe_step(tc, 26, 3.0, 50.0, False)
    assert c.skipped == 1
    c.history = [[s, 5.0 - 0.3 * math.log2(s)] for s in range(10, 200, 10)]
    conv = c.convergence(400)
    assert conv["slope_per_doubling"] == pytest.approx(-0.3, abs=1e-6)
    assert conv["projected_final"] == pytest.approx(5.0 - 0.3 * math.log2(400), abs=1e-5)


def test_spike_skips_update_in_graph():
    tc = config.TrainConfig(batch=2, seq=16, chunk=16)
    params = init_params(TINY, seed=1)
    names = [n for n in params if not n.startswith("draft.")]
    tr = {n: params[n] for n in names}
    fr = {n: params[n] for n in params if n not in tr}
    m = {n: mx.zeros_like(tr[n]) for n in names}
    step = steps.make_step(TINY, tc, names)
    x = mx.array(np.random.default_rng(0).integers(0, 128, (2, 16)).astype(np.int32))
    loss, gn, ok, p2, m2, v2 = step(tr, fr, m, m, x, x, mx.array(1e-3), mx.array(1.0), mx.array(1e-9))
    assert not bool(ok) and float(gn) > 0
    assert all(np.array_equal(np.array(p2[n]), np.array(tr[n])) for n in names)
    loss, gn, ok, p3, _, _ = step(tr, fr, m, m, x, x, mx.array(1e-3), mx.array(1.0), mx.array(1e9))
    assert bool(ok) and any(not np.array_equal(np.array(p3[n]), np.array(tr[n])) for n in names)


# --- corpus ---------------------------------------------------------------------
def test_heldout_split_is_contiguous_and_disjoint():
    text = "".join(f"line {i} " + "x" * (i % 97) + "\n" for i in range(20000))
    blocks = corpus.split_blocks(text)
    assert "".join(blocks) == text and all(b.endswith("\n") for b in blocks)
    tr, he = corpus.split_heldout(text)
    assert len(tr) + len(he) == len(text)
    held = [b for i, b in enumerate(blocks) if i % corpus.HELDOUT_EVERY == corpus.HELDOUT_PHASE]
    assert he == "".join(held) and all(b not in tr for b in held)


def test_r_character_vector_reader():
    import struct
    def rstr(s):
        b = s.encode()
        return struct.pack(">ii", 0x00040009, len(b)) + b
    blob = b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500) + struct.pack(">i", 5) + b"UTF-8"
    blob += struct.pack(">ii", 16, 3) + rstr("It is a truth") + struct.pack(">ii", 9, -1) + rstr("")
    assert corpus._read_r_character_vector(blob, "x") == ["It is a truth", "", ""]
    with pytest.raises(corpus.CorpusError, match="truncated"):
        corpus._read_r_character_vector(blob[:-3], "x")


def test_missing_debian_package_is_named(monkeypatch, tmp_path):
    with pytest.raises(corpus.CorpusError, match="r-cran-janeaustenr"):
        corpus.read_austen(str(tmp_path))
    monkeypatch.setattr(corpus.shutil, "which", lambda _: None)
    with pytest.raises(corpus.CorpusError, match="bible-kjv"):
        corpus.read_kjv()


def test_clean_kjv_drops_verse_numbers():
    raw = "\nGenesis 1\n\n  1 In the beginning God created the heaven and the earth.\n" \
          "  2 And the earth was without form, and void; and darkness was upon the face of\n" \
          "the deep.\n"
    assert corpus.clean_kjv(raw) == ("Genesis 1\nIn the beginning God created the heaven and the earth.\n"
                                     "And the earth was without form, and void; and darkness was upon "
                                     "the face of the deep.\n")


def test_resume_can_extend_the_schedule(tmp_path, data_dir):
    run = str(tmp_path / "ext")
    loop.train(run, TINY, _tc(data_dir, steps=8), tokenizer=ByteTokenizer(), quiet=True)
    s = loop.train(run, None, _tc(data_dir), tokenizer=ByteTokenizer(), quiet=True, extend_to=14)
    assert s["step"] == 14 and runs.load_checkpoint_dir(run)[0]["train"]["steps"] == 14
    assert len(_losses(run)) == 14
    with pytest.raises(config.TrainError, match="below the run's current step"):
        loop.train(run, None, _tc(data_dir), tokenizer=ByteTokenizer(), quiet=True, extend_to=3)


def test_a_live_run_directory_is_locked(tmp_path):
    run = str(tmp_path / "locked")
    os.makedirs(run)
    held = runs.lock_run(run)
    with pytest.raises(config.TrainError, match="in use by another training process"):
        runs.lock_run(run)
    held.close()
    runs.lock_run(run).close()


def test_train_all_pipeline_runs_both_on_policy_rounds_and_resumes(tmp_path):
    """`train all` on a tiny shape with second-scale budgets: every step runs once
    (two on-policy rounds, the second on both rounds' windows); running it again
    skips them all and exports the same bytes."""
    import argparse
    rng = np.random.default_rng(1)
    letters = list("abcdefghijklmnopqrstuvwxyz")
    words = ["".join(rng.choice(letters, rng.integers(2, 7))) for _ in range(200)]
    text = "\n".join(" ".join(rng.choice(words, 14)) + "." for _ in range(1200)) + "\n"
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    tr, he = corpus.split_heldout(text, every=5, phase=2)
    (corpus_dir / "train.txt").write_text(tr)
    (corpus_dir / "heldout.txt").write_text(he)
    (corpus_dir / "manifest.json").write_text("{}")
    runs_dir = tmp_path / "runs"
    a = argparse.Namespace(
        runs=str(runs_dir), data=str(corpus_dir), vocab=300, out=str(tmp_path / "export"),
        config="d_model=32,n_layers=4,n_heads=2,head_dim=16,d_ff=48,max_seq=512,attn_period=2,draft_map=0:1:2",
        tokenizer_out=str(runs_dir / "tokenizer.model"), target_min=0.03, draft_min=0.01, onpolicy_min=0.005,
        onpolicy_draft_min=0.01, onpolicy2_min=0.005, onpolicy2_draft_min=0.01)
    r = pipeline.train_all(a)
    ran = set(r["minutes"])
    assert {"tokenizer", "target", "draft", "onpolicy windows", "draft on-policy", "onpolicy windows 2",
            "draft on-policy 2", "export"} <= ran
    w1, w2, w_all = (np.load(runs_dir / f) for f in ("onpolicy.npy", "onpolicy2.npy", "onpolicy_all.npy"))
    assert len(w1) >= 1 and len(w2) >= 1 and np.array_equal(w_all, np.concatenate([w1, w2]))
    state = json.load(open(runs_dir / "draft_onpolicy2" / "ckpt" / "state.json"))
    assert state["step"] >= 1
    model = open(tmp_path / "export" / "model.safetensors", "rb").read()
    mtime = os.path.getmtime(runs_dir / "onpolicy2.npy")
    pipeline.train_all(a)                                  # everything done: skips, re-exports
    assert open(tmp_path / "export" / "model.safetensors", "rb").read() == model
    assert os.path.getmtime(runs_dir / "onpolicy2.npy") == mtime


# --- distillation for sampled decoding ------------------------------------------
def _np_kl(t, d, temp):
    def log_softmax(z):
        z = z.astype(np.float64) / temp
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))
    tl, dl = log_softmax(t), log_softmax(d)
    return float(np.mean(np.sum(np.exp(tl) * (tl - dl), axis=-1)))


def test_tempered_kl_matches_numpy_and_t1_is_the_plain_kl():
    rng = np.random.default_rng(3)
    t = (rng.standard_normal((2, 7, 64)) * 3).astype(np.float32)
    d = (t + rng.standard_normal((2, 7, 64)) * 1.5).astype(np.float32)
    tm, dm = mx.array(t), mx.array(d)
    for temp in (0.5, 0.7, 2.0):
        ref = _np_kl(t, d, temp)
        assert float(steps.kl_target_draft(tm, dm, temp)) == pytest.approx(ref, rel=1e-5)
        assert float(steps.distill_loss(tm, dm, temp)) == pytest.approx(ref, rel=1e-5)
        mixed = 0.75 * ref + 0.25 * _np_kl(t, d, 1.0)
        assert float(steps.distill_loss(tm, dm, temp, 0.25)) == pytest.approx(mixed, rel=1e-5)
    assert abs(_np_kl(t, d, 0.7) - _np_kl(t, d, 1.0)) > 0.05       # the temperature matters here
    # T = 1: the loss as it was before the temperature existed, bit for bit, whatever the weight
    tl = tm - mx.logsumexp(tm, axis=-1, keepdims=True)
    dl = dm - mx.logsumexp(dm, axis=-1, keepdims=True)
    old = np.array(mx.mean(mx.sum(mx.exp(tl) * (tl - dl), axis=-1)))
    for w in (0.0, 0.3, 1.0):
        assert np.array_equal(np.array(steps.distill_loss(tm, dm, 1.0, w)), old)


def test_draft_step_at_t1_is_the_old_step_and_a_temperature_changes_it():
    params = init_params(TINY, seed=2)
    params = copy_target_to_draft(TINY, dict(params))
    names = [n for n in params if n.startswith("draft.")]
    tr = {n: params[n] for n in names}
    fr = {n: params[n] for n in params if n not in tr}
    m = {n: mx.zeros_like(tr[n]) for n in names}
    x = mx.array(np.random.default_rng(0).integers(0, 128, (2, 16)).astype(np.int32))

    def run(**kw):
        tc = config.TrainConfig(mode="draft", batch=2, seq=16, chunk=16, **kw)
        out = steps.make_step(TINY, tc, names)(tr, fr, m, m, x, x, mx.array(1e-3), mx.array(1.0),
                                                mx.array(1e9))
        return np.array(out[0]), out[3]
    loss0, p0 = run()
    loss1, p1 = run(distill_temperature=1.0, distill_t1_weight=0.4)
    assert np.array_equal(loss0, loss1) and all(np.array_equal(np.array(p0[n]), np.array(p1[n])) for n in names)
    loss_t, _ = run(distill_temperature=0.7)
    assert not np.array_equal(loss_t, loss0)


def test_draft_run_starts_from_an_exported_model(tmp_path, target_run, data_dir):
    """An exported folder as --init: its (float16) target and draft are the start
    point, bit for bit; a tempered draft run from it logs its objective."""
    from spel_mlx.reader import load_checkpoint
    trun, _ = target_run
    d1 = str(tmp_path / "d1")
    loop.train(d1, None, _tc(data_dir, mode="draft", init=trun, steps=4, lr=2e-3), tokenizer=ByteTokenizer(),
               quiet=True)
    folder = export.export_run(d1, str(tmp_path / "model"), dtype="float16", data_dir=data_dir,
                               spelw_path=str(tmp_path / "m.spelw"))
    shipped = load_checkpoint(folder).weights
    d2 = str(tmp_path / "d2")
    loop.train(d2, None, _tc(data_dir, mode="draft", init=folder, steps=1, lr=0.0, warmup=0),
               tokenizer=ByteTokenizer(), quiet=True)
    started = runs.load_checkpoint_dir(d2)[2]
    assert set(started) == set(shipped)
    for n in shipped:
        assert np.array_equal(np.array(started[n]), shipped[n]), n
    n = "draft.layers.1.mixer.wqkv.weight"      # the distilled draft, not copies of target layers
    assert not np.array_equal(shipped[n], shipped["layers.1.mixer.wqkv.weight"])
    d3 = str(tmp_path / "d3")
    s = loop.train(d3, None, _tc(data_dir, mode="draft", init=folder, steps=6, lr=1e-3, distill_temperature=0.7,
                                 distill_t1_weight=0.25), tokenizer=ByteTokenizer(), quiet=True)
    assert s["heldout_objective"] > 0 and s["heldout_objective"] != s["heldout_kl"]
    tuned = runs.load_checkpoint_dir(d3)[2]
    assert all(np.array_equal(np.array(tuned[n]), shipped[n]) for n in shipped if not n.startswith("draft."))
    with pytest.raises(config.TrainError, match="neither a run directory nor a loadable model"):
        loop.train(str(tmp_path / "bad"), None, _tc(data_dir, mode="draft", init=str(tmp_path / "m.spelw") + "x"),
                   tokenizer=ByteTokenizer(), quiet=True)
    with pytest.raises(config.TrainError, match="distill-temperature"):
        loop.train(str(tmp_path / "bad2"), None, _tc(data_dir, mode="draft", init=folder, distill_temperature=0.0),
                   tokenizer=ByteTokenizer(), quiet=True)


def test_onpolicy_windows_sampled_as_generate_defaults(tmp_path, target_run, data_dir):
    """--sampling defaults: the sampled rows are ar decoding at T 0.7, top-p 0.95,
    penalty 1.1 with a seed per row; --greedy-share 0.25: rows 0 and 4 greedy."""
    from spel_mlx.model import SpelModel
    from spel_mlx.decoding import SamplingParams, SpeculativeDecoder
    trun, _ = target_run
    out = str(tmp_path / "op.npy")
    kw = dict(minutes=5, data_dir=data_dir, seq=32, prompt_len=8, max_rows=5, quiet=True, seed=3)
    r = onpolicy.generate_onpolicy(trun, out, sampling="defaults", greedy_share=0.25, **kw)
    rows = np.load(out)
    assert r["rows"] == 5 and rows.shape == (5, 33)
    _, cfg, params, _, _ = runs.load_checkpoint_dir(trun)
    model = SpelModel.from_weights(cfg, dict(params))
    greedy = SpeculativeDecoder(model, None, "ar")
    train_tok = data.load_tokens(data_dir, ByteTokenizer(), "train")
    rng = np.random.default_rng([3, 7])
    for i, row in enumerate(rows):
        s = int(rng.integers(0, len(train_tok) - 8))
        assert np.array_equal(row[:8], train_tok[s:s + 8])
        if i % 4 == 0:
            assert greedy.generate(row[:8].tolist(), 25) == row[8:].tolist()
            continue
        p = SamplingParams(temperature=0.7, top_p=0.95, repetition_penalty=1.1, seed=int(rng.integers(0, 2 ** 62)))
        assert SpeculativeDecoder(model, None, "ar", params=p).generate(row[:8].tolist(), 25) == row[8:].tolist()
        assert greedy.generate(row[:8].tolist(), 25) != row[8:].tolist()      # sampled, not greedy
    onpolicy.generate_onpolicy(trun, out + "2.npy", sampling="defaults", greedy_share=0.25, **kw)
    assert np.array_equal(np.load(out + "2.npy"), rows)
    with pytest.raises(config.TrainError, match="--sampling"):
        onpolicy.generate_onpolicy(trun, out, sampling="hot", **kw)
    with pytest.raises(config.TrainError, match="--greedy-share"):
        onpolicy.generate_onpolicy(trun, out, greedy_share=1.5, **kw)


def test_documents_end_at_chapter_headings():
    """mark_documents: a mark before each heading once the document holds DOC_MIN_BYTES
    (a title block or a volume line stays with the chapter after it), one at the end."""
    from spel_mlx.tokenizer import EOT_LINE
    C = corpus
    para = "x" * (C.DOC_MIN_BYTES + 10) + "\n"
    text = "PRIDE AND PREJUDICE\nby Jane Austen\nCHAPTER 1\n" + para + "VOLUME II\nCHAPTER 2\n" + para + \
        "CHAPTER 3\nshort\nCHAPTER 4\n" + para
    out = C.mark_documents(text, C.AUSTEN_HEADING)
    docs = out.split(EOT_LINE)
    assert docs[-1] == "" and len(docs) == 4
    assert docs[0].startswith("PRIDE") and docs[1].startswith("VOLUME II\nCHAPTER 2\n")
    assert docs[2].startswith("CHAPTER 3\nshort\nCHAPTER 4\n")   # a short chapter joins the next
    assert out.replace(EOT_LINE, "") == text
    kjv = "Genesis 1\n" + para + "Genesis 2\n" + para
    assert C.mark_documents(kjv, C.KJV_HEADING).count(EOT_LINE) == 2


def _write_zcom4(module_dir, testaments):
    """A SWORD zCom4 module: per testament, one zlib block per book (its entries
    concatenated) and 10-byte entry records; the first record of each list is repeated,
    as SWORD links one comment to several verses."""
    import struct
    import zlib
    module_dir.mkdir()
    for name, books in testaments.items():
        bzs, bzz, bzv = b"", b"", b""
        for b, entries in enumerate(books):
            raw = "".join(entries).encode()
            packed = zlib.compress(raw)
            bzs += struct.pack("<III", len(bzz), len(packed), len(raw))
            bzz += packed
            start = 0
            for e in entries:
                n = len(e.encode())
                bzv += struct.pack("<IIH", b, start, n) * (2 if start == 0 else 1)
                start += n
        for ext, blob in ((".bzs", bzs), (".bzv", bzv), (".bzz", bzz)):
            (module_dir / (name + ext)).write_bytes(blob)


def test_mhcc_reader_cleans_and_leaves_out_held_out_chapters(tmp_path):
    """read_mhcc reads a zCom4 module (linked entries once), clean_mhcc turns OSIS into
    lines, and mhcc_text leaves out the chapters the KJV split holds out."""
    from spel_mlx.tokenizer import EOT_LINE
    C = corpus
    gen = ['<div type="book"/>', '<chapter osisID="Gen.1"/> ',
           '<title type="x-ms">Genesis</title><div sID="a" type="x-p"/> Genesis is &quot;the book&quot;.',
           '<hi type="bold">Verses 1-2</hi> God  said, Let there be light.',
           '<chapter osisID="Gen.2"/> ', '<hi type="bold">Verses 1-3</hi> The first sabbath.']
    _write_zcom4(tmp_path / "mhcc", {"ot": [gen], "nt": [['<chapter osisID="Matt.1"/>', "Genealogy."]]})
    chapters = C.read_mhcc(str(tmp_path / "mhcc"))
    assert [c for c, _ in chapters] == ["Gen.1", "Gen.2", "Matt.1"]
    assert C.clean_mhcc(chapters[0][1]) == ('Genesis is "the book".\nVerses 1-2\n'
                                            "God said, Let there be light.")
    assert C.mhcc_text(chapters, {(0, 2)}).split(EOT_LINE) == [
        C.clean_mhcc(chapters[0][1]) + "\n", "Genealogy.\n", ""]
    # the KJV chapters a held-out block touches: the one it starts in and each it heads
    verse = "v" * 100 + "\n"
    kjv = "".join(f"Genesis {c}\n" + verse * 50 for c in range(1, 80))
    held = C.kjv_chapters_held_out(kjv)
    blocks = C.split_blocks(kjv)
    touched = set()
    chapter = None
    for i, b in enumerate(blocks):
        starts = [int(line.split()[1]) for line in b.splitlines() if line.startswith("Genesis")]
        if i % C.HELDOUT_EVERY == C.HELDOUT_PHASE:
            touched |= {(0, c) for c in ([chapter] if chapter else []) + starts}
        chapter = starts[-1] if starts else chapter
    assert held == touched and len(held) >= 2
    (tmp_path / "mhcc" / "ot.bzs").write_bytes(b"\0" * 11)
    with pytest.raises(C.CorpusError, match="12- and 10-byte records"):
        C.read_mhcc(str(tmp_path / "mhcc"))
    with pytest.raises(C.CorpusError, match="sword-comm-mhcc"):
        C.read_mhcc(str(tmp_path / "none"))


def test_draft_run_with_its_own_draft_map(tmp_path, target_run, data_dir):
    """--draft-map: a draft of other target layers distilled from a target run (its layers
    start as copies of those), saved with the new map; a draft run cannot change it."""
    trun, _ = target_run
    _, _, tparams, _, _ = runs.load_checkpoint_dir(trun)
    run = str(tmp_path / "two")
    loop.train(run, None, _tc(data_dir, mode="draft", init=trun, steps=2, draft_map="0:3"),
               tokenizer=ByteTokenizer(), quiet=True, stop_after=1)
    _, cfg, dparams, _, _ = runs.load_checkpoint_dir(run)
    assert cfg.draft_map == (0, 3) and cfg.draft_params() < TINY.draft_params()
    assert "draft.layers.2.attn_norm.weight" not in dparams
    # draft layer 1 started as target layer 3 (one Adam step of lr 3e-3 from it), not layer 1
    d1, t3, t1 = (np.array(p[n]) for p, n in ((dparams, "draft.layers.1.mixer.wqkv.weight"),
                                               (tparams, "layers.3.mixer.wqkv.weight"),
                                               (tparams, "layers.1.mixer.wqkv.weight")))
    assert np.abs(d1 - t3).max() < 2 * 3e-3 < np.abs(d1 - t1).max()
    with pytest.raises(config.TrainError, match="out of range"):
        loop.train(str(tmp_path / "bad"), None, _tc(data_dir, mode="draft", init=trun, draft_map="0:9"),
                   tokenizer=ByteTokenizer(), quiet=True)
    with pytest.raises(config.TrainError, match="starts from a target run"):
        loop.train(str(tmp_path / "again"), None, _tc(data_dir, mode="draft", init=run, draft_map="0:1:2"),
                   tokenizer=ByteTokenizer(), quiet=True)


def test_target_run_continues_from_an_exported_model(tmp_path, target_run, data_dir):
    """`train target --init MODEL`: the exported target (float16) is the start point bit
    for bit, its draft rides along frozen, the shape comes from MODEL (a different
    --config is refused), and training moves the target only."""
    from spel_mlx.reader import load_checkpoint
    trun, _ = target_run
    folder = export.export_run(trun, str(tmp_path / "model"), dtype="float16", data_dir=data_dir,
                               spelw_path=str(tmp_path / "m.spelw"))
    shipped = load_checkpoint(folder).weights
    t0 = str(tmp_path / "t0")
    loop.train(t0, None, _tc(data_dir, init=folder, steps=1, lr=0.0, warmup=0), tokenizer=ByteTokenizer(), quiet=True)
    started = runs.load_checkpoint_dir(t0)[2]
    assert set(started) == set(shipped)
    assert all(np.array_equal(np.array(started[n]), shipped[n]) for n in shipped), "lr 0 moved a weight"
    t1 = str(tmp_path / "t1")
    s = loop.train(t1, TINY, _tc(data_dir, init=folder, steps=6, lr=1e-3, seed=1), tokenizer=ByteTokenizer(),
                   quiet=True)
    assert s["step"] == 6
    tuned = runs.load_checkpoint_dir(t1)[2]
    moved = [n for n in shipped if not np.array_equal(np.array(tuned[n]), shipped[n])]
    assert moved and not any(n.startswith("draft.") for n in moved)
    assert all(np.array_equal(np.array(tuned[n]), shipped[n]) for n in shipped if n.startswith("draft."))
    other = TINY.__class__(**{**TINY.to_dict(), "d_ff": 64})
    with pytest.raises(config.TrainError, match="keeps its shape"):
        loop.train(str(tmp_path / "bad"), other, _tc(data_dir, init=folder), tokenizer=ByteTokenizer(), quiet=True)
