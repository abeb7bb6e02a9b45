"""Sampled speculative decoding through the engine, both lossless rules.

Statistics: K=4 on a toy target, six emitted tokens per call, so acceptances chain
across positions and rounds; the emitted tokens' marginals at every position and
their joint pairs match the target's exact distribution (enumerated) by chi-square,
and three wrong rules are caught by the same test (accept-always, noise shared across
positions, resampling from p instead of the residual).  Coupled rule: the output is
sampled ``ar``'s output token for token, for many seeds, prompts and K, with the C
draft plain and drafting ahead, into max_seq and at stop tokens.
"""
import numpy as np
import pytest

import spel_mlx  # noqa: F401
from spel_mlx.decoding import GovernorConfig, SpeculativeDecoder, DecodeOptions, make_proposer, DraftOptions
from spel_mlx.decoding import sampling as smp
from spel_mlx.decoding.c_proposer import CDraftAheadProposer
from spel_mlx.decoding.mlx_proposer import MLXProposer
from spel_mlx.native import clib

from test_sampling import pooled_chi2
from test_speculative import N_REAL, ToyModel, _ar, tiny  # noqa: F401  (tiny: a fixture)

RAW = GovernorConfig(policy="off")     # every round drafts: the most rounds under test
PARAMS = smp.SamplingParams(temperature=1.0, top_p=0.95, repetition_penalty=1.2, repetition_window=8)
PROMPT = [1, 2]
LENGTH = 6
PAIRS = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (0, 5)]


def target_distribution(model, params, prompt, length):
    """{sequence: probability} of the first `length` tokens the target emits (enumerated)."""
    table = model.tables["target"]
    out = {}

    def walk(ctx, prob, depth):
        if depth == length:
            out[tuple(ctx[len(prompt):])] = prob
            return
        p = smp.probabilities(table[ctx[-2], ctx[-1]].astype(np.float32), ctx, params)
        for t in np.flatnonzero(p):
            walk(ctx + [int(t)], prob * p[t], depth + 1)

    walk(list(prompt), 1.0, 0)
    return out


def worst_ratio(model, decoder, calls: int) -> float:
    """The largest chi2/critical over the marginals at every position and the PAIRS."""
    V = model.cfg.vocab
    exact = target_distribution(model, PARAMS, PROMPT, LENGTH)
    seqs = np.array(list(exact)), np.array(list(exact.values()))
    got = np.zeros((calls, LENGTH), np.int64)
    for i in range(calls):
        decoder.params = smp.SamplingParams(**{**PARAMS.__dict__, "seed": i, "accept": decoder.params.accept})
        got[i] = decoder.generate(PROMPT, LENGTH)
    ratios = []
    for pos in range(LENGTH):
        p = np.bincount(seqs[0][:, pos], weights=seqs[1], minlength=V)
        ratios.append(pooled_chi2(np.bincount(got[:, pos], minlength=V).astype(float), p))
    for a, b in PAIRS:
        p = np.bincount(seqs[0][:, a] * V + seqs[0][:, b], weights=seqs[1], minlength=V * V)
        ratios.append(pooled_chi2(np.bincount(got[:, a] * V + got[:, b], minlength=V * V).astype(float), p))
    return max(ratios)


class GuessingProposer(MLXProposer):
    """Drafts one position past its proposal and offers that token as its guess, like
    drafting ahead does (the residual rule takes it as a proposal for the last row);
    `lie`: it reports a q under which the guess is always accepted (not the
    distribution it was drawn from)."""

    def __init__(self, model, ring, lie=False):
        super().__init__(model, "draft", ring=ring)
        self.lie, self._guess = lie, None

    def propose(self, history, pending, k, params, seed):
        toks, qs = super().propose(history, pending, k + 1, params, seed)
        q = None if qs is None else smp.one_hot(toks[k], len(qs[k])) * 1e-9 if self.lie else qs[k]
        self._guess = (toks[k], q)
        return toks[:k], (None if qs is None else qs[:k])

    def guess(self):
        return self._guess


def toy_decoder(accept: str, proposer=MLXProposer, draft_noise=0.7, **kw):
    model = ToyModel(V=5, draft_noise=draft_noise, seed=8, sharp=1.0)
    params = smp.SamplingParams(**{**PARAMS.__dict__, "accept": accept})
    draft = proposer(model, "draft", ring=5) if proposer is MLXProposer else proposer(model, ring=6, **kw)
    return model, SpeculativeDecoder(model, draft, "spec", k=4, params=params, options=DecodeOptions(governor=RAW))


@pytest.mark.parametrize("accept,proposer,noise", [("coupled", MLXProposer, 0.7), ("residual", MLXProposer, 0.7),
                                                   ("residual", GuessingProposer, 1.5)])
def test_emitted_tokens_follow_the_target_distribution(accept, proposer, noise):
    model, dec = toy_decoder(accept, proposer, noise)
    ratio = worst_ratio(model, dec, 4000)
    assert dec.stats.accepted > 0           # proposals were accepted, across rounds
    assert ratio < 1.0, ratio


def test_a_misreported_guess_distribution_fails_the_same_test():
    model, dec = toy_decoder("residual", GuessingProposer, 1.5, lie=True)
    assert worst_ratio(model, dec, 2000) > 2.0


def _accept_always(real):
    def rows(rows, seq, n_ctx, params, noise_at, want_probs=False):
        toks, probs = real(rows, seq, n_ctx, params, noise_at, want_probs)
        if len(rows) > 1:                   # the target's rows: every proposal is "its" token
            toks[:len(rows) - 1] = seq[n_ctx:n_ctx + len(rows) - 1]
        return toks, probs
    return rows


def _one_noise_for_all_positions(real):
    def rows(rows, seq, n_ctx, params, noise_at, want_probs=False):
        out = [real(rows[j:j + 1], seq, n_ctx + j, params, (noise_at[0], 0), want_probs) for j in range(len(rows))]
        return [t for o in out for t in o[0]], (np.concatenate([o[1] for o in out]) if want_probs else None)
    return rows


@pytest.mark.parametrize("accept,wrong", [("coupled", "accept_always"), ("coupled", "shared_noise"),
                                          ("residual", "accept_always"), ("residual", "resample_from_p")])
def test_wrong_rules_fail_the_same_test(monkeypatch, accept, wrong):
    model, dec = toy_decoder(accept)
    if wrong == "accept_always":
        monkeypatch.setattr(smp, "sample_rows", _accept_always(smp.sample_rows))
        monkeypatch.setattr(smp, "residual_round", lambda probs, qs, proposal, seed, index0: (len(proposal), None))
    elif wrong == "shared_noise":
        monkeypatch.setattr(smp, "sample_rows", _one_noise_for_all_positions(smp.sample_rows))
    else:
        monkeypatch.setattr(smp, "residual", lambda p, q: p)
    assert worst_ratio(model, dec, 1000) > 2.0


# --- coupled: the output is sampled ar's output --------------------------------------

CASES = [smp.SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2, repetition_window=6),
         smp.SamplingParams(temperature=1.3, top_k=4),
         smp.SamplingParams(temperature=0.5, repetition_penalty=1.5, repetition_window=3),
         smp.SamplingParams(temperature=0.0, repetition_penalty=1.3)]


def _with_seed(params, seed):
    return smp.SamplingParams(**{**params.__dict__, "seed": seed, "accept": "coupled"})


@pytest.mark.parametrize("K", [1, 2, 4, 8])
def test_toy_coupled_spec_equals_sampled_ar(K):
    model = ToyModel(V=12, draft_noise=0.6, seed=2, sharp=1.5)
    rng = np.random.default_rng(K)
    accepted = 0
    for i in range(12):
        params = _with_seed(CASES[i % len(CASES)], 100 + i)
        prompt = rng.integers(0, 12, int(rng.integers(1, 9))).tolist()
        ref = SpeculativeDecoder(model, None, "ar", params=params).generate(prompt, 30)
        dec = SpeculativeDecoder(model, MLXProposer(model, "draft", ring=K + 1), "spec", k=K, params=params,
                                 options=DecodeOptions(governor=RAW))
        assert dec.generate(prompt, 30) == ref, (K, i)
        accepted += dec.stats.accepted
    assert accepted > 0


def _cdraft_or_skip():
    if not clib.available():
        pytest.skip(f"C draft unavailable: {clib.IMPORT_ERROR}")


@pytest.mark.parametrize("ahead", [False, True])
def test_real_coupled_spec_equals_sampled_ar(tiny, ahead):  # noqa: F811
    """The tiny real model with the C draft (its own sampled proposals, plain and drafting
    ahead): token for token the sampled ar output, strict and fast, for K 1, 2 and 4,
    every sampling case, into max_seq and cut at a stop token."""
    _cdraft_or_skip()
    hits = 0
    for K in (1, 2, 4):
        draft = make_proposer("c", tiny.model, tiny.w, k=K, options=DraftOptions(threads=1, ahead=ahead))
        assert isinstance(draft, CDraftAheadProposer) == ahead
        for i, prompt in enumerate(tiny.prompts):
            params = _with_seed(CASES[(i + K) % len(CASES)], 7 * i + K)
            strict = i % 2 == 0
            ref = SpeculativeDecoder(tiny.model, None, "ar", params=params,
                                     options=DecodeOptions(strict=strict)).generate(prompt, N_REAL)
            dec = SpeculativeDecoder(tiny.model, draft, "spec", k=K, params=params,
                                     options=DecodeOptions(strict=strict, governor=RAW))
            assert dec.generate(prompt, N_REAL) == ref, (K, i, ahead)
            hits += dec.stats.extra.get("ahead_hits", 0)
            stop = ref[N_REAL // 2]
            cut = dec.generate(prompt, N_REAL, stop_tokens=[stop])
            assert cut == ref[:ref.index(stop) + 1] and dec.stats.stop_reason == "stop_token"
        for plen in (50, 63):
            prompt = (tiny.prompts[-1] * 3)[:plen]
            params = _with_seed(CASES[0], plen)
            ref = SpeculativeDecoder(tiny.model, None, "ar", params=params,
                                     options=DecodeOptions(strict=True)).generate(prompt, 100)
            dec = SpeculativeDecoder(tiny.model, draft, "spec", k=K, params=params,
                                     options=DecodeOptions(strict=True, governor=RAW))
            assert dec.generate(prompt, 100) == ref and dec.stats.stop_reason == "max_seq"
        draft.close()
    assert hits > 0 or not ahead


def test_shipped_model_sampled_defaults():
    """The shipped model with the generate defaults: coupled spec drafting ahead equals
    sampled ar and uses drafted-ahead proposals; the residual rule is reproducible for a
    seed and uses them too."""
    _cdraft_or_skip()
    from spel_mlx.reader import load_checkpoint
    from spel_mlx.model import SpelModel
    ck = load_checkpoint()
    model = SpelModel.from_weights(ck.cfg, ck.weights)
    prompt = [int(t) for t in np.arange(40) * 37 % ck.cfg.vocab]
    draft = make_proposer("c", model, ck.weights, k=4, options=DraftOptions(threads=1, ahead=True))
    for accept in smp.ACCEPT_RULES:
        params = smp.SamplingParams(temperature=0.7, top_p=0.95, repetition_penalty=1.1, seed=3, accept=accept)
        ref = SpeculativeDecoder(model, None, "ar", params=params).generate(prompt, 80)
        dec = SpeculativeDecoder(model, draft, "spec", k=4, params=params, options=DecodeOptions(governor=RAW))
        out = dec.generate(prompt, 80)
        assert dec.stats.extra["ahead_hits"] > 0 and dec.stats.alpha > 0.3
        if accept == "coupled":
            assert out == ref
        else:
            assert dec.generate(prompt, 80) == out and len(out) == 80
    draft.close()
