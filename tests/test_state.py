"""DecodeState: O(1) commit (identity, no allocation), errors, snapshot/restore."""
import numpy as np
import pytest

import spel_mlx  # noqa: F401
import mlx.core as mx
from spel_mlx.config import ModelConfig
from spel_mlx.model import SpelModel, init_weights
from spel_mlx.model.state import DecodeState, StateError

CFG = ModelConfig(d_model=64, n_layers=4, n_heads=2, head_dim=32, d_ff=96, vocab=64,
                  max_seq=48, attn_period=2, draft_map=(0, 1), spec_k=4)


@pytest.fixture(scope="module")
def model():
    return SpelModel.from_weights(CFG, init_weights(CFG, seed=3))


def toks(n, seed=0):
    return np.random.default_rng(seed).integers(0, CFG.vocab, n)


def state_arrays(st):
    """Every ring slot's (S, tail) as arrays (a slot written from a pass's stacked
    output becomes its row view when first read) and the KV caches."""
    arrs = [a for i in st.gdn_layers for slot in range(st.ring) for a in st.slot_gdn(i, slot)]
    arrs += list(st.k_cache.values()) + list(st.v_cache.values())
    return arrs


@pytest.mark.parametrize("n", [1, 2, 5])
def test_commit_moves_indices_only(model, n):
    st = model.new_state()
    model.prefill(toks(7), st)
    model.forward(toks(5, 1), st)
    R = st.ring
    expect = {i: st.slot_gdn(i, (st.read + n) % R) for i in st.gdn_layers}
    mx.eval(state_arrays(st))
    ids_before = [id(a) for a in state_arrays(st)]
    mem_before = mx.get_active_memory()
    read_before = st.read
    st.commit(n)
    assert mx.get_active_memory() == mem_before
    assert [id(a) for a in state_arrays(st)] == ids_before      # no array created or replaced
    assert st.read == (read_before + n) % R and st.pos == 7 + n and st.pending == 0
    for i, (S, tail) in expect.items():
        got_S, got_tail = st.committed_gdn(i)
        assert got_S is S and got_tail is tail                  # the ring slot's own objects


def test_forward_writes_ring_slots_after_read(model):
    st = model.new_state()
    model.prefill(toks(3), st)
    r0 = st.read
    before = [st.slot_gdn(0, k)[0] for k in range(st.ring)]
    model.forward(toks(2, 2), st)
    changed = [k for k in range(st.ring) if st.slot_gdn(0, k)[0] is not before[k]]
    assert changed == sorted([(r0 + 1) % st.ring, (r0 + 2) % st.ring])
    assert st.committed_gdn(0)[0] is before[r0]


def test_commit_out_of_range(model):
    st = model.new_state()
    with pytest.raises(StateError, match=r"commit\(1\).*1\.\.0"):
        st.commit(1)
    model.forward(toks(3), st)
    for bad in (0, 4, -1, 2.0, True):
        with pytest.raises(StateError, match="commit"):
            st.commit(bad)
    st.commit(3)
    assert st.pos == 3


def test_ring_overflow_and_discard(model):
    st = model.new_state()
    model.forward(toks(4), st)
    st.discard()                                     # 4 < ring: committed slot intact
    assert st.pending == 0 and st.pos == 0
    model.forward(toks(5), st)
    with pytest.raises(StateError, match="exceed the ring"):
        model.forward(toks(1), st)
    with pytest.raises(StateError, match="overwrote the committed slot"):
        st.discard()
    st.commit(5)


def test_past_max_seq(model):
    st = model.new_state()
    model.prefill(toks(CFG.max_seq - 2), st)
    with pytest.raises(StateError, match="past max_seq=48"):
        model.forward(toks(3), st)
    model.forward(toks(2), st)
    st.commit(2)
    with pytest.raises(StateError, match="past max_seq"):
        model.forward(toks(1), st)


def test_bad_ring_and_stack():
    with pytest.raises(StateError, match="ring"):
        DecodeState(CFG, "target", ring=1)
    with pytest.raises(StateError, match="stack"):
        DecodeState(CFG, "both")


def test_snapshot_restore_branch_is_invisible(model):
    prompt, branch, cont = toks(9, 4), toks(8, 5), toks(6, 6)
    a = model.new_state()
    model.prefill(prompt, a, strict=True)
    snap = a.snapshot()
    assert snap.gdn[0][0] is a.committed_gdn(0)[0]            # a reference, not a copy
    model.prefill(branch, a, strict=True)                       # the retrieval branch
    a.restore(snap)
    assert a.pos == 9 and a.pending == 0
    b = model.new_state()
    model.prefill(prompt, b, strict=True)
    la = np.array(model.prefill(cont, a, strict=True))
    lb = np.array(model.prefill(cont, b, strict=True))
    assert la.tobytes() == lb.tobytes()


def test_snapshot_needs_committed_state(model):
    st = model.new_state()
    model.forward(toks(2), st)
    with pytest.raises(StateError, match="snapshot"):
        st.snapshot()
    other = model.new_state("draft")
    st.commit(2)
    with pytest.raises(StateError, match="another stack"):
        other.restore(st.snapshot())


def test_reset_equals_fresh_state(model):
    st = model.new_state()
    model.prefill(toks(10, 7), st, strict=True)
    st.reset()
    assert (st.pos, st.pending, st.read) == (0, 0, 0)
    fresh = model.new_state()
    la = np.array(model.prefill(toks(6, 8), st, strict=True))
    lb = np.array(model.prefill(toks(6, 8), fresh, strict=True))
    assert la.tobytes() == lb.tobytes()


# --- KV caches grow with the positions used (issue 16) ----------------------------------

def test_kv_rows_cover_every_pass_window():
    """The model slices a pass's attention window out of the cache (model.passes.window):
    the rows the state grows to are never fewer, up to max_seq itself."""
    from spel_mlx.model.passes import window as _window
    from spel_mlx.model.state import kv_rows
    for max_seq in (1, 48, 100, 1000, 4096, 5000, 1 << 24):
        for n in list(range(1, min(max_seq, 3000) + 1)) + [max_seq - 1, max_seq]:
            if 1 <= n <= max_seq:
                assert _window(n, max_seq) <= kv_rows(n, max_seq) <= max_seq, (n, max_seq)
    assert kv_rows(65, 1 << 24) == 128 and kv_rows(1025, 1 << 24) == 2048   # doubling: O(1) copies/token


def test_kv_caches_grow_and_decode_identically(model):
    """A state that grows its caches gives the same bits as one holding max_seq rows from
    the start, across growth steps; memory follows the positions used."""
    cfg = CFG.replace(max_seq=300)
    m = SpelModel.from_weights(cfg, init_weights(cfg, seed=3))
    grown, full = m.new_state(), m.new_state()
    full.reserve(cfg.max_seq)
    assert grown.kv_capacity == 64 and full.kv_capacity == 300
    assert all(a.shape[0] == 64 for a in list(grown.k_cache.values()) + list(grown.v_cache.values()))
    t = np.random.default_rng(9).integers(0, cfg.vocab, 200)
    for i in range(0, 200, 5):
        a = np.array(m.forward(t[i:i + 5], grown, strict=True))
        b = np.array(m.forward(t[i:i + 5], full, strict=True))
        assert a.tobytes() == b.tobytes(), i
        grown.commit(5)
        full.commit(5)
    assert grown.kv_capacity == 256 and grown.k_cache[grown.attn_layers[0]].shape[0] == 256
    snap = grown.snapshot()
    grown.reset()
    assert grown.kv_capacity == 256              # kept for the next prompt
    grown.restore(snap)
    assert np.array(m.forward(t[:3], grown)).tobytes() == np.array(m.forward(t[:3], full)).tobytes()


def test_decoder_makes_room_for_the_whole_call_before_its_first_round():
    """Growing the caches mid-call copies them inside one round (a round many steps long
    at a 2k boundary: docs/model.md, "Attention at real context lengths"), so the decoder
    reserves prompt + max_tokens rows up front."""
    from spel_mlx.decoding.loop import SpeculativeDecoder
    from spel_mlx.model.state import kv_rows
    cfg = CFG.replace(max_seq=300)
    m = SpelModel.from_weights(cfg, init_weights(cfg, seed=3))
    dec = SpeculativeDecoder(m, None, "ar")
    prompt = [int(t) for t in toks(64, 5)]          # exactly the smallest capacity
    seen = []
    out = dec.generate(prompt, 40, on_tokens=lambda _: seen.append(dec.target.state.kv_capacity))
    assert len(out) == 40 and len(seen) == 40
    assert set(seen) == {kv_rows(64 + 40, cfg.max_seq)} == {128}
    dec.generate(prompt, 300 - 64)                  # to max_seq: capped there
    assert dec.target.state.kv_capacity == 300


def test_a_decoder_keeps_its_caches_between_calls_and_decodes_as_a_fresh_one():
    """The next call reuses the KV buffers (allocating and faulting in fresh ones cost 2-20 ms
    a call); the rows the longer first call left past the new positions are masked, so the
    tokens equal a fresh decoder's, greedy and seeded sampling."""
    from spel_mlx.decoding.loop import SpeculativeDecoder
    from spel_mlx.decoding.sampling import SamplingParams
    cfg = CFG.replace(max_seq=300)
    m = SpelModel.from_weights(cfg, init_weights(cfg, seed=3))
    long_prompt, prompt = [int(t) for t in toks(150, 6)], [int(t) for t in toks(12, 7)]
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.9, seed=5)):
        used = SpeculativeDecoder(m, None, "ar", params=params)
        used.generate(long_prompt, 60)
        state = used.target.state
        assert state.kv_capacity == 256
        got = used.generate(prompt, 30)
        assert used.target.state is state and state.kv_capacity == 256
        assert got == SpeculativeDecoder(m, None, "ar", params=params).generate(prompt, 30)


def test_a_pass_built_ahead_commits_kept_or_is_forgotten(model):
    """Two batches in flight (the second built during the first): commit_keep accepts
    the first and leaves the second pending, as one batch after a commit would; a
    forgotten second batch (marked first) leaves the state as if it was never built."""
    a, b = [int(t) for t in toks(3, 1)], [int(t) for t in toks(4, 2)]
    ref = model.new_state("target", ring=8)
    model.prefill(toks(5, 3), ref)
    model.forward(a, ref)
    ref.commit(3)
    want = np.array(model.forward(b, ref))
    st = model.new_state("target", ring=8)
    model.prefill(toks(5, 3), st)
    model.forward(a, st)
    got = model.rows_lazy(b, st)
    st.commit_keep(3)
    assert (st.pos, st.pending) == (8, 4) and np.array_equal(np.array(got), want)
    st.commit(4)
    with pytest.raises(StateError, match="commit_keep"):
        st.commit_keep(1)
    # forgotten: the next batch sees the first batch's state only
    st2 = model.new_state("target", ring=8)
    model.prefill(toks(5, 3), st2)
    model.forward(a, st2)
    mark = st2.mark()
    model.rows_lazy([1, 2, 3, 4], st2)          # never run
    st2.forget(4, mark)
    st2.commit(3)
    assert (st2.pos, st2.pending) == (8, 0)
    assert np.array_equal(np.array(model.forward(b, st2)), want)
    with pytest.raises(StateError, match="forget"):
        st2.forget(5)


def test_a_pass_run_directly_grows_the_caches_it_writes_past():
    """run_pass writes the new KV rows in place with a dynamic slice_update, which does
    not check its start: called without forward's checks on a state whose caches are
    full, it grows them first (it once wrote past their end and corrupted the heap)."""
    from spel_mlx.model.passes import run_pass
    cfg = ModelConfig(d_model=64, n_layers=4, n_heads=2, head_dim=32, d_ff=96, vocab=64,
                      max_seq=512, attn_period=2, draft_map=(0, 1), spec_k=4)
    m = SpelModel.from_weights(cfg, init_weights(cfg, seed=3))
    st, ref = m.new_state(), m.new_state()
    n = st.kv_capacity
    for s in (st, ref):
        m.prefill(toks(n), s)
    assert st.pos == st.kv_capacity == n
    out = run_pass(m, [5, 7], st)[0]
    assert st.kv_capacity > n
    np.testing.assert_array_equal(np.array(out), np.array(m.forward([5, 7], ref)))
    with pytest.raises(StateError, match="exceed the ring"):
        run_pass(m, toks(st.ring), st)
