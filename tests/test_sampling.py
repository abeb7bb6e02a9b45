"""Sampling transforms and the lossless speculative-sampling rule.

The statistical tests draw >= 10^4 samples with a fixed seed and compare the
emitted distribution against the target's with a chi-square statistic; a
deliberately wrong rule is checked to FAIL the same test, so the test has power.
"""
import math
import os

import numpy as np
import pytest

import spel_mlx  # noqa: F401
from spel_mlx.decoding import sampling as smp


def chi2_critical(df: int, alpha: float = 1e-3) -> float:
    """Upper critical value of chi-square (Wilson-Hilferty; within ~1% for df >= 3)."""
    z = {1e-3: 3.0902, 1e-2: 2.3263}[alpha]
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(counts: np.ndarray, probs: np.ndarray) -> tuple:
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    exp = probs[keep] * n
    return float(((counts[keep] - exp) ** 2 / exp).sum()), int(keep.sum() - 1)


def pooled_chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    """chi2 / its 0.1% critical value, cells with expected count < 5 pooled; a token
    the target cannot emit gives infinity."""
    counts, probs = counts.reshape(-1), probs.reshape(-1)
    if counts[probs == 0].sum():
        return math.inf
    n = counts.sum()
    order = np.argsort(probs[probs > 0] * n)
    e_sorted, c_sorted = (probs[probs > 0] * n)[order], counts[probs > 0][order]
    pe, pc, acc_e, acc_c = [], [], 0.0, 0.0
    for e, c in zip(e_sorted, c_sorted):
        acc_e, acc_c = acc_e + e, acc_c + c
        if acc_e >= 5:
            pe.append(acc_e)
            pc.append(acc_c)
            acc_e = acc_c = 0.0
    if acc_e:
        pe[-1] += acc_e
        pc[-1] += acc_c
    pe, pc = np.array(pe), np.array(pc)
    df = len(pe) - 1
    return float(((pc - pe) ** 2 / pe).sum()) / chi2_critical(df)


def softmax(z):
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


# --- transforms ---------------------------------------------------------------

def test_greedy_is_one_hot_argmax():
    logits = np.array([0.1, 2.0, -1.0, 1.9])
    p = smp.probabilities(logits, [], smp.GREEDY)
    assert p.tolist() == [0, 1, 0, 0]
    assert smp.greedy_token(logits, [], smp.GREEDY) == 1


def test_temperature_scales_logits():
    logits = np.array([1.0, 2.0, 3.0])
    p = smp.probabilities(logits, [], smp.SamplingParams(temperature=0.5))
    np.testing.assert_allclose(p, softmax(logits / 0.5), rtol=1e-12)


def test_top_k_keeps_exactly_k():
    logits = np.array([0.0, 5.0, 1.0, 4.0, 3.0, -2.0])
    p = smp.probabilities(logits, [], smp.SamplingParams(temperature=1.0, top_k=3))
    assert set(np.nonzero(p)[0].tolist()) == {1, 3, 4}
    np.testing.assert_allclose(p[[1, 3, 4]], softmax(logits[[1, 3, 4]]), rtol=1e-12)


def test_top_p_keeps_smallest_prefix_reaching_mass():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs)
    for top_p, kept in ((0.5, 1), (0.51, 2), (0.8, 2), (0.81, 3), (0.96, 4), (1.0, 4)):
        p = smp.probabilities(logits, [], smp.SamplingParams(temperature=1.0, top_p=top_p))
        assert int((p > 0).sum()) == kept, (top_p, p)
        np.testing.assert_allclose(p.sum(), 1.0)


def test_repetition_penalty_ctrl_rule_and_window():
    logits = np.array([2.0, -1.0, 3.0, 0.5])
    params = smp.SamplingParams(repetition_penalty=2.0, repetition_window=2)
    z = smp.adjusted_logits(logits, [2, 0, 1], params)  # window sees [0, 1] only
    assert z.tolist() == [1.0, -2.0, 3.0, 0.5]
    assert smp.greedy_token(logits, [2, 0, 1], params) == 2
    assert smp.greedy_token(logits, [1, 2], params) == 0  # 3/2 = 1.5 < 2


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5),
                                 dict(top_k=-1), dict(repetition_penalty=0.0),
                                 dict(seed=-1), dict(seed=1.5)])
def test_invalid_params_rejected(bad):
    with pytest.raises(smp.SamplingError):
        smp.SamplingParams(**bad).validate()


def test_draw_is_seeded_and_exact():
    p = np.array([0.2, 0.0, 0.8])
    a = [smp.draw(p, r) for r in [smp.make_rng(7)] for _ in range(100)]
    b = [smp.draw(p, r) for r in [smp.make_rng(7)] for _ in range(100)]
    assert a == b
    assert 1 not in a


def test_residual():
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.2, 0.6, 0.2])
    np.testing.assert_allclose(smp.residual(p, q), [1.0, 0.0, 0.0])
    np.testing.assert_allclose(smp.residual(p, p), p)


# --- lossless speculative sampling (statistical) ----------------------------------

N_DRAWS = 20000


def _emitted_chi2(p, draft_q, rule, seed):
    """chi2 (and df) of N_DRAWS tokens emitted by `rule` from proposals d ~ draft_q(i) against p."""
    rng = smp.make_rng(seed)
    counts = np.zeros(p.shape[0])
    for i in range(N_DRAWS):
        q = draft_q(i)
        ok, tok = rule(p, q, smp.draw(q, rng), rng.random(), rng.random())
        counts[tok] += 1
    return chi2_stat(counts, p)


def _wrong_rule(p, q, token, u_accept, u_draw):
    # resampling from p instead of the residual is biased (it double-counts q's mass)
    if u_accept < min(1.0, p[token] / q[token]):
        return True, token
    return False, smp.draw_at(p, u_draw)


def _cases():
    rng = np.random.default_rng(1234)
    V = 8
    target_logits = rng.normal(size=V) * 1.5
    draft_logits = target_logits + rng.normal(size=V)  # a correlated but wrong draft
    history = [3, 3, 5]
    for params in (smp.SamplingParams(temperature=1.0),
                   smp.SamplingParams(temperature=1.3, top_k=6, top_p=0.95, repetition_penalty=1.3)):
        p = smp.probabilities(target_logits, history, params)
        q = smp.probabilities(draft_logits, history, params)
        yield params, p, q


@pytest.mark.parametrize("case", range(2))
def test_speculative_sampling_matches_target_distribution(case):
    params, p, q = list(_cases())[case]
    stat, df = _emitted_chi2(p, lambda i: q, smp.accept_or_resample, 2024)
    print(f"chi2={stat:.2f} df={df} critical(0.001)={chi2_critical(df):.2f}")
    assert stat < chi2_critical(df)


def test_point_mass_draft_is_lossless():
    # n-gram and greedy drafts propose deterministically: q is one-hot
    params, p, _ = list(_cases())[0]
    # proposals vary, always a point mass
    stat, df = _emitted_chi2(p, lambda i: smp.one_hot(i % 3, p.shape[0]), smp.accept_or_resample, 5)
    assert stat < chi2_critical(df)


def test_wrong_rule_fails_the_same_test():
    params, p, q = list(_cases())[0]
    stat, df = _emitted_chi2(p, lambda i: q, _wrong_rule, 2024)
    assert stat > 10 * chi2_critical(df)


def test_acceptance_rate_is_overlap():
    # E[accept] = sum_x min(p(x), q(x))
    _, p, q = list(_cases())[0]
    rng = smp.make_rng(9)
    acc = 0
    for _ in range(N_DRAWS):
        d = smp.draw(q, rng)
        ok, _ = smp.accept_or_resample(p, q, d, rng.random(), rng.random())
        acc += ok
    expect = np.minimum(p, q).sum()
    sd = math.sqrt(expect * (1 - expect) / N_DRAWS)
    assert abs(acc / N_DRAWS - expect) < 4 * sd


def test_nucleus_from_candidates_equals_full_sort():
    """top-p sorts only the top candidates when their mass suffices: the kept set
    and probabilities are identical to a full stable sort, ties included."""
    rng = np.random.default_rng(11)
    for trial in range(400):
        V = int(rng.choice([300, 2048]))
        lg = rng.standard_normal(V) * rng.choice([0.5, 3.0])
        if trial % 3 == 0:
            lg = np.round(lg * 2) / 2                       # many exact ties
        p = np.exp(lg - lg.max())
        p /= p.sum()
        for top_p in (0.3, 0.9, 0.999):
            order, csum = smp._descending_mass(p, top_p)
            full = np.argsort(-p, kind="stable")
            n = len(order)
            assert np.array_equal(order, full[:n]) and np.array_equal(csum, np.cumsum(p[full])[:n])
            assert csum[-1] >= top_p or n == V


def test_c_probabilities_equal_the_numpy_reference():
    """neon/sampling.c (what probabilities runs when the C module is built) against
    probabilities_reference: the same support (penalty, temperature, top-k ties, the
    top-p prefix, candidates past 256 included) and the same values to 1e-13."""
    if smp._C_SAMPLER is None:
        if os.environ.get("SPEL_REQUIRE_CROSS") == "1":
            raise AssertionError("the C module (spel_sample_probs) is not built")
        pytest.skip("C module not built")
    rng = np.random.default_rng(0)
    for trial in range(600):
        V = int(rng.choice([1, 2, 5, 50, 257, 300, 2048]))
        logits = (rng.standard_normal(V) * rng.choice([0.0, 0.5, 3.0, 10.0])).astype(np.float32)
        if trial % 5 == 0:
            logits = np.round(logits)                       # ties at every boundary
        hist = [int(t) for t in rng.integers(-2, V + 2, int(rng.integers(0, 100)))]
        params = smp.SamplingParams(temperature=float(rng.choice([0.3, 0.7, 1.0, 1.5])),
                                    top_k=int(rng.choice([0, 1, 3, 40])),
                                    top_p=float(rng.choice([1.0, 0.9, 0.5, 0.95])),
                                    repetition_penalty=float(rng.choice([1.0, 1.1, 1.3])),
                                    repetition_window=int(rng.choice([0, 8, 64])))
        a = smp.probabilities(logits, hist, params)
        b = smp.probabilities_reference(logits, hist, params)
        assert np.array_equal(a > 0, b > 0), (trial, V, params)
        assert np.abs(a - b).max() < 1e-13 and abs(a.sum() - 1.0) < 1e-12, (trial, V, params)
