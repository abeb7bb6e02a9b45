"""DecodeState: O(1) commit (identity, no allocation), errors, snapshot/restore."""
import numpy as np
import pytest

import spel_mlx  # noqa: F401
import mlx.core as mx
from spel_mlx.config import ModelConfig
from spel_mlx.model import SpelModel, init_weights
from spel_mlx.state import DecodeState, StateError

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
