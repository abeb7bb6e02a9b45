"""NoteBank tests: writer math, projection, ranking, storage arithmetic (pure numpy),
then the model-backed parts (planted toy, branching, replay, spec integration)."""
import importlib.util

import numpy as np
import pytest

import spel_mlx  # noqa: F401  (BLAS before mlx)
from spel_mlx import notebank as nb
from spel_mlx.cli.notebank import main
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
    a = nb.unit(rng.standard_normal((400, 64)).astype(np.float32))
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


def test_position_scores_top_channels():
    d = np.array([[0.1, 0.9, 0.5, 0.3], [0.2, 0.2, 0.2, 0.2]], np.float32)
    assert np.allclose(nb.position_scores(d, 1.0), [0.45, 0.2])
    assert np.allclose(nb.position_scores(d, 0.25), [0.9, 0.2])     # top 1 of 4
    assert np.allclose(nb.position_scores(d, 0.5), [0.7, 0.2])      # top 2 of 4
    assert np.allclose(nb.position_scores(d, 0.01), [0.9, 0.2])     # at least one channel
    assert nb.position_scores(np.zeros((0, 4), np.float32)).shape == (0,)


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
    common = nb.unit(rng.standard_normal((6, C, hd)).astype(np.float32))
    k = common[rng.integers(0, 6, T)] + 0.05 * rng.standard_normal((T, C, hd)).astype(np.float32)
    rare = []
    for lo, hi in needles:
        r = nb.unit(rng.standard_normal((hi - lo, C, hd)).astype(np.float32))
        k[lo:hi] = r + 0.05 * rng.standard_normal((hi - lo, C, hd)).astype(np.float32)
        rare.append(r)
    return nb.unit(k), rare, list(needles)


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
    k = nb.unit(np.random.default_rng(1).standard_normal((5, 4, 8)).astype(np.float32))
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
    k = nb.unit(np.random.default_rng(0).standard_normal((384, C, 64)).astype(np.float32))
    notes = w.write(k)
    assert sum(n.coords.nbytes + nb.NOTE_HEADER_BYTES for n in notes) == nb.notes_storage_bytes(6, C)


def test_config_validation():
    with pytest.raises(nb.NoteBankError, match="chunk"):
        nb.NoteBankConfig(chunk=0).validate()
    with pytest.raises(nb.NoteBankError, match="ranker"):
        nb.NoteBankConfig(ranker="max").validate()
    with pytest.raises(nb.NoteBankError, match="query_source"):
        nb.NoteBankConfig(query_source="v").validate()
    with pytest.raises(nb.NoteBankError, match="channel_top"):
        nb.NoteBankConfig(channel_top=0.0).validate()


# ============================================================================= model-backed
HAVE_MODEL = importlib.util.find_spec("spel_mlx.model") is not None
needs_model = pytest.mark.skipif(not HAVE_MODEL, reason="spel_mlx.model not available")


@pytest.fixture(scope="module")
def toy():
    from spel_mlx.tokenizer import ByteTokenizer
    model = nb.toy_model(0, tie_qk=True)
    tok = ByteTokenizer()
    tokens, needles = nb.needle_document(tok, 384, 3, 128, seed=0)
    bank = nb.NoteBank(model)
    state = model.new_state("target")
    bank.write(state, tokens)
    return model, tok, tokens, needles, bank, state


@needs_model
def test_needle_document_ranges_are_exact(toy):
    _, tok, tokens, needles, _, _ = toy
    assert len(tokens) == 384 and len(needles) == 3
    for i, n in enumerate(needles):
        assert tok.decode(tokens[n.start:n.end]) == f"KEY_{i + 1}={n.value};"
        assert n.start // 128 == i                      # one needle per chunk
        assert tok.decode(n.query) == f"?KEY_{i + 1}=" and n.value_token == ord(n.value[0])
    filler = set(tok.decode(tokens)) - set("".join(tok.decode(tokens[n.start:n.end]) for n in needles))
    assert filler <= set("aenost ")                     # needles use characters filler never does


@needs_model
def test_planted_toy_containment_and_recall(toy):
    model, _, tokens, needles, bank, state = toy
    assert state.pos == 384 and len(bank.notes) == 6
    assert [n.chunk for n in bank.notes] == [0, 0, 1, 1, 2, 2]
    assert nb.containment(bank.notes, [(n.start, n.end) for n in needles]) == 3
    for ranker in ("summed", "votes"):
        hits = 0
        for n in needles:
            r = bank.retrieve(state, n.query, ranker)
            assert len(r.top) == 2
            hits += nb.hit_at_r(r.top, n.start, n.end)
        assert hits == 3, ranker
    assert state.pos == 384 and state.pending == 0       # retrieval left the state as it was


@needs_model
def test_model_writer_matches_offline_writer_across_chunk_boundaries(toy):
    model, _, tokens, _, _, _ = toy
    cfg = nb.NoteBankConfig(chunk=12, span=4)            # chunk boundaries inside ring pieces
    bank = nb.NoteBank(model, cfg)
    st = model.new_state("target")
    bank.write(st, tokens[:64])
    _, k, _ = nb.run_captured(model, model.new_state("target"), tokens[:64])
    assert k.shape == (64, nb.gdn_channel_count(model.cfg), model.cfg.head_dim)
    offline = nb.NoteWriter(cfg, k.shape[1], k.shape[2]).write(k)
    assert [(n.start, n.end, n.chunk) for n in bank.notes] == [(n.start, n.end, n.chunk) for n in offline]
    assert all(np.array_equal(a.coords, b.coords) for a, b in zip(bank.notes, offline))
    assert len(bank.notes) == 2 * 5 + 1                  # 5 full chunks + a 4-token tail


@needs_model
def test_short_and_empty_contexts_with_model(toy):
    model = toy[0]
    bank = nb.NoteBank(model)
    st = model.new_state("target")
    rep = bank.write(st, [])
    assert rep.notes == 0 and rep.chunks == 0 and st.pos == 0
    r = bank.retrieve(st, [ord("?")], "summed")
    assert r.top == [] and st.pos == 0
    bank.write(st, [ord(c) for c in "abc"])             # shorter than one chunk and one span
    assert [(n.start, n.end) for n in bank.notes] == [(0, 3)]
    r = bank.retrieve(st, [ord(c) for c in "?ab"], "votes")
    assert [(n.start, n.end) for n in r.top] == [(0, 3)] and st.pos == 3
    with pytest.raises(nb.NoteBankError, match="position"):
        bank.write(model.new_state("target"), [1, 2])   # a state the bank was not written from


def _decode_from(model, state, first, n):
    import mlx.core as mx
    rows, t = [], first
    for _ in range(n):
        out = model.forward([t], state, strict=True)
        state.commit(1)
        mx.eval(out)
        row = np.asarray(out[-1], np.float32)
        rows.append(row)
        t = int(np.argmax(row))
    return np.stack(rows)


@needs_model
def test_restore_is_exact_after_retrieval_and_replay_branches(toy):
    model, _, tokens, needles, _, _ = toy
    ctx = tokens[:100]
    # with the branches: write notes (capture), retrieve, token replay + read, native replay + read
    bank = nb.NoteBank(model, nb.NoteBankConfig(chunk=32), strict=True)
    st = model.new_state("target")
    bank.write(st, ctx)
    before = st.snapshot()
    top = bank.retrieve(st, needles[0].query).top
    with nb.Branch(st):
        bank.replay_tokens(st, top)
        nb.feed(model, st, needles[0].query, strict=True)
        assert st.pos == 100 + sum(n.length for n in top) + len(needles[0].query)
    with nb.Branch(st):
        bank.replay_native(st, top)
        nb.feed(model, st, needles[0].query, strict=True)
    assert st.pos == 100 and st.pending == 0
    for i in before.gdn:                                   # the committed slot's arrays come back
        assert np.array_equal(np.asarray(st.committed_gdn(i)[0]), np.asarray(before.gdn[i][0]))
    with_branch = _decode_from(model, st, ord("x"), 8)
    # without any branch: plain prefill of the same context
    plain = model.new_state("target")
    nb.feed(model, plain, ctx, strict=True)
    without = _decode_from(model, plain, ord("x"), 8)
    assert with_branch.view(np.uint32).tobytes() == without.view(np.uint32).tobytes()


@needs_model
def test_native_replay_adds_span_state_only(toy):
    model, _, tokens, _, bank, _ = toy
    st = model.new_state("target")
    nb.feed(model, st, tokens[:40])
    snap = st.snapshot()
    note = bank.notes[0]
    payload = bank.span_state(note)
    # the payload is the committed S after running the span from an empty state
    fresh = model.new_state("target")
    nb.feed(model, fresh, tokens[note.start:note.end])
    for i in fresh.gdn_layers:
        assert np.array_equal(np.asarray(payload[i]), np.asarray(fresh.committed_gdn(i)[0]))
    with nb.Branch(st):
        bank.replay_native(st, [note])
        assert st.pos == 40
        for i in st.gdn_layers:
            S, tail = st.committed_gdn(i)
            assert np.array_equal(np.asarray(S), np.asarray(snap.gdn[i][0] + payload[i]))
            assert np.array_equal(np.asarray(tail), np.asarray(snap.gdn[i][1]))
    for i in st.gdn_layers:
        assert np.array_equal(np.asarray(st.committed_gdn(i)[0]), np.asarray(snap.gdn[i][0]))


def test_token_rank():
    assert nb.token_rank(np.array([0.1, 0.5, 0.3], np.float32), 1) == 1
    assert nb.token_rank(np.array([0.1, 0.5, 0.3], np.float32), 0) == 3
    assert nb.token_rank(np.array([0.5, 0.5, 0.3], np.float32), 1) == 1   # ties in its favour


HAVE_SPEC = importlib.util.find_spec("spel_mlx.decoding") is not None


@needs_model
@pytest.mark.skipif(not HAVE_SPEC, reason="spel_mlx.decoding not available")
def test_notebank_to_spec_keeps_greedy_fidelity(toy):
    from spel_mlx import decoding as spec
    from spel_mlx.decoding.mlx_proposer import MLXProposer
    model, _, tokens, needles, _, _ = toy
    ctx = tokens[:128]
    bank = nb.NoteBank(model, nb.NoteBankConfig(chunk=64))
    st = model.new_state("target")
    bank.write(st, ctx)
    top = bank.retrieve(st, needles[0].query).top
    prompt = ctx + [t for n in bank.replay_order(top) for t in bank.span_tokens(n)] + needles[0].query
    ar = spec.SpeculativeDecoder(model, None, mode="ar", k=4, options=spec.DecodeOptions(strict=True)).generate(prompt, 12)
    # raw speculation (the fidelity suites' policy): every round drafts, so fidelity is tested
    sd = spec.SpeculativeDecoder(model, MLXProposer(model, "draft", ring=5, strict=True), mode="spec", k=4,
                                 options=spec.DecodeOptions(strict=True, governor=spec.GovernorConfig(policy="off")))
    try:
        out = sd.generate(prompt, 12)
    finally:
        sd.close()
    assert out == ar and len(out) == 12
    assert sd.stats.proposed > 0                          # it really speculated


@needs_model
def test_demo_cli_toy_and_errors(tmp_path, capsys):
    out = tmp_path / "demo.json"
    rc = main(["demo", "--toy", "--tokens", "96", "--chunk", "32", "--span", "8", "--spec-tokens", "0",
               "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "writer needle containment" in text and "value rank, native replay" in text
    import json
    res = json.loads(out.read_text())
    assert res["context_tokens"] == 96 and res["chunks"] == 3 and res["notes"] == 6
    assert res["note_storage_bytes"] == 6 * (24 * 16 * 2 + 16)
    assert res["dense_kv_bytes"] == 96 * 8 * 2 * 128 * 4
    rc = main(["demo", "--checkpoint", str(tmp_path / "missing.spelw")])
    err = capsys.readouterr().err
    assert rc == 2 and "error" in err and "Traceback" not in err
    rc = main(["demo", "--toy", "--chunk", "0"])
    assert rc == 2 and "chunk" in capsys.readouterr().err


@needs_model
def test_incremental_writes_use_absolute_positions(toy):
    model, _, tokens, _, _, _ = toy
    cfg = nb.NoteBankConfig(chunk=32, span=8)
    whole = nb.NoteBank(model, cfg, strict=True)          # strict: piece grouping cannot matter
    whole.write(model.new_state("target"), tokens[:96])
    parts = nb.NoteBank(model, cfg, strict=True)
    st = model.new_state("target")
    parts.write(st, tokens[:64])                         # chunk-aligned split: same notes
    parts.write(st, tokens[64:96])
    assert st.pos == 96 and parts.tokens == tokens[:96]
    assert [(n.start, n.end, n.chunk) for n in parts.notes] == \
           [(n.start, n.end, n.chunk) for n in whole.notes]
    assert all(np.array_equal(a.coords, b.coords) for a, b in zip(parts.notes, whole.notes))
    with pytest.raises(nb.NoteBankError, match="uncommitted"):
        model.forward([1], st)
        parts.write(st, [2])


def test_needle_document_with_subword_tokenizer():
    from spel_mlx.tokenizer import DEFAULT_SP_MODEL, SentencePieceTokenizer
    import os
    if not os.path.isfile(DEFAULT_SP_MODEL):
        pytest.skip("no shipped SentencePiece model")
    tok = SentencePieceTokenizer(DEFAULT_SP_MODEL)
    tokens, needles = nb.needle_document(tok, 384, 3, 128, seed=1)
    assert len(tokens) == 384
    for i, n in enumerate(needles):
        assert tok.decode(tokens[n.start:n.end]) == f"KEY_{i + 1}={n.value};"
        # the query ends exactly where the value's first token begins
        joint = tok.encode(f"?KEY_{i + 1}={n.value}")
        assert joint[:len(n.query)] == n.query and joint[len(n.query)] == n.value_token
        assert tok.decode(n.query + [n.value_token]).startswith(f"?KEY_{i + 1}=")


@needs_model
def test_demo_on_shipped_checkpoint_when_installed(tmp_path, capsys):
    from spel_mlx.checkpoints.load import DEFAULT_DIR, DEFAULT_MODEL_FILE
    if not (DEFAULT_DIR / DEFAULT_MODEL_FILE).is_file():
        pytest.skip("no shipped checkpoint installed")
    out = tmp_path / "shipped.json"
    rc = main(["demo", "--checkpoint", str(DEFAULT_DIR), "--spec-tokens", "8", "--json", str(out)])
    capsys.readouterr()
    import json
    res = json.loads(out.read_text())
    assert rc == 0 and res["notes"] == 6 and res["chunks"] == 3
    if "skipped" not in res["spec"]:
        assert res["spec"]["matches_ar"] and res["spec"]["tokens"] == 8
