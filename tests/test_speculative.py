"""Speculative decoding engine: greedy fidelity (spec / governed == ar), round
bookkeeping, governor, forced acceptance, max_seq stops, speculative sampling.

Two targets: a numpy Markov "toy" model that implements the model/state API
(fast, with exactly controllable draft quality), and the real MLX SpelModel on a
tiny random config (strict mode bit-exact, fast mode token-equivalent).
"""
from types import SimpleNamespace

import numpy as np
import pytest

import spel_mlx  # noqa: F401
import mlx.core as mx

from spel_mlx.decoding import (DecodeError, Governor, GovernorConfig, RoundResult, SpeculativeDecoder,
                               make_proposer, DecodeOptions, DraftOptions)
from spel_mlx.decoding import sampling as smp
from spel_mlx.decoding.auto import AutoProposer
from spel_mlx.decoding.c_proposer import CDraftAheadProposer
from spel_mlx.decoding.mlx_proposer import MLXProposer
from spel_mlx.decoding.ngram import NgramProposer
from spel_mlx.native import clib

from test_sampling import pooled_chi2

RAW = GovernorConfig(policy="off")     # spec with every round drafting (raw speculation)


# ---------------------------------------------------------------------------
# toy model: logits depend on the last two tokens through a fixed table

class ToyState:
    kv_cache = "float32"     # what DecodeState says of its caches

    def __init__(self, stack, ring, max_seq):
        self.stack, self.ring, self.max_seq = stack, ring, max_seq
        self.committed, self.pend = [], []

    @property
    def pos(self):
        return len(self.committed)

    @property
    def pending(self):
        return len(self.pend)

    def commit(self, n):
        assert 1 <= n <= len(self.pend), (n, self.pend)
        self.committed += self.pend[:n]
        self.pend = []

    def discard(self):
        self.pend = []

    def reset(self):
        self.committed, self.pend = [], []

    def reserve(self, n):
        assert n <= self.max_seq, (n, self.max_seq)   # the decoder asks for what the call may reach


class ToyModel:
    def __init__(self, V=12, max_seq=64, seed=0, draft_noise=1.0, sharp=3.0):
        rng = np.random.default_rng(seed)
        self.cfg = SimpleNamespace(vocab=V, max_seq=max_seq)
        self.tables = {"target": rng.normal(size=(V, V, V)) * sharp}
        self.tables["draft"] = self.tables["target"] + draft_noise * rng.normal(size=(V, V, V)) * sharp
        self.forward_tokens = 0

    def new_state(self, stack="target", ring=5):
        return ToyState(stack, ring, self.cfg.max_seq)

    def forward(self, tokens, state, strict=False, stack=None):
        tokens = list(tokens)
        assert stack in (None, state.stack)
        assert len(state.pend) + len(tokens) <= state.ring, "ring overflow"
        assert state.pos + len(state.pend) + len(tokens) <= state.max_seq, "past max_seq"
        rows = []
        for t in tokens:
            state.pend.append(int(t))
            ctx = state.committed + state.pend
            a = ctx[-2] if len(ctx) >= 2 else 0
            rows.append(self.tables[state.stack][a, ctx[-1]])
        self.forward_tokens += len(tokens)
        return mx.array(np.stack(rows).astype(np.float32))

    def step_lazy(self, token, state):
        # greedy `ar` builds its next pass from the lazy argmax; the table reads it now
        return self.forward([int(token.item())], state)


def toy_ar(model, prompt, n):
    """Plain greedy decoding straight from the table (independent of the engine)."""
    ctx = list(prompt)
    out = []
    for _ in range(n):
        if len(ctx) > model.cfg.max_seq:
            break
        a = ctx[-2] if len(ctx) >= 2 else 0
        t = int(np.argmax(model.tables["target"][a, ctx[-1]].astype(np.float32)))
        out.append(t)
        ctx.append(t)
    return out


def toy_prompts(V, count=8, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V, size=int(rng.integers(1, 12))).tolist() for _ in range(count)]


# ---------------------------------------------------------------------------
# toy-model tests: bookkeeping and modes

@pytest.mark.parametrize("K", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("noise", [0.0, 0.3, 1.0])
def test_toy_greedy_spec_equals_ar(K, noise):
    model = ToyModel(draft_noise=noise, seed=K)
    for prompt in toy_prompts(12, seed=K):
        ref = toy_ar(model, prompt, 30)
        for mode, gov in (("spec", RAW), ("spec", None), ("governed", None)):
            dec = SpeculativeDecoder(model, MLXProposer(model, "draft", ring=K + 1), mode, k=K,
                                     options=DecodeOptions(governor=gov))
            assert dec.generate(prompt, 30) == ref
            st = dec.stats
            assert st.tokens == 30 and st.rounds == st.spec_rounds + st.ar_rounds
            # every round emits accepted + 1 tokens (the last may be trimmed)
            assert st.accepted + st.rounds >= st.tokens
            # the draft committed a prefix of the target's history (all of it unless
            # the governor suspended drafting)
            tc, dc = dec.target.state.committed, dec.proposer.state.committed
            assert dc == tc[:len(dc)]
            if gov is RAW:  # only a final k=0 round (one token left) skips the draft
                assert len(tc) - len(dc) <= 1
        ar = SpeculativeDecoder(model, None, "ar", k=K)
        assert ar.generate(prompt, 30) == ref


def test_toy_oracle_accepts_everything():
    model = ToyModel(draft_noise=0.0)
    K = 4
    dec = SpeculativeDecoder(model, MLXProposer(model, "target", ring=K + 1), "oracle", k=K)
    out = dec.generate([1, 2, 3], 40)
    st = dec.stats
    assert out == toy_ar(model, [1, 2, 3], 40)
    assert st.alpha == 1.0
    assert st.rounds == 8 and st.tokens_per_round == 5.0
    assert st.proposed == 32 and st.draft_forwards == 40 + 2  # 8 rounds x (K+1) + prompt sync


def test_toy_round_structure_counts_target_work():
    """One verify batch of K+1 per round: target token-forwards = prompt-1 + sum(K+1)."""
    model = ToyModel(draft_noise=0.5, seed=3)
    K = 4
    dec = SpeculativeDecoder(model, MLXProposer(model, "draft", ring=K + 1), "spec", k=K,
                             options=DecodeOptions(governor=RAW))
    model.forward_tokens = 0
    prompt = [5, 6, 7, 8]
    dec.generate(prompt, 25)
    st = dec.stats
    # target: prefill of prompt[:-1], then one (m+1)-token batch per round;
    # the draft's own forwards (prefill sync + k+1 per proposal) are counted apart
    assert model.forward_tokens == (len(prompt) - 1) + st.proposed + st.rounds + st.draft_forwards
    assert st.draft_forwards == (len(prompt) - 1) + st.proposed + st.spec_rounds
    assert st.proposed <= K * st.spec_rounds


@pytest.mark.parametrize("K", [1, 4, 16])
def test_toy_runs_into_max_seq(K):
    model = ToyModel(max_seq=24, draft_noise=0.2, seed=K)
    for plen in (1, 10, 23, 24):
        prompt = toy_prompts(12, 1, seed=plen)[0] * 30
        prompt = prompt[:plen]
        ref = toy_ar(model, prompt, 100)
        # the target can consume up to max_seq tokens, the last prediction is at max_seq
        assert len(ref) == 24 - plen + 1
        for mode, draft in (("ar", None), ("spec", MLXProposer(model, "draft", ring=K + 1)),
                            ("governed", MLXProposer(model, "draft", ring=K + 1)),
                            ("spec", NgramProposer(12))):
            dec = SpeculativeDecoder(model, draft, mode, k=K)
            assert dec.generate(prompt, 100) == ref
            assert dec.stats.stop_reason == "max_seq"


def test_prompt_errors():
    model = ToyModel(max_seq=16)
    dec = SpeculativeDecoder(model, None, "ar", k=4)
    with pytest.raises(DecodeError, match="longer than max_seq"):
        dec.generate(list(range(12)) + [1] * 5, 3)
    with pytest.raises(DecodeError, match="empty"):
        dec.generate([], 3)
    with pytest.raises(DecodeError, match="outside the vocabulary"):
        dec.generate([99], 3)
    for K in (0, 17):
        with pytest.raises(DecodeError, match="K="):
            SpeculativeDecoder(model, None, "ar", k=K)
    with pytest.raises(DecodeError, match="needs a draft"):
        SpeculativeDecoder(model, None, "spec", k=4)


def test_governor_trips_on_bad_draft_and_output_unchanged():
    model = ToyModel(draft_noise=30.0, seed=11)  # the draft is noise
    K = 4
    ref = toy_ar(model, [1, 2], 40)
    dec = SpeculativeDecoder(model, MLXProposer(model, "draft", ring=K + 1), "governed", k=K)
    assert dec.generate([1, 2], 40) == ref
    st = dec.stats
    assert st.governor_trips == 1
    assert st.spec_rounds <= 4 and st.ar_rounds == st.rounds - st.spec_rounds
    assert st.ar_rounds >= 30


def test_governor_resume_reprobes_and_catches_draft_up():
    model = ToyModel(draft_noise=30.0, seed=11)
    K = 4
    ref = toy_ar(model, [1, 2], 60)
    gov = GovernorConfig(resume_after=8)
    draft = MLXProposer(model, "draft", ring=K + 1)
    dec = SpeculativeDecoder(model, draft, "governed", k=K, options=DecodeOptions(governor=gov))
    assert dec.generate([1, 2], 60) == ref
    st = dec.stats
    assert st.governor_resumes >= 2 and st.governor_trips == st.governor_resumes + 1 or \
        st.governor_trips == st.governor_resumes
    # after each resume the draft re-synced from the committed history
    assert draft.state.committed[:dec.target.pos] == dec.target.state.committed[:draft.pos]


def test_governor_unit():
    g = Governor(GovernorConfig(window=4, alpha_threshold=0.5, min_rounds=2,
                                      zero_accept_trip=False))
    g.record(4, 4)
    g.record(0, 4)
    assert g.drafting            # 4/8 = 0.5 is not below 0.5
    g.record(1, 4)
    assert not g.drafting and g.trips == 1
    g2 = Governor(GovernorConfig())
    g2.record(0, 4)
    assert not g2.drafting       # zero-accept trip
    g3 = Governor(GovernorConfig(zero_accept_grace=2, min_rounds=8))
    g3.record(0, 4)
    g3.record(0, 4)
    assert g3.drafting           # within the grace rounds a zero-accept round does not trip
    g3.record(0, 4)
    assert not g3.drafting and g3.trips == 1


@pytest.mark.parametrize("alpha,K,expect", [(0.75, 4, (30, 40)), (1.0, 4, (40, 40)),
                                            (0.5, 16, (80, 160)), (0.0, 4, (0, 40))])
def test_forced_acceptance_alignment(alpha, K, expect):
    model = ToyModel(draft_noise=5.0, seed=2, max_seq=256)
    draft = MLXProposer(model, "draft", ring=K + 1)
    dec = SpeculativeDecoder(model, draft, "forced", k=K, options=DecodeOptions(forced_alpha=alpha))
    rounds = 10
    n_tokens = rounds * (expect[0] // rounds + 1)
    out = dec.generate([3, 4], n_tokens)
    st = dec.stats
    assert (st.accepted, st.proposed) == expect
    assert st.rounds == rounds and len(out) == n_tokens == st.tokens
    # target and draft hold the same positions after every round
    assert draft.pos == dec.target.pos
    assert draft.state.committed == dec.target.state.committed


def test_ngram_and_auto_on_repetitive_text():
    model = ToyModel(draft_noise=0.5, seed=4)
    # greedy decoding of a Markov table falls into a cycle: n-gram proposals then hit
    prompt = [1, 2, 3]
    ref = toy_ar(model, prompt, 80)
    ng = SpeculativeDecoder(model, NgramProposer(12), "spec", k=4)
    assert ng.generate(prompt, 80) == ref
    assert ng.stats.extra["ngram_hits"] > 0 and ng.stats.alpha > 0.5
    auto = AutoProposer(NgramProposer(12), MLXProposer(model, "draft", ring=5))
    dec = SpeculativeDecoder(model, auto, "spec", k=4)
    assert dec.generate(prompt, 80) == ref
    assert auto.used_ngram > 0 and auto.used_model > 0
    # its n-gram rounds grow too (the model's stay at K: the MLX draft's ring holds 5)
    raw = SpeculativeDecoder(model, auto, "spec", k=4, options=DecodeOptions(governor=GovernorConfig(policy="off")))
    assert raw.generate(prompt, 80) == ref
    assert raw.stats.extra["ngram_longest"] > 4


def test_ngram_proposals_grow_past_k_in_the_loop():
    model = ToyModel(draft_noise=0.5, seed=4)
    prompt = [1, 2, 3]
    raw = GovernorConfig(policy="off")     # every round drafts: the round counts are exact
    for n_tokens in (80, 37):
        ref = toy_ar(model, prompt, n_tokens)
        grow = SpeculativeDecoder(model, NgramProposer(12, k=4), "spec", k=4, options=DecodeOptions(governor=raw))
        assert grow.generate(prompt, n_tokens) == ref      # exactly n_tokens, the AR tokens
        assert 4 < grow.stats.extra["ngram_longest"] <= 15
        assert grow.target.ring >= 16
        fixed = SpeculativeDecoder(model, NgramProposer(12, k=4, max_k=None), "spec", k=4,
                                   options=DecodeOptions(governor=raw))
        assert fixed.generate(prompt, n_tokens) == ref
        assert fixed.stats.extra["ngram_longest"] == 4
        assert grow.stats.rounds < fixed.stats.rounds
    # forced rounds keep K (their ratio is exact)
    forced = SpeculativeDecoder(model, NgramProposer(12, k=4), "forced", k=4, options=DecodeOptions(forced_alpha=1.0))
    forced.generate(prompt, 40)
    assert forced.stats.extra["ngram_longest"] <= 4


def test_auto_gates_a_useless_model_draft():
    model = ToyModel(draft_noise=30.0, seed=6)   # the model draft never agrees
    prompt = [7, 1, 9]
    ref = toy_ar(model, prompt, 80)
    auto = AutoProposer(NgramProposer(12), MLXProposer(model, "draft", ring=5))
    dec = SpeculativeDecoder(model, auto, "spec", k=4, options=DecodeOptions(governor=RAW))   # the gate alone
    assert dec.generate(prompt, 80) == ref
    st = dec.stats
    assert st.extra["auto_gate_trips"] >= 1 and st.extra["auto_gated_rounds"] > 0
    assert auto.used_model < 20  # a few probes, not every n-gram miss
    good = AutoProposer(NgramProposer(12), MLXProposer(model, "target", ring=5))
    dec = SpeculativeDecoder(model, good, "spec", k=4, options=DecodeOptions(governor=RAW))
    assert dec.generate(prompt, 80) == ref
    assert dec.stats.extra["auto_gate_trips"] == 0


def test_stop_tokens_truncate_round():
    model = ToyModel(draft_noise=0.0)
    ref = toy_ar(model, [1, 2], 40)
    stop = ref[13]
    first = ref.index(stop)
    dec = SpeculativeDecoder(model, MLXProposer(model, "target", ring=9), "oracle", k=8)
    assert dec.generate([1, 2], 40, stop_tokens=[stop]) == ref[:first + 1]
    assert dec.stats.stop_reason == "stop_token"


def test_streaming_callback_sees_every_token():
    model = ToyModel(draft_noise=0.3)
    seen = []
    dec = SpeculativeDecoder(model, MLXProposer(model, "draft", ring=5), "spec", k=4)
    out = dec.generate([1, 2], 33, on_tokens=seen.extend)
    assert seen == out and len(out) == 33


def test_round_hook_separates_drafted_tokens_from_the_correction():
    model = ToyModel(draft_noise=0.5, seed=1)     # rounds accepting 0..4 of 4 proposals
    prompt = [1, 2, 3]
    ref = toy_ar(model, prompt, 40)
    rounds, streamed = [], []
    dec = SpeculativeDecoder(model, MLXProposer(model, "draft", ring=5), "spec", k=4,
                             options=DecodeOptions(governor=RAW))
    out = dec.generate(prompt, 40, on_tokens=streamed.append, on_round=rounds.append)
    assert out == ref and len(rounds) == dec.stats.rounds
    assert [list(r.emitted) for r in rounds] == streamed
    pos = 0
    for r in rounds:
        assert r.accepted_tokens == r.proposed[:r.accepted] == tuple(ref[pos:pos + r.accepted])
        assert r.target_tokens == (r.correction,) == (ref[pos + r.accepted],)
        if r.accepted < len(r.proposed):       # the first rejected proposal is not the target's token
            assert r.proposed[r.accepted] != r.correction
        pos += len(r.emitted)
    assert sum(r.accepted for r in rounds) == dec.stats.accepted > 0
    assert sum(len(r.proposed) for r in rounds) == dec.stats.proposed > dec.stats.accepted

    # a stop token among the accepted proposals cuts the round before its correction
    oracle = ToyModel(draft_noise=0.0)
    ref = toy_ar(oracle, [1, 2], 40)
    rounds = []
    dec = SpeculativeDecoder(oracle, MLXProposer(oracle, "target", ring=9), "oracle", k=8)
    out = dec.generate([1, 2], 40, stop_tokens=[ref[4]], on_round=rounds.append)
    assert out == ref[:ref.index(ref[4]) + 1] and len(rounds) == 1
    assert rounds[0].accepted == 8 and rounds[0].target_tokens == () and rounds[0].emitted == tuple(out)

    # sampling: the same bookkeeping, the correction drawn by the residual rule
    rounds = []
    dec = SpeculativeDecoder(model, MLXProposer(model, "draft", ring=5), "spec", k=4,
                             params=smp.SamplingParams(temperature=1.0, seed=1))
    out = dec.generate(prompt, 40, on_round=rounds.append)
    assert [t for r in rounds for t in r.emitted] == out
    assert all(r.accepted_tokens == r.proposed[:r.accepted] for r in rounds)
    assert isinstance(rounds[0], RoundResult)


def test_stats_json_fields():
    model = ToyModel(draft_noise=0.3)
    # raw speculation: the cost governor would not verify this draft (alpha ~ 0.2, at
    # its prior cost of a round)
    dec = SpeculativeDecoder(model, MLXProposer(model, "draft", ring=5), "spec", k=4,
                             options=DecodeOptions(governor=GovernorConfig(policy="off")))
    dec.generate([1, 2], 20, calibrate=True)
    d = dec.stats.to_dict()
    for key in ("tokens", "rounds", "proposed", "accepted", "alpha", "tokens_per_round",
                "governor_trips", "ar_rounds", "draft_s", "verify_s", "c", "v", "tok_s"):
        assert key in d
    assert d["c"] is not None and d["v"] is not None


# ---------------------------------------------------------------------------
# speculative sampling through the engine: the emitted distribution is the target's

def test_engine_speculative_sampling_is_lossless():
    V = 5
    model = ToyModel(V=V, draft_noise=0.7, seed=8, sharp=1.0)
    params = smp.SamplingParams(temperature=1.0, repetition_penalty=1.2, repetition_window=8, top_p=0.95)
    prompt = [1, 2]
    # exact target distribution of the first two emitted tokens (same transforms)
    joint = np.zeros((V, V))
    p0 = smp.probabilities(model.tables["target"][1, 2].astype(np.float32), prompt, params)
    for a in range(V):
        if p0[a] == 0:
            continue
        p1 = smp.probabilities(model.tables["target"][2, a].astype(np.float32), prompt + [a], params)
        joint[a] = p0[a] * p1
    counts = np.zeros((V, V))
    N = 6000
    draft = MLXProposer(model, "draft", ring=4)
    for i in range(N):
        dec = SpeculativeDecoder(model, draft, "spec", k=3, params=smp.SamplingParams(
            temperature=1.0, repetition_penalty=1.2, repetition_window=8, top_p=0.95, seed=i))
        out = dec.generate(prompt, 2)
        counts[out[0], out[1]] += 1
    assert pooled_chi2(counts, joint) < 1.0   # cells pooled to expected counts >= 5


def test_seeded_sampling_reproducible():
    model = ToyModel(V=12, draft_noise=0.5, seed=1, sharp=1.0)
    params = smp.SamplingParams(temperature=0.9, top_k=8, seed=42)
    runs = []
    for _ in range(2):
        dec = SpeculativeDecoder(model, MLXProposer(model, "draft", ring=5), "spec", k=4,
                                    params=params)
        runs.append(dec.generate([1, 2, 3], 40))
    assert runs[0] == runs[1]
    dec = SpeculativeDecoder(model, MLXProposer(model, "draft", ring=5), "spec", k=4,
                                params=smp.SamplingParams(temperature=0.9, top_k=8, seed=43))
    assert dec.generate([1, 2, 3], 40) != runs[0]


# ---------------------------------------------------------------------------
# the real MLX model (tiny random config)

@pytest.fixture(scope="module")
def tiny():
    model_mod = pytest.importorskip("spel_mlx.model")
    from spel_mlx.config import ModelConfig
    cfg = ModelConfig(d_model=32, n_layers=4, n_heads=2, head_dim=16, d_ff=64, vocab=128,
                      max_seq=64, draft_map=(0, 3), spec_k=4).validate()
    w = model_mod.init_weights(cfg, seed=3)
    # draft layers = copies of the target layers they map to: non-trivial acceptance
    for j, src in enumerate(cfg.draft_map):
        for name in list(w):
            if name.startswith(f"layers.{src}."):
                w["draft." + name.replace(f"layers.{src}.", f"layers.{j}.", 1)] = w[name].copy()
    model = model_mod.SpelModel.from_weights(cfg, w)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(32, 127, size=int(n)).tolist() for n in (1, 3, 9, 17, 30)]
    prompts.append([ord(c) for c in "the cat sat on the mat. the cat sat on the"])
    t = SimpleNamespace(cfg=cfg, w=w, model=model, prompts=prompts)
    t.ref = {strict: [_ar(t, p, N_REAL, strict) for p in prompts] for strict in (True, False)}
    return t


N_REAL = 20


def _ar(tiny, prompt, n, strict):
    return SpeculativeDecoder(tiny.model, None, "ar", k=4, options=DecodeOptions(strict=strict)).generate(prompt, n)


@pytest.mark.parametrize("K", [1, 2, 4, 8, 16])
def test_real_strict_spec_and_governed_bit_exact(tiny, K):
    alphas = []
    for prompt, ref in zip(tiny.prompts, tiny.ref[True]):
        for mode in ("spec", "governed"):
            draft = make_proposer("mlx", tiny.model, k=K, options=DraftOptions(strict=True))
            # drafting rounds from the start (shadow probes would verify none of a weak draft's)
            dec = SpeculativeDecoder(tiny.model, draft, mode, k=K,
                                     options=DecodeOptions(strict=True, governor=GovernorConfig(shadow=False)))
            assert dec.generate(prompt, N_REAL) == ref, (K, mode, prompt)
            if mode == "spec":
                alphas.append(dec.stats.alpha)
    assert max(alphas) > 0  # the copied-layer draft agrees sometimes: fidelity is not vacuous


@pytest.mark.parametrize("K", [4, 16])
def test_real_oracle_strict_accepts_all(tiny, K):
    prompt, ref = tiny.prompts[2], tiny.ref[True][2]
    dec = SpeculativeDecoder(tiny.model, make_proposer("target", tiny.model, k=K, options=DraftOptions(strict=True)),
                                "oracle", k=K, options=DecodeOptions(strict=True))
    assert dec.generate(prompt, N_REAL) == ref
    assert dec.stats.alpha == 1.0  # strict: draft and verify rows are bit-identical


def test_real_fast_mode_token_equivalent(tiny):
    for prompt, ref in zip(tiny.prompts, tiny.ref[False]):
        for K, kinds in ((4, ("mlx", "auto", "ngram")), (16, ("mlx", "ngram"))):
            for kind in kinds:
                draft = make_proposer(kind, tiny.model, k=K, options=DraftOptions(auto_fallback="mlx"))
                mode = "governed" if kind == "auto" else "spec"
                dec = SpeculativeDecoder(tiny.model, draft, mode, k=K)
                assert dec.generate(prompt, N_REAL) == ref, (K, kind, prompt)


def test_real_runs_into_max_seq(tiny):
    max_seq = tiny.cfg.max_seq
    for plen in (50, 63, 64):
        prompt = (tiny.prompts[-1] * 3)[:plen]
        ref = _ar(tiny, prompt, 100, True)
        assert len(ref) == max_seq - plen + 1
        for K in (4, 16):
            dec = SpeculativeDecoder(tiny.model, make_proposer("mlx", tiny.model, k=K,
                                                               options=DraftOptions(strict=True)),
                                        "governed", k=K, options=DecodeOptions(strict=True))
            assert dec.generate(prompt, 100) == ref
            assert dec.stats.stop_reason == "max_seq"


def _cdraft_or_skip():
    if not clib.available():
        pytest.skip(f"C draft unavailable: {clib.IMPORT_ERROR}")


@pytest.mark.parametrize("threads", [1, 2])
def test_real_c_draft_fidelity(tiny, threads):
    _cdraft_or_skip()
    alphas = []
    # threads=2 repeats a smaller matrix: the pool result must not depend on it
    n_prompts = 4 if threads == 1 else 2
    for K in ((1, 4, 16) if threads == 1 else (4, 16)):
        draft = make_proposer("c", tiny.model, tiny.w, k=K, options=DraftOptions(threads=threads))
        for prompt, ref in list(zip(tiny.prompts, tiny.ref[True]))[:n_prompts]:
            for mode in (("spec", "governed") if K == 4 else ("spec",)):
                dec = SpeculativeDecoder(tiny.model, draft, mode, k=K, options=DecodeOptions(strict=True))
                assert dec.generate(prompt, N_REAL) == ref, (threads, K, mode)
                alphas.append(dec.stats.alpha)
        draft.close()
    assert max(alphas) > 0
    # fast mode (GEMM verify) with the C draft: token-equivalent on every prompt
    draft = make_proposer("c", tiny.model, tiny.w, k=4, options=DraftOptions(threads=threads))
    for prompt, ref in zip(tiny.prompts, tiny.ref[False]):
        dec = SpeculativeDecoder(tiny.model, draft, "governed" if threads == 2 else "spec", k=4)
        assert dec.generate(prompt, N_REAL) == ref, (threads, "fast")
    draft.close()


def test_real_c_draft_sampling_seeded(tiny):
    _cdraft_or_skip()
    params = smp.SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1, seed=7)
    outs = []
    for _ in range(2):
        draft = make_proposer("c", tiny.model, tiny.w, k=4, options=DraftOptions(threads=1))
        dec = SpeculativeDecoder(tiny.model, draft, "spec", k=4, params=params)
        outs.append(dec.generate(tiny.prompts[3], 16))
        draft.close()
    assert outs[0] == outs[1] and len(outs[0]) == 16


def test_real_c_draft_ahead_fidelity_and_max_seq(tiny):
    """CDraftAheadProposer (the next round drafted during verification) emits exactly the
    ar tokens, for several K and into max_seq (no continuation past the cache)."""
    _cdraft_or_skip()
    for K in (1, 2, 4):
        draft = make_proposer("c", tiny.model, tiny.w, k=K, options=DraftOptions(threads=1, ahead=True))
        assert isinstance(draft, CDraftAheadProposer)
        for prompt, ref in zip(tiny.prompts, tiny.ref[True]):
            dec = SpeculativeDecoder(tiny.model, draft, "spec", k=K, options=DecodeOptions(strict=True))
            assert dec.generate(prompt, N_REAL) == ref, (K, prompt)
        for plen in (50, 63):
            prompt = (tiny.prompts[-1] * 3)[:plen]
            dec = SpeculativeDecoder(tiny.model, draft, "spec", k=K, options=DecodeOptions(strict=True))
            assert dec.generate(prompt, 100) == _ar(tiny, prompt, 100, True)
            assert dec.stats.stop_reason == "max_seq"
        draft.close()


def test_c_draft_prefills_beside_the_target(tiny):
    """The C draft's prompt prefill is running on its own thread while the target
    prefills (start_sync before the target, sync after), and the tokens are ar's."""
    _cdraft_or_skip()
    for ahead in (False, True):
        draft = make_proposer("c", tiny.model, tiny.w, k=4, options=DraftOptions(threads=1, ahead=ahead))
        dec = SpeculativeDecoder(tiny.model, draft, "spec", k=4, options=DecodeOptions(strict=True))
        seen = []
        prefill = dec.target.prefill
        dec.target.prefill = lambda toks: (seen.append(draft._prefilling), prefill(toks))[1]
        prompt, ref = tiny.prompts[1], tiny.ref[True][1]
        assert dec.generate(prompt, N_REAL) == ref
        assert seen == [True] and not draft._prefilling
        assert draft.forwards >= len(prompt) - 1
        draft.close()


def _kept_continuation(tiny, K):
    """(a drafting-ahead C draft after an all-accepted round, so it keeps the continuation
    in its batch; a plain C draft; the history so far)"""
    _cdraft_or_skip()
    prompt = tiny.prompts[0]
    ahead = make_proposer("c", tiny.model, tiny.w, k=K, options=DraftOptions(threads=1, ahead=True))
    plain = make_proposer("c", tiny.model, tiny.w, k=K, options=DraftOptions(threads=1))
    history, pending = list(prompt[:-1]), prompt[-1]
    ahead.reset()
    first, _ = ahead.propose(history, pending, K, smp.GREEDY, None)
    ahead.commit(K + 1)                                   # all accepted: the continuation is kept
    assert ahead._ready is not None
    return ahead, plain, history + [pending] + first


@pytest.mark.parametrize("params", [smp.GREEDY, smp.SamplingParams(
    temperature=0.9, top_p=0.95, repetition_penalty=1.2, repetition_window=8, seed=3, accept="residual")],
    ids=["greedy", "sampled"])
def test_c_draft_ahead_fresh_proposal_runs_k_forwards_with_the_same_tokens(tiny, params):
    """A fresh proposal that opens a continuation runs K draft forwards before it returns
    (the forward over d_{K-1} opens the continuation), not K+1; its proposal, the
    distributions, the guess and the kept continuation are those of a draft that runs
    all K+1 first (no continuation opened), and of a plain draft fed the same tokens."""
    K = 4
    split = make_proposer("c", tiny.model, tiny.w, k=K, options=DraftOptions(threads=1, ahead=True))
    whole = make_proposer("c", tiny.model, tiny.w, k=K, options=DraftOptions(threads=1, ahead=True))
    whole.policy = SimpleNamespace(ahead=False, round=lambda *a: None, stats=dict)
    plain = make_proposer("c", tiny.model, tiny.w, k=K, options=DraftOptions(threads=1))
    prompt = tiny.prompts[2]
    history, pending = list(prompt[:-1]), prompt[-1]
    for d in (split, whole, plain):
        d.reset()
        d.sync(history)
    before = split.forwards
    got, got_qs = split.propose(history, pending, K, params, 11)
    assert split.forwards - before == K and split._running
    want, want_qs = whole.propose(history, pending, K, params, 11)
    assert got == want and not whole._running
    if got_qs is not None:
        assert all(np.array_equal(a, b) for a, b in zip(got_qs, want_qs)) and len(got_qs) == K
    g, g_q = split.guess()
    assert (g, g_q is None) == (whole.guess()[0], whole.guess()[1] is None)
    if g_q is not None:
        assert np.array_equal(g_q, whole.guess()[1])
    split.commit(K + 1)                                  # all accepted: the continuation is kept
    assert split._ready is not None and split._ready[0] == g
    later = history + [pending] + got
    cont, _ = split.propose(later, g, K, params, 11)
    assert split.hits == 1
    plain.sync(later)
    ref, _ = plain.propose(later, g, K, params, 11)
    assert cont == ref
    for d in (split, whole, plain):
        d.close()


def test_c_draft_ahead_continuation_is_dropped_when_the_draft_fell_behind(tiny):
    """A continuation kept for "pending == guess" is not used once tokens were committed
    without the draft (an n-gram round in auto): the proposal is the fresh one."""
    K = 4
    ahead, plain, history = _kept_continuation(tiny, K)
    guess = ahead._ready[0]
    later = history + [guess, 5, 6]                       # three tokens the draft never saw
    got, _ = ahead.propose(later, guess, K, smp.GREEDY, None)
    plain.reset()
    want, _ = plain.propose(later, guess, K, smp.GREEDY, None)
    assert got == want and ahead.hits == 0 and ahead.pos == len(later)
    ahead.close()
    plain.close()


def test_c_draft_catches_up_in_the_background_after_a_kept_continuation(tiny):
    """start_sync (the governor's AR rounds) after an all-accepted round whose continuation
    the draft kept in its batch: the continuation is dropped and the catch-up runs on the
    native thread; the next proposal equals a draft that was fed the same tokens."""
    K = 4
    ahead, plain, history = _kept_continuation(tiny, K)
    later = history + [7, 5, 6, 9]                        # AR tokens the draft never saw
    ahead.start_sync(later[:-1])
    assert ahead._ready is None and ahead._prefilling
    ahead.start_sync(later)                               # the first still running, or done: either way
    ahead.sync(later)
    got, _ = ahead.propose(later, 3, K, smp.GREEDY, None)
    plain.reset()
    want, _ = plain.propose(later, 3, K, smp.GREEDY, None)
    assert got == want and ahead.pos == len(later) and not ahead._prefilling
    ahead.close()
    plain.close()


def test_shipped_c_draft_ahead_hits_and_equals_ar():
    """On the shipped model the drafted-ahead proposals are used (hits) and the
    output is still the ar output, greedy and with a sampling fallback."""
    _cdraft_or_skip()
    from spel_mlx.reader import load_checkpoint
    from spel_mlx.model import SpelModel
    ck = load_checkpoint()
    model = SpelModel.from_weights(ck.cfg, ck.weights)
    prompt = [int(t) for t in np.arange(40) * 37 % ck.cfg.vocab]
    ref = SpeculativeDecoder(model, None, "ar").generate(prompt, 60)
    draft = make_proposer("c", model, ck.weights, k=4, options=DraftOptions(threads=1, ahead=True))
    dec = SpeculativeDecoder(model, draft, "spec", k=4, options=DecodeOptions(governor=RAW))
    assert dec.generate(prompt, 60) == ref
    assert dec.stats.extra["ahead_hits"] > 0
    auto = make_proposer("auto", model, ck.weights, k=4, options=DraftOptions(threads=1, ahead=True))
    assert isinstance(auto.fallback, CDraftAheadProposer)
    assert SpeculativeDecoder(model, auto, "spec", k=4).generate(prompt, 60) == ref
    auto.close()
    # sampling runs the plain C draft path through the same engine: seeded = reproducible
    params = smp.SamplingParams(temperature=0.8, top_p=0.95, seed=5)
    d2 = SpeculativeDecoder(model, draft, "spec", k=4, params=params)
    assert d2.generate(prompt, 30) == d2.generate(prompt, 30)
    draft.close()


@pytest.mark.parametrize("ahead", [False, True])
def test_c_draft_reads_the_last_draft_context_tokens_of_a_long_prompt(shipped_c_run, ahead):
    """draft_context=N: a fresh C draft starts N tokens before the end of a longer prompt
    (its own position count says what it read); the output is still the AR output."""
    ck, model, prompt, ref = shipped_c_run
    history = prompt[:-1]                                   # 39 tokens: what the target commits first
    for context, read in ((16, 16), (64, 39), (0, 39)):
        draft = make_proposer("c", model, ck.weights, k=4,
                              options=DraftOptions(threads=1, ahead=ahead, draft_context=context))
        draft.reset()
        draft.start_sync(history)
        draft.sync(history)
        assert (int(draft.cdraft.pos), draft.pos) == (read, len(history)), context
        dec = SpeculativeDecoder(model, draft, "spec", k=4,
                                 options=DecodeOptions(governor=GovernorConfig(policy="off")))
        assert dec.generate(prompt, 60) == ref
        assert dec.stats.proposed > 0
        draft.close()
    with pytest.raises(DecodeError, match="draft_context=-1"):
        make_proposer("c", model, ck.weights, k=4, options=DraftOptions(draft_context=-1))
