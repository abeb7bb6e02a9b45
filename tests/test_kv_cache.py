"""A float16 K/V cache (``load(kv_cache="float16")``, ``--kv-cache float16``): the
target's caches hold float16, every greedy decoding mode gives its own `ar` text over a
prompt long enough for the attention's key chunks, the logits stay near the float32
model's, snapshots keep the dtype, and a bad name is an error naming it."""
import numpy as np
import pytest

import spel_mlx
import mlx.core as mx
from spel_mlx.api import LoadError, load
from spel_mlx.decoding import SpeculativeDecoder
from spel_mlx.model.state import DecodeState, StateError

# ~700 tokens: past one 512-key chunk of the CPU attention (docs/model.md)
PROMPT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
          "must be in want of a wife. ") * 24


@pytest.fixture(scope="module")
def half():
    model, tok = load(kv_cache="float16")
    yield model, tok
    model.close()


def test_every_greedy_mode_gives_its_own_ar_text(half):
    model, tok = half
    prompt = tok.encode(PROMPT)
    assert len(prompt) > 600
    ar = SpeculativeDecoder(model.model, None, "ar", k=4)
    want = ar.generate(prompt, 40)
    assert ar.target.state.k_cache[ar.target.state.attn_layers[0]].dtype == mx.float16
    for opts in ({}, {"draft": "mlx"}, {"draft": "c", "strict": True}, {"draft": "ngram", "k": 6}):
        responses = spel_mlx.stream_generate(model, tok, PROMPT, 40, rounds=True, temperature=0, **opts)
        assert [t for r in responses for t in r.tokens] == list(want), opts


def test_logits_stay_near_the_float32_model(half):
    model, tok = half
    prompt = tok.encode(PROMPT)
    logits = {}
    for kv in ("float32", "float16"):
        st = DecodeState(model.cfg, "target", 16, kv=kv)
        logits[kv] = np.asarray(model.model.prefill(prompt, st))
    diff = np.abs(logits["float16"] - logits["float32"]).max()
    # the cache really is float16 (k and v rounded), and that moves the logits a little
    assert 0 < diff < 0.05 * np.abs(logits["float32"]).max(), diff


def test_snapshot_and_restore_keep_the_half_cache(half):
    model, tok = half
    m = model.model
    st = m.new_state("target", ring=16)
    m.prefill(tok.encode("Elizabeth was walking in the garden"), st)
    snap = st.snapshot()
    assert all(k.dtype == mx.float16 for pair in snap.kv.values() for k in pair)
    want = np.asarray(m.forward([5, 9], st))
    st.commit(2)
    st.restore(snap)
    assert st.k_cache[st.attn_layers[0]].dtype == mx.float16
    assert np.array_equal(np.asarray(m.forward([5, 9], st)), want)


def test_bad_names_are_errors():
    with pytest.raises(LoadError, match="kv_cache='bfloat16'"):
        load(kv_cache="bfloat16")
    from spel_mlx.config import resolve_config
    cfg = resolve_config(use_env=False)
    with pytest.raises(StateError, match="'int8'.*float32, float16"):
        DecodeState(cfg, "target", 4, kv="int8")
