"""The per-position noise stream and the coupled choice: C against the numpy reference
(bits, uniforms, Gumbel noise, the tokens and distributions of a round's rows), the
C draft's sampled proposals against the same choice on its own logits, and the
Gumbel-max choice as an exact sampler (chi-square, with a shared-noise negative control)."""
import numpy as np
import pytest

import spel_mlx  # noqa: F401
from spel_mlx.config import ModelConfig
from spel_mlx.decoding import noise
from spel_mlx.decoding import sampling as smp
from spel_mlx.native import clib

from test_sampling import chi2_critical, chi2_stat

needs_c = pytest.mark.skipif(not clib.available(), reason="C module not built")

SEEDS = [0, 1, 2 ** 63 + 5, 2 ** 64 - 1]


@needs_c
def test_noise_bits_and_uniforms_equal_the_numpy_reference():
    rng = np.random.default_rng(0)
    for seed in SEEDS:
        for index in (0, 1, 63, 4095, 2 ** 40 + 3):
            slots = np.concatenate([[noise.ACCEPT, noise.DRAW], rng.integers(0, 2 ** 17, 200)])
            ref = noise.bits_reference(seed, index, slots)
            got = [clib.lib.spel_noise_bits(seed, index, int(s)) for s in slots]
            assert [int(x) for x in ref] == got
            u = noise.uniform_reference(seed, index, slots)
            assert [noise.uniform(seed, index, int(s)) for s in slots] == u.tolist()
            assert u.min() > 0.0 and u.max() < 1.0
            g = noise.gumbel(seed, index, slots[2:])
            np.testing.assert_allclose(g, noise.gumbel_reference(seed, index, slots[2:]), rtol=1e-14, atol=1e-14)


def test_noise_is_uniform_and_independent_across_indices_and_slots():
    # 2^16 uniforms over (index, token) pairs: each decile holds a tenth, neighbours uncorrelated
    u = np.concatenate([noise.uniform_reference(7, i, np.arange(256)) for i in range(256)])
    counts = np.histogram(u, bins=10, range=(0, 1))[0]
    stat, df = chi2_stat(counts.astype(float), np.full(10, 0.1))
    assert stat < chi2_critical(df)
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.02
    assert abs(np.corrcoef(u[:-256], u[256:])[0, 1]) < 0.02        # same token, next index
    assert len(set(noise.bits_reference(7, 3, np.arange(4096)).tolist())) == 4096


def test_seed64():
    assert noise.seed64(5) == 5 and noise.seed64(2 ** 64 - 1) == 2 ** 64 - 1
    assert noise.seed64(2 ** 64) == noise.seed64(2 ** 64) != noise.seed64(2 ** 64 + 1)
    assert noise.seed64(None) != noise.seed64(None)


def _random_case(rng, V):
    logits = (rng.standard_normal((5, V)) * rng.choice([0.5, 3.0, 10.0])).astype(np.float32)
    if rng.random() < 0.3:
        logits = np.round(logits).astype(np.float32)            # ties at every boundary
    seq = [int(t) for t in rng.integers(0, V, int(rng.integers(5, 90)))]
    params = smp.SamplingParams(temperature=float(rng.choice([0.0, 0.3, 0.7, 1.0, 1.5])),
                                top_k=int(rng.choice([0, 1, 3, 40])),
                                top_p=float(rng.choice([1.0, 0.9, 0.5, 0.95])),
                                repetition_penalty=float(rng.choice([1.0, 1.1, 1.3])),
                                repetition_window=int(rng.choice([0, 8, 64])))
    return logits, seq, params


@needs_c
def test_c_rows_equal_the_numpy_reference():
    """spel_sample_rows (all rows of a round in one call) against sample_rows_reference:
    the same coupled tokens and the same distributions (to 1e-13), each row's penalty
    window ending at its own position."""
    rng = np.random.default_rng(1)
    for trial in range(300):
        V = int(rng.choice([2, 7, 300, 2048]))
        logits, seq, params = _random_case(rng, V)
        n_ctx = len(seq) - 4
        seed, index0 = int(rng.integers(0, 2 ** 63)), int(rng.integers(0, 5000))
        toks, probs = smp.sample_rows(logits, seq, n_ctx, params, (seed, index0), want_probs=True)
        rtoks, rprobs = smp.sample_rows_reference(logits, seq, n_ctx, params, (seed, index0), want_probs=True)
        assert toks == rtoks, (trial, params)
        assert np.array_equal(probs > 0, rprobs > 0) and np.abs(probs - rprobs).max() < 1e-13, (trial, params)
        assert all(probs[j, t] > 0 for j, t in enumerate(toks))


def test_gumbel_choice_is_an_exact_sample():
    """The coupled choice over many sequence indices is distributed as the position's
    distribution; the same index every time (noise shared across positions) is not."""
    V, N = 8, 20000
    logits = (np.random.default_rng(3).standard_normal((1, V)) * 1.5).astype(np.float32)
    params = smp.SamplingParams(temperature=1.3, top_k=6, top_p=0.95, repetition_penalty=1.3)
    hist = [3, 3, 5]
    p = smp.probabilities(logits[0], hist, params)
    counts = np.zeros(V)
    for i in range(N):
        (t,), _ = smp.sample_rows(logits, hist, len(hist), params, (11, i))
        counts[t] += 1
    stat, df = chi2_stat(counts, p)
    assert stat < chi2_critical(df)
    shared = {smp.sample_rows(logits, hist, len(hist), params, (11, 0))[0][0] for _ in range(50)}
    assert len(shared) == 1


def test_non_finite_rows_are_an_error():
    logits = np.full((1, 5), np.nan, np.float32)
    with pytest.raises(ValueError, match="no finite"):
        smp.sample_rows(logits, [1], 1, smp.SamplingParams(temperature=0.7), (1, 0))


# --- the C draft's own sampled proposals -------------------------------------------

TINY = ModelConfig(d_model=64, n_heads=2, head_dim=32, d_ff=128, vocab=300, max_seq=48,
                   draft_map=(0, 3), spec_k=4)


@pytest.fixture(scope="module")
def tiny_draft():
    if not clib.available():
        pytest.skip("C module not built")
    from spel_mlx.native.cdraft import CDraft
    from test_cdraft import random_weights
    return lambda ring=10: CDraft(TINY, random_weights(TINY, 5), threads=1, ring=ring)


@pytest.mark.parametrize("params", [
    smp.SamplingParams(temperature=0.7, top_p=0.95, repetition_penalty=1.1),
    smp.SamplingParams(temperature=1.0, top_k=5),
    smp.SamplingParams(temperature=0.0, repetition_penalty=1.5, repetition_window=6),
    smp.SamplingParams(temperature=1.2, top_p=0.8, repetition_penalty=1.3, repetition_window=3),
])
def test_c_draft_samples_its_proposals_like_sample_rows(tiny_draft, params):
    """propose / propose_at (sync and async, continuing a batch) choose, at each offset,
    the coupled sample of the draft's own logits with the penalty window and sequence
    index the round gives it, and keep each proposal's distribution."""
    d = tiny_draft()
    rng = np.random.default_rng(2)
    seed, K = 1234, 4
    history = [int(t) for t in rng.integers(0, TINY.vocab, 9)]
    d.forward(history, logits=False)
    d.commit(len(history))
    d.set_sampling(params.temperature, params.top_p, params.repetition_penalty, params.top_k, params.window,
                   seed, want_q=True)
    W = params.window
    pending = 7
    d.set_context(history[-W:] if W else [], len(history))
    toks = d.propose_at(pending, K, 0, guess=True)
    qs = [d.probs(j) for j in range(K + 1)]
    # the continuation from the guess, on the native thread
    tail = (history[-W:] if W else []) + [pending] + toks[:K]
    d.set_context(tail[-W:] if W else [], len(history) + K + 1)
    d.propose_at_async(toks[K], K, K + 1, True)
    more = d.wait()
    qs += [d.probs(K + 1 + j) for j in range(K + 1)]
    # the same choices from the draft's logits, fed one batch
    batch = [pending] + toks + more[:K]
    d.commit(1)
    d.reset()
    d.forward(history, logits=False)
    d.commit(len(history))
    logits = d.forward(batch)
    ctx = (history[-W:] if W else []) + batch
    want, probs = smp.sample_rows(logits, ctx, len(ctx) - len(batch) + 1, params, (seed, len(history) + 1),
                                  want_probs=True)
    assert toks + more == want
    for j, q in enumerate(qs):
        np.testing.assert_allclose(q, probs[j], rtol=0, atol=1e-15)
    d.set_sampling(None)                          # back to the argmax
    rows = _greedy_chain(d, 3, 2)
    assert d.propose(3, 2) == [int(np.argmax(r)) for r in rows]
    d.close()


def _greedy_chain(d, pending, k):
    """Logits of the greedy chain from pending (then the draft is reset)."""
    rows, tok = [], pending
    d.reset()
    for j in range(k):
        row = d.forward([tok], start=j)[0]
        rows.append(row)
        tok = int(np.argmax(row))
    d.reset()
    return rows


def test_c_draft_sampling_errors(tiny_draft):
    d = tiny_draft()
    with pytest.raises(ValueError, match="sampling is off"):
        d.set_context([1, 2], 2)
    with pytest.raises(ValueError, match="no distribution"):
        d.probs(0)
    with pytest.raises(ValueError, match="bad sampling"):
        d.set_sampling(0.7, top_p=1.5)
    d.set_sampling(0.7, 0.9, 1.1, 0, 8, seed=3, want_q=False)
    d.set_context([], 0)
    d.propose(4, 2)
    with pytest.raises(ValueError, match="no distribution"):
        d.probs(0)
    d.close()


def test_c_draft_cancel_keeps_the_batch_before_the_continuation(tiny_draft):
    """A cancelled continuation leaves the proposal's batch uncommitted and intact."""
    d = tiny_draft()
    toks = d.propose_at(5, 4, 0, guess=True)
    d.propose_at_async(toks[4], 4, 5, True)
    d.cancel()
    got = d.wait()                                # None, unless it finished before the cancel
    assert got is None or len(got) == 5
    d.commit(3)                                   # the first 3 of [5, d_0..d_3] still there
    after = d.forward([9])[0]
    d.reset()
    ref = d.forward([5] + toks[:2] + [9])[-1]
    assert np.array_equal(after, ref)
    d.close()
