"""`ar` with the next pass built while the one before runs (TargetRunner.ar_tokens):
greedy from the lazy argmax, sampling and penalties from host token ids set once the
host has chosen; the same tokens, stop reasons and state as one verification per round,
and the KV caches still updated in place."""
import numpy as np
import pytest

import spel_mlx  # noqa: F401
import mlx.core as mx
from spel_mlx.config import ModelConfig
from spel_mlx.decoding.governor import GovernorConfig
from spel_mlx.decoding.loop import SpeculativeDecoder, DecodeOptions
from spel_mlx.decoding.sampling import SamplingParams
from spel_mlx.model import SpelModel, init_weights

CFG = ModelConfig(d_model=64, n_layers=4, n_heads=2, head_dim=32, d_ff=96, vocab=64,
                  max_seq=120, attn_period=2, draft_map=(0, 1), spec_k=4)


@pytest.fixture(scope="module")
def model():
    return SpelModel.from_weights(CFG, init_weights(CFG, seed=11))


def prompt(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, CFG.vocab, n)]


SAMPLED = SamplingParams(temperature=0.7, top_p=0.95, repetition_penalty=1.1, seed=3)
PENALIZED = SamplingParams(repetition_penalty=1.3)        # greedy, but not the plain argmax
PARAMS = {"greedy": SamplingParams(), "sampled": SAMPLED, "penalized": PENALIZED}


def decode(model, lookahead, p, n, strict=False, stop=(), rounds=None, params=SamplingParams()):
    dec = SpeculativeDecoder(model, None, "ar", params=params, options=DecodeOptions(strict=strict))
    dec.lookahead = lookahead
    out = dec.generate(p, n, stop_tokens=stop, on_round=None if rounds is None else rounds.append)
    st = dec.target.state
    return out, dec.stats.stop_reason, (dec.target.pos, st.pos, st.pending), dec


@pytest.mark.parametrize("n", [0, 1, 2, 37])
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("params", PARAMS)
def test_same_tokens_and_state_as_one_round_at_a_time(model, n, strict, params):
    p = prompt(9, n)
    a = decode(model, True, p, n, strict, params=PARAMS[params])
    b = decode(model, False, p, n, strict, params=PARAMS[params])
    assert a[:3] == b[:3]
    assert len(a[0]) == n and a[2] == (len(p) - 1 + n, len(p) - 1 + n, 0)
    assert a[3].stats.ar_rounds == a[3].stats.rounds == n


def test_sampled_ar_builds_each_pass_on_host_token_ids(model, monkeypatch):
    """Sampled `ar` looks ahead through host token ids (one per step after the first);
    the seed decides the text (another seed: another text), one round at a time agrees."""
    from spel_mlx.decoding.target import TargetRunner
    made = []
    plain = SpelModel.host_tokens

    def counting(self, n):
        made.append(n)
        return plain(self, n)
    monkeypatch.setattr(SpelModel, "host_tokens", counting)
    p = prompt(9, 1)
    a = decode(model, True, p, 30, params=SAMPLED)
    ahead = len(made)
    b = decode(model, False, p, 30, params=SAMPLED)
    assert a[0] == b[0] and ahead >= 29 and len(made) == ahead      # one round at a time makes none
    other = decode(model, True, p, 30, params=SamplingParams(temperature=0.7, top_p=0.95,
                                                             repetition_penalty=1.1, seed=4))
    assert other[0] != a[0]
    assert TargetRunner(model, ring=5).looks_ahead_sampled


def test_a_pick_that_raises_leaves_the_state_clean(model):
    """An error while choosing a token (the pass after it is built on ids never set)
    leaves nothing pending, and the next call decodes as a fresh decoder."""
    from spel_mlx.decoding.target import TargetRunner
    p = prompt(11, 2)
    tr = TargetRunner(model, ring=5)
    tr.prefill(p[:-1])
    calls = []

    def pick(row):
        calls.append(row.shape)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return int(np.argmax(row))
    with pytest.raises(RuntimeError, match="boom"):
        list(tr.ar_tokens(p[-1], 10, pick))
    assert tr.state.pending == 0 and tr.pos == len(p) - 1 + 3 and calls == [(CFG.vocab,)] * 3
    dec = SpeculativeDecoder(model, None, "ar", params=SAMPLED)
    assert dec.generate(p, 12) == decode(model, False, p, 12, params=SAMPLED)[0]


def test_host_tokens_are_set_once_before_they_are_evaluated(model):
    ids = model.host_tokens(2)
    y = ids.array * 2
    with pytest.raises(RuntimeError, match="before its token ids were set"):
        mx.eval(y)
    ids = model.host_tokens(2)
    y = ids.array * 2
    with pytest.raises(ValueError, match="expected 2 ids"):
        ids.set([1])
    ids.set([3, 5])
    with pytest.raises(ValueError, match="set already"):
        ids.set([3, 5])
    assert y.tolist() == [6, 10]


@pytest.mark.parametrize("params", ["greedy", "sampled"])
def test_stop_token_and_max_seq(model, params):
    params = PARAMS[params]
    p = prompt(12, 3)
    full = decode(model, False, p, 40, params=params)[0]
    stop = full[17]
    first = full.index(stop)
    rounds = []
    a = decode(model, True, p, 40, stop=(stop,), rounds=rounds, params=params)
    assert a[0] == full[:first + 1] and a[1] == "stop_token"
    assert a[2] == (len(p) - 1 + first + 1,) * 2 + (0,)          # the pass built ahead was dropped
    assert [r.correction for r in rounds] == a[0] and all(r.proposed == () for r in rounds)
    near = prompt(CFG.max_seq - 5, 4)                            # 6 positions left: 6 tokens
    a, b = decode(model, True, near, 50, params=params), decode(model, False, near, 50, params=params)
    assert a[:3] == b[:3] and len(a[0]) == 6 and a[1] == "max_seq"


def test_a_call_after_an_early_stop_decodes_as_a_fresh_decoder(model):
    p, q = prompt(20, 5), prompt(7, 6)
    dec = SpeculativeDecoder(model, None, "ar")
    first = dec.generate(p, 30)
    dec.generate(p, 30, stop_tokens=(first[3],))                 # stops with a pass built ahead
    assert dec.generate(q, 25) == decode(model, False, q, 25)[0]


def test_the_kv_caches_are_still_updated_in_place():
    """Each pass is started only after the one before has finished, so MLX donates the
    cache buffers to it: a call's peak memory stays below one more copy of a cache.  (A
    pass started while the one before still runs cannot take them over and copies them:
    with a pass this size, longer than building the next one, the peak then grew by 69
    MB against 8 MB caches.)"""
    cfg = CFG.replace(d_model=512, d_ff=2048, n_heads=8, head_dim=64, vocab=512, max_seq=4096)
    model = SpelModel.from_weights(cfg, init_weights(cfg, seed=2))
    dec = SpeculativeDecoder(model, None, "ar")
    p = prompt(10, 7)
    dec.generate(p, 40)                              # traced
    dec.target.state.reserve(4096)                   # kept by the next calls' reset
    cache = 4096 * cfg.n_heads * cfg.head_dim * 4
    for lookahead in (True, False):
        dec.lookahead = lookahead
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        dec.generate(p, 40)
        assert mx.get_peak_memory() - base < cache, (lookahead, mx.get_peak_memory() - base, cache)


def test_the_governors_ar_rounds_look_ahead_with_the_same_tokens(monkeypatch):
    """`spec` with a useless draft: the cost governor suspends drafting, and the AR rounds
    it then asks for run as one looking-ahead stretch; the text is AR's either way."""
    from test_speculative import ToyModel, toy_ar
    from spel_mlx.decoding.mlx_proposer import MLXProposer
    from spel_mlx.decoding.target import TargetRunner
    stretches = []
    plain = TargetRunner.ar_tokens

    def spy(self, pending, count, pick=None):
        stretches.append(count)
        yield from plain(self, pending, count, pick)
    monkeypatch.setattr(TargetRunner, "ar_tokens", spy)
    toy = ToyModel(V=12, max_seq=400, draft_noise=40.0)
    p = [3, 1, 4, 1, 5]
    probe_by_drafting = DecodeOptions(governor=GovernorConfig(shadow=False))
    for lookahead in (True, False):
        stretches.clear()
        dec = SpeculativeDecoder(toy, MLXProposer(toy, "draft", ring=5), "spec", k=4, options=probe_by_drafting)
        dec.lookahead = lookahead
        out = dec.generate(p, 300)
        st = dec.stats
        assert out == toy_ar(toy, p, 300)
        assert st.governor_trips >= 1 and st.rounds == st.ar_rounds + st.spec_rounds
        if lookahead:
            assert stretches and min(stretches) >= 2 and st.ar_rounds >= sum(stretches) > st.spec_rounds
        else:
            assert stretches == []


@pytest.mark.parametrize("lookahead", [True, False])
def test_the_first_drafting_round_after_ar_rounds_is_not_timed(monkeypatch, lookahead):
    """Its proposal starts afresh after a stretch of single-row passes (a one-off cost of
    the probe): the governor counts its acceptance, not its time; every other drafting
    round is timed."""
    from test_speculative import ToyModel
    from spel_mlx.decoding.governor import CostGovernor
    from spel_mlx.decoding.mlx_proposer import MLXProposer
    seen = []
    plain = CostGovernor.round

    def spy(self, accepted, proposed, seconds, timed=True):
        seen.append((proposed > 0, timed))
        return plain(self, accepted, proposed, seconds, timed)
    monkeypatch.setattr(CostGovernor, "round", spy)
    toy = ToyModel(V=12, max_seq=400, draft_noise=40.0)
    dec = SpeculativeDecoder(toy, MLXProposer(toy, "draft", ring=5), "spec", k=4,
                             options=DecodeOptions(governor=GovernorConfig(shadow=False)))
    dec.lookahead = lookahead
    dec.generate([3, 1, 4, 1, 5], 300)
    drafting = [(prev[0], now[1]) for prev, now in zip(seen, seen[1:]) if now[0]]
    resumed = [timed for after_drafting, timed in drafting if not after_drafting]
    assert dec.stats.governor_resumes >= 1 and resumed and not any(resumed)
    assert all(timed for after_drafting, timed in drafting if after_drafting)


# --- greedy `spec`: the next verification built from the drafted-ahead continuation ----

@pytest.fixture(scope="module")
def shipped():
    from spel_mlx.api import load
    loaded, tok = load()
    yield loaded, tok
    loaded.close()


TEXTS = ["It is a truth universally acknowledged, that", "Elizabeth was", "The house stood",
         "She said that she had never"]


def test_greedy_spec_builds_its_next_verification_ahead(shipped, monkeypatch):
    """With the continuation always awaited (a slow machine may find it late and build
    nothing): every call's tokens are `ar`'s, with and without stop tokens, for the C
    draft and `auto`; built passes are used, dropped before they ran (a rejection) and
    after (the call's end, auto's n-gram taking over), and nothing stays pending.  Every
    round drafts (the cost governor's timed suspensions would decide the counts)."""
    from spel_mlx.decoding import GovernorConfig, make_proposer, DraftOptions
    from spel_mlx.decoding.target import TargetRunner
    loaded, tok = shipped
    model = loaded.model
    monkeypatch.setattr(SpeculativeDecoder, "_peek_timeout", lambda self, started: 10.0)
    dropped = []
    plain = TargetRunner.drop_built

    def spy(self, built):
        dropped.append(built.mark is None)       # True: it had started
        return plain(self, built)
    monkeypatch.setattr(TargetRunner, "drop_built", spy)
    ar = SpeculativeDecoder(model, None, "ar")
    used = 0
    for kind in ("c", "auto"):
        decs = {}
        for lookahead in (True, False):
            decs[lookahead] = SpeculativeDecoder(
                model, make_proposer(kind, model, weights=loaded.weights, k=4, options=DraftOptions(threads=1, ahead=True)),
                "spec", options=DecodeOptions(governor=GovernorConfig(policy="off")))
            decs[lookahead].lookahead = lookahead
        for text in TEXTS:
            p = tok.encode(text)
            want = ar.generate(p, 60)
            stop = {want[25]}
            want_stop = ar.generate(p, 60, stop_tokens=stop)
            for lookahead, dec in decs.items():
                assert dec.generate(p, 60) == want, (kind, text, lookahead)
                assert dec.target.state.pending == 0 and dec.target.pos == dec.target.state.pos
                used += dec.stats.extra.get("built_ahead", 0) if lookahead else 0
                assert lookahead or "built_ahead" not in dec.stats.extra
                assert dec.generate(p, 60, stop_tokens=stop) == want_stop
        for dec in decs.values():
            dec.close()
    assert used > 20 and True in dropped and False in dropped, (used, dropped.count(True), dropped.count(False))


def test_greedy_spec_building_ahead_keeps_the_caches_in_place(shipped, monkeypatch):
    """A built pass starts only after the verification before it has finished and holds
    nothing else of its caches, so MLX still updates them in place: the peak memory of a
    call grows by less than one cache copy (4 MB at 4,096 rows) over the same call
    verifying one round at a time."""
    from spel_mlx.decoding import make_proposer, DraftOptions
    loaded, tok = shipped
    model = loaded.model
    monkeypatch.setattr(SpeculativeDecoder, "_peek_timeout", lambda self, started: 10.0)
    from spel_mlx.decoding import GovernorConfig
    dec = SpeculativeDecoder(model, make_proposer("c", model, weights=loaded.weights, k=4,
                                                  options=DraftOptions(threads=1, ahead=True)),
                             "spec", options=DecodeOptions(governor=GovernorConfig(policy="off")))
    p = tok.encode(TEXTS[0])
    dec.generate(p, 80)
    dec.target.state.reserve(model.cfg.max_seq)       # kept by the next calls' reset
    cache = model.cfg.max_seq * model.cfg.n_heads * model.cfg.head_dim * 4
    peaks = {}
    for lookahead in (False, True):
        dec.lookahead = lookahead
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        dec.generate(p, 80)
        peaks[lookahead] = mx.get_peak_memory() - base
    assert dec.stats.extra.get("built_ahead", 0) > 5
    assert peaks[True] < peaks[False] + cache / 2, (peaks, cache)
    dec.close()


@pytest.mark.parametrize("accept", ["residual", "coupled"])
def test_sampled_spec_builds_ahead_with_the_same_tokens(shipped, monkeypatch, accept):
    """A sampled round's next proposal is the continuation drafted from the context and
    noise a full acceptance leaves: built from it, the seeded text is the same as one
    round at a time (both rules: their draws are indexed by position, not by round).
    Every round drafts (the coupled rule's cost governor would suspend drafting by the
    machine's timing, and with it the count of passes built ahead)."""
    from spel_mlx.decoding import GovernorConfig, make_proposer, DraftOptions
    from spel_mlx.decoding.sampling import SamplingParams
    loaded, tok = shipped
    model = loaded.model
    monkeypatch.setattr(SpeculativeDecoder, "_peek_timeout", lambda self, started: 10.0)
    used = 0
    for seed in (1, 2):
        params = SamplingParams(temperature=0.7, top_p=0.95, repetition_penalty=1.1, seed=seed, accept=accept)
        outs = {}
        for lookahead in (True, False):
            draft = make_proposer("c", model, weights=loaded.weights, k=4, options=DraftOptions(threads=1, ahead=True))
            dec = SpeculativeDecoder(model, draft, "spec", params=params,
                                     options=DecodeOptions(governor=GovernorConfig(policy="off")))
            dec.lookahead = lookahead
            outs[lookahead] = [dec.generate(tok.encode(text), 60) for text in TEXTS[:2]]
            used += dec.stats.extra.get("built_ahead", 0) if lookahead else 0
            assert dec.target.state.pending == 0
            dec.close()
        assert outs[True] == outs[False], (accept, seed)
    assert used > 3, used


@pytest.mark.parametrize("params", ["greedy", "sampled"])
def test_the_c_draft_follows_the_governors_ar_rounds(monkeypatch, params):
    """A useless C draft (other weights), drafting ahead: the cost governor suspends it,
    and during its AR stretches the draft catches up on their tokens in the background
    (every FOLLOW_EVERY tokens), so a probe catches up on a few (the negative control: a
    draft that does not follow is behind by a whole back-off).  The text is ar's (the
    coupled rule when sampling), and nothing is left running at the end of a call."""
    from spel_mlx.decoding import loop
    from spel_mlx.decoding.factory import make_proposer, DraftOptions
    from spel_mlx.native import clib
    if not clib.available():
        pytest.skip("C draft unavailable")
    params = PARAMS[params] if params == "greedy" else SamplingParams(temperature=0.7, top_p=0.95, seed=3,
                                                                        accept="coupled")
    cfg = CFG.replace(max_seq=400)
    model = SpelModel.from_weights(cfg, init_weights(cfg, seed=11))
    behind = []
    plain = loop.SpeculativeDecoder._catch_up

    def catch_up(self, history):
        behind.append(len(history) - self.proposer.pos)
        return plain(self, history)
    monkeypatch.setattr(loop.SpeculativeDecoder, "_catch_up", catch_up)
    p = prompt(9, 8)
    ref = decode(model, False, p, 300, params=params)[0]
    worst = {}
    for follow in (16, 10 ** 9):
        monkeypatch.setattr(loop, "FOLLOW_EVERY", follow)
        behind.clear()
        draft = make_proposer("c", model, init_weights(cfg, seed=12), k=4, options=DraftOptions(threads=1, ahead=True))
        dec = SpeculativeDecoder(model, draft, "spec", k=4, params=params,
                                 options=DecodeOptions(governor=GovernorConfig(shadow=False)))
        assert dec.generate(p, 300) == ref
        assert dec.stats.governor_trips >= 1 and behind and not draft._prefilling
        worst[follow] = max(behind)
        draft.close()
    assert worst[16] <= 2 * 16 + 1 < worst[10 ** 9]


def test_the_c_draft_follows_only_near_the_next_probe(monkeypatch):
    """During a long back-off the draft does not follow the AR rounds until the next probe
    is at most 2 * FOLLOW_EVERY tokens away (its work on the other core slows the target's
    steps); it then catches up on the whole stretch in the background, so the probe still
    finds it at most about FOLLOW_EVERY behind.  The text is ar's."""
    from spel_mlx.decoding import loop
    from spel_mlx.decoding.factory import make_proposer, DraftOptions
    from spel_mlx.native import clib
    if not clib.available():
        pytest.skip("C draft unavailable")
    cfg = CFG.replace(max_seq=400)
    model = SpelModel.from_weights(cfg, init_weights(cfg, seed=11))
    p = prompt(9, 8)
    ref = decode(model, False, p, 300)[0]
    draft = make_proposer("c", model, init_weights(cfg, seed=12), k=4, options=DraftOptions(threads=1, ahead=True))
    dec = SpeculativeDecoder(model, draft, "spec", k=4,
                             options=DecodeOptions(governor=GovernorConfig(shadow=False, backoff=128,
                                                                           backoff_growth=1)))
    due, behind = [], []
    plain_sync, plain_catch_up = type(draft).start_sync, loop.SpeculativeDecoder._catch_up

    def start_sync(self, history, background=False):
        if getattr(dec, "call", None) is not None and len(history) > len(p):
            due.append(dec.call.gov.ar_rounds_due())
        plain_sync(self, history, background)
        self.settle()       # what it follows, not when a busy machine lets its thread run

    def catch_up(self, history):
        behind.append(len(history) - self.proposer.pos)
        return plain_catch_up(self, history)
    monkeypatch.setattr(type(draft), "start_sync", start_sync)
    monkeypatch.setattr(loop.SpeculativeDecoder, "_catch_up", catch_up)
    assert dec.generate(p, 300) == ref
    assert dec.stats.governor_trips >= 1 and due and behind
    assert max(due) <= 2 * loop.FOLLOW_EVERY
    assert max(behind) <= 2 * loop.FOLLOW_EVERY + 1
    draft.close()


# --- the governor's shadow probes ------------------------------------------------------

def agreeing_draft_model():
    """A model whose draft layers are copies of target layers (so it agrees at times), and its weights."""
    cfg = CFG.replace(max_seq=400)
    w = init_weights(cfg, seed=11)
    for j, src in enumerate(cfg.draft_map):
        for name in [n for n in w if n.startswith(f"layers.{src}.")]:
            w["draft." + name.replace(f"layers.{src}.", f"layers.{j}.", 1)] = w[name].copy()
    return SpelModel.from_weights(cfg, w), w


def assert_counts_match(out, probes, counts):
    """Each count the governor heard is the prefix of its probe's proposal that the text
    matches where the probe started (`probes`: (output index, proposal) pairs)."""
    for (at, proposal), n in zip(probes, counts):
        match = 0
        while match < len(proposal) and out[at + match] == proposal[match]:
            match += 1
        assert n == match, (at, proposal, out[at:at + 4])


def heard_counts(monkeypatch) -> list:
    """The accepted counts the cost governor hears from shadow probes, in order."""
    from spel_mlx.decoding.governor import CostGovernor
    counts, plain_round = [], CostGovernor.shadow_round

    def shadow_round(self, accepted, proposed):
        counts.append(accepted)
        return plain_round(self, accepted, proposed)
    monkeypatch.setattr(CostGovernor, "shadow_round", shadow_round)
    return counts


def probe_setup(monkeypatch, params: str, n: int):
    """What both shadow-probe tests start from: the counts the governor will hear, the
    agreeing draft model and its weights, the sampling, the prompt and AR's n tokens."""
    counts = heard_counts(monkeypatch)
    model, w = agreeing_draft_model()
    sp = PARAMS[params] if params == "greedy" else SamplingParams(temperature=0.8, top_p=0.95, seed=5)
    p = prompt(9, 8)
    return counts, model, w, sp, p, decode(model, False, p, n, params=sp)[0]


@pytest.mark.parametrize("params", ["greedy", "sampled"])
def test_a_shadow_probes_acceptance_is_what_a_verification_would_accept(monkeypatch, params):
    """Every unverified proposal's accepted count is the prefix of it that the emitted
    text matches at its position (what a verification there would have accepted), and
    the text is AR's; the drafting that follows the probes happens too (the draft agrees
    often enough)."""
    from spel_mlx.decoding.mlx_proposer import MLXProposer
    shadows, plain_shadow = [], MLXProposer.shadow

    def shadow(self, history, pending, k, params, seed):
        out = plain_shadow(self, history, pending, k, params, seed)
        shadows.append((len(dec.output), out))
        return out
    monkeypatch.setattr(MLXProposer, "shadow", shadow)
    counts, model, w, sp, p, ref = probe_setup(monkeypatch, params, 200)
    # the cost prior at its extreme: every probe fails, so probes recur all call long
    dec = SpeculativeDecoder(model, MLXProposer(model, "draft", ring=5), "spec", k=4, params=sp,
                             options=DecodeOptions(governor=GovernorConfig(prior_cost=100.0, backoff_growth=1)))
    out = dec.generate(p, 200)
    assert out == ref and dec.stats.spec_rounds == 0
    assert len(counts) >= 10 and 0 < sum(counts) < 4 * len(counts)     # neither none nor all agree
    assert_counts_match(out, shadows, counts)
    # and where rounds are priced cheap, the same probes let this draft draft
    dec = SpeculativeDecoder(model, MLXProposer(model, "draft", ring=5), "spec", k=4, params=sp,
                             options=DecodeOptions(governor=GovernorConfig(prior_cost=1.0)))
    assert dec.generate(p, 200) == ref and dec.stats.spec_rounds > 0


@pytest.mark.parametrize("params", ["greedy", "sampled"])
def test_a_useless_c_draft_is_never_verified(params):
    """A C draft of other weights (alpha ~ 0): shadow probes find it useless, so no round
    verifies a proposal and no K+1-row pass is built; the negative control (probing by
    drafting rounds) verifies some.  The text is ar's either way."""
    from spel_mlx.decoding.factory import make_proposer, DraftOptions
    from spel_mlx.native import clib
    if not clib.available():
        pytest.skip("C draft unavailable")
    sp = PARAMS[params] if params == "greedy" else SamplingParams(temperature=0.7, top_p=0.95, seed=3)
    cfg = CFG.replace(max_seq=400)
    model = SpelModel.from_weights(cfg, init_weights(cfg, seed=11))
    p = prompt(9, 8)
    ref = decode(model, False, p, 300, params=sp)[0]
    for shadow in (True, False):
        draft = make_proposer("c", model, init_weights(cfg, seed=12), k=4, options=DraftOptions(threads=1, ahead=True))
        dec = SpeculativeDecoder(model, draft, "spec", k=4, params=sp,
                                 options=DecodeOptions(governor=GovernorConfig(shadow=shadow)))
        built = model.passes_built
        assert dec.generate(p, 300) == ref
        st = dec.stats
        if shadow:
            assert st.spec_rounds == 0 and st.extra["shadow_probes"] >= 2 and model.passes_built == built
            assert st.extra["shadow_accepted"] < st.extra["shadow_proposed"] / 4
        else:
            assert st.spec_rounds > 0 and "shadow_probes" not in st.extra
        assert not draft._prefilling and not draft._shadowing
        draft.close()


@pytest.mark.parametrize("params", ["greedy", "sampled"])
def test_a_c_draft_shadow_probe_runs_on_its_thread_and_counts_what_a_verification_would(monkeypatch, params):
    """The C draft's shadow proposals run on its own thread (``shadow_start``), the
    synchronous ``shadow`` never: each count the governor hears is the prefix of that
    proposal which the emitted text matches where it was started, whenever it arrived."""
    from spel_mlx.decoding.factory import make_proposer, DraftOptions
    from spel_mlx.decoding.c_proposer import CDraftProposer
    from spel_mlx.native import clib
    if not clib.available():
        pytest.skip("C draft unavailable")
    started, taken = [], []
    plain_start, plain_take = CDraftProposer.shadow_start, CDraftProposer.shadow_take

    def shadow_start(self, history, pending, k, params, seed):
        ok = plain_start(self, history, pending, k, params, seed)
        if ok:
            started.append(len(dec.output))
        return ok

    def shadow_take(self):
        out = plain_take(self)
        if out is not None:
            taken.append(out)
        return out

    def shadow(self, *a):
        raise AssertionError("a synchronous shadow proposal")
    monkeypatch.setattr(CDraftProposer, "shadow_start", shadow_start)
    monkeypatch.setattr(CDraftProposer, "shadow_take", shadow_take)
    monkeypatch.setattr(CDraftProposer, "shadow", shadow)
    counts, model, w, sp, p, ref = probe_setup(monkeypatch, params, 250)
    draft = make_proposer("c", model, w, k=4, options=DraftOptions(threads=1, ahead=True))
    dec = SpeculativeDecoder(model, draft, "spec", k=4, params=sp,      # every probe fails: they recur
                             options=DecodeOptions(governor=GovernorConfig(prior_cost=100.0, backoff_growth=1)))
    out = dec.generate(p, 250)
    assert out == ref and dec.stats.spec_rounds == 0
    assert len(counts) >= 8 and len(started) >= len(counts) and len(taken) >= len(counts)
    assert 0 < sum(counts) < 4 * len(counts)        # neither none nor all agree
    assert_counts_match(out, list(zip(started, taken)), counts)
    assert not draft._prefilling and not draft._shadowing
    draft.close()
