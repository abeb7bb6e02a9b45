"""NoteBank tests: writer math, projection, ranking, storage arithmetic (pure numpy),
then the model-backed parts (planted toy, branching, replay, spec integration)."""
import importlib.util

import numpy as np
import pytest

import spel_mlx  # noqa: F401  (BLAS before mlx)
from spel_mlx import notebank as nb
from spel_mlx.config import PRESETS, ModelConfig


# ----------------------------------------------------------------------------- BF16
def test_bf16_round_to_nearest_even_and_specials():
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-9, -2.0, np.inf, -np.inf, 0.0, -0.0], np.float32)
    back = nb.from_bf16_bits(nb.to_bf16_bits(x))
    # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0)
    assert back.tolist() == [1.0, 1.0, 1 + 2**-7, -2.0, np.inf, -np.inf, 0.0, -0.0]
    assert np.signbit(back[-1])
    assert np.isnan(nb.from_bf16_bits(nb.to_bf16_bits(np.array([np.nan], np.float32))))[0]
    # every bf16 value survives a round trip bit for bit
    allbits = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
    finite = ~np.isnan(nb.from_bf16_bits(allbits))
    assert np.array_equal(nb.to_bf16_bits(nb.from_bf16_bits(allbits))[finite], allbits[finite])


# ----------------------------------------------------------------------------- projection
def test_sparse_projection_is_fixed_sparse_and_balanced():
    p1 = nb.sparse_projection(5, 64, 16, seed=7)
    p2 = nb.sparse_projection(5, 64, 16, seed=7)
    p3 = nb.sparse_projection(5, 64, 16, seed=8)
    assert np.array_equal(p1, p2) and not np.array_equal(p1, p3)
    assert p1.shape == (5, 16, 64)
    # exactly one nonzero (+-1) per input coordinate, 4 per output coordinate
    assert ((p1 != 0).sum(axis=1) == 1).all()
    assert ((p1 != 0).sum(axis=2) == 4).all()
    assert set(np.unique(p1[p1 != 0]).tolist()) == {-1.0, 1.0}
    # channels get different projections
    assert not np.array_equal(p1[0], p1[1])


def test_projection_preserves_inner_products_on_average():
    rng = np.random.default_rng(0)
    proj = nb.sparse_projection(400, 64, 16, seed=1)
    a = nb._unit(rng.standard_normal((400, 64)).astype(np.float32))
    err = np.einsum("cph,ch->cp", proj, a)
    # squared norm is preserved in expectation (each channel an independent sketch)
    assert abs(float((err ** 2).sum(axis=1).mean()) - 1.0) < 0.05


# ----------------------------------------------------------------------------- writer
def test_distinctiveness_formula():
    k = np.zeros((3, 1, 2), np.float32)
    k[0, 0] = [1, 0]
    k[1, 0] = [1, 0]
    k[2, 0] = [0, 1]
    d = nb.key_distinctiveness(k)
    mu = np.array([2, 1], np.float32) / np.sqrt(5)
    assert np.allclose(d[:, 0], [1 - mu[0], 1 - mu[0], 1 - mu[1]], atol=1e-6)


def test_select_spans_greedy_nonoverlapping_ties_first():
    d = np.zeros(20)
    d[12:14] = 1.0
    d[3] = 1.0
    spans = nb.select_spans(d, 4, 3)
    assert spans[0][:2] == (10, 14)   # first window holding both 12 and 13 (10, 11, 12 tie)
    assert spans[1][:2] == (0, 4)     # windows 0..3 each hold position 3: earliest wins
    assert spans[0][2] == 0.5         # reported score: mean raw distinctiveness
    assert all(e - s == 4 for s, e, _ in spans)
    starts = sorted(s for s, _, _ in spans)
    assert all(b - a >= 4 for a, b in zip(starts, starts[1:]))
    assert nb.select_spans(np.zeros(0), 4, 2) == []
    # a chunk shorter than the span gives one span covering it
    assert nb.select_spans(np.ones(3), 16, 2) == [(0, 3, 1.0)]


def planted_keys(T=384, C=12, hd=32, needles=((40, 52), (170, 182), (300, 312)), seed=0):
    """Filler keys from 6 common directions (common characters) plus noise; every needle
    position has a rare direction of its own (rare characters), as a planted
    ``KEY_n=VALUE;`` span gives. Returns keys, the per-needle rare keys, the needles."""
    rng = np.random.default_rng(seed)
    common = nb._unit(rng.standard_normal((6, C, hd)).astype(np.float32))
    k = common[rng.integers(0, 6, T)] + 0.05 * rng.standard_normal((T, C, hd)).astype(np.float32)
    rare = []
    for lo, hi in needles:
        r = nb._unit(rng.standard_normal((hi - lo, C, hd)).astype(np.float32))
        k[lo:hi] = r + 0.05 * rng.standard_normal((hi - lo, C, hd)).astype(np.float32)
        rare.append(r)
    return nb._unit(k), rare, list(needles)


def test_writer_containment_and_recall_on_planted_keys():
    k, rare, needles = planted_keys()
    cfg = nb.NoteBankConfig()
    w = nb.NoteWriter(cfg, 12, 32)
    notes = w.write(k)
    assert len(notes) == 6 and [n.chunk for n in notes] == [0, 0, 1, 1, 2, 2]
    assert nb.containment(notes, needles) == 3
    assert all(n.coords.dtype == np.uint16 and n.coords.shape == (12, 16) for n in notes)
    for ranker in ("summed", "votes"):
        for i, (lo, hi) in enumerate(needles):
            qs = rare[i][2:6]          # the query repeats part of the needle ("Y_n=")
            r = nb.address(notes, qs, w.projection, cfg, ranker=ranker)
            assert len(r.top) == 2
            assert nb.hit_at_r(r.top, lo, hi), (ranker, i)
            assert nb.contains(notes[r.order[0]], lo, hi), (ranker, i)


def test_writer_is_deterministic_and_chunked():
    k, _, _ = planted_keys(seed=3)
    a = nb.NoteWriter(nb.NoteBankConfig(), 12, 32).write(k)
    b = nb.NoteWriter(nb.NoteBankConfig(), 12, 32)
    got = []
    for ci, c0 in enumerate(range(0, 384, 128)):
        got += b.write_chunk(k[c0:c0 + 128], c0, ci)
    assert [(n.start, n.end) for n in a] == [(n.start, n.end) for n in got]
    assert all(np.array_equal(x.coords, y.coords) for x, y in zip(a, got))
    c = nb.NoteWriter(nb.NoteBankConfig(chunk=64), 12, 32).write(k)
    assert len(c) == 12 and max(n.chunk for n in c) == 5


def test_empty_context_and_short_context():
    cfg = nb.NoteBankConfig()
    w = nb.NoteWriter(cfg, 4, 8)
    assert w.write(np.zeros((0, 4, 8), np.float32)) == []
    r = nb.address([], np.ones((3, 4, 8), np.float32), w.projection, cfg)
    assert r.top == [] and r.order.size == 0
    # empty query: zero query vector, every note scores 0 -> order by index
    k = nb._unit(np.random.default_rng(1).standard_normal((5, 4, 8)).astype(np.float32))
    notes = w.write(k)
    assert [(n.start, n.end) for n in notes] == [(0, 5)]   # one span covering the short context
    r = nb.address(notes, np.zeros((0, 4, 8), np.float32), w.projection, cfg)
    assert r.order.tolist() == [0] and float(np.abs(r.similarity).sum()) == 0.0
    # a context of one token
    one = nb.NoteWriter(cfg, 4, 8).write(k[:1])
    assert [(n.start, n.end) for n in one] == [(0, 1)]
    with pytest.raises(nb.NoteBankError):
        w.write(np.zeros((3, 5, 8), np.float32))


def test_ranking_ties_and_votes():
    sim = np.array([[0.5, 0.1], [0.5, 0.1], [0.2, 0.9], [0.1, 0.5]], np.float32)
    assert nb.rank_summed(sim).tolist() == [2, 0, 1, 3]     # 1.1, 0.6, 0.6 (tie -> index), 0.6
    assert nb.channel_votes(sim).tolist() == [1, 1, 1, 0]   # tied maxima each get a vote
    assert nb.rank_votes(sim).tolist() == [2, 0, 1, 3]      # 1 vote each: summed, then index
    sim2 = np.array([[0.9, 0.9, -1.0], [0.8, 0.8, 0.8]], np.float32)
    assert nb.rank_summed(sim2).tolist() == [1, 0]
    assert nb.rank_votes(sim2).tolist() == [0, 1]           # 2 votes beat 1 vote
    same = np.ones((3, 4), np.float32)
    assert nb.rank_summed(same).tolist() == [0, 1, 2]
    assert nb.rank_votes(same).tolist() == [0, 1, 2]
    assert nb.rank_summed(np.zeros((0, 4), np.float32)).size == 0


def test_storage_arithmetic():
    cfg = PRESETS["21m"]
    C = len(cfg.gdn_layers) * cfg.n_heads
    assert C == 54
    assert nb.note_bytes(C) == 54 * 16 * 2 + 16 == 1744
    assert nb.notes_storage_bytes(6, C) == 10464
    # the original's figures for a 384-token context
    assert nb.dense_kv_bytes(cfg, 384) == 14_155_776
    assert nb.hybrid_kv_bytes(cfg, 384) == 3_538_944
    toy = ModelConfig(d_model=128, n_layers=8, n_heads=4, head_dim=32, d_ff=256,
                      draft_map=(0, 3, 4, 6))
    assert nb.dense_kv_bytes(toy, 384) == 3_145_728
    assert nb.hybrid_kv_bytes(toy, 384) == 786_432
    assert nb.recurrent_state_bytes(cfg) == 9 * (6 * 64 * 64 + 2 * 384) * 4
    w = nb.NoteWriter(nb.NoteBankConfig(), C, 64)
    k = nb._unit(np.random.default_rng(0).standard_normal((384, C, 64)).astype(np.float32))
    notes = w.write(k)
    assert sum(n.coords.nbytes + nb.NOTE_HEADER_BYTES for n in notes) == nb.notes_storage_bytes(6, C)


def test_config_validation():
    with pytest.raises(nb.NoteBankError, match="chunk"):
        nb.NoteBankConfig(chunk=0).validate()
    with pytest.raises(nb.NoteBankError, match="ranker"):
        nb.NoteBankConfig(ranker="max").validate()
    with pytest.raises(nb.NoteBankError, match="query_source"):
        nb.NoteBankConfig(query_source="v").validate()
