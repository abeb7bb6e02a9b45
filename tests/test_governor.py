"""Governors: the cost model's decisions from injected round measurements (no timing),
which policy a mode runs, and greedy output under any pattern of drafting rounds."""
import pytest

import spel_mlx  # noqa: F401

from spel_mlx.decoding import GovernorConfig, SpeculativeDecoder, make_proposer, DraftOptions
from spel_mlx.decoding import governor as gv
from spel_mlx.decoding import loop
from spel_mlx.decoding import sampling as smp
from spel_mlx.decoding.mlx_proposer import MLXProposer
from test_speculative import ToyModel, toy_ar, toy_prompts

AR = 0.001     # one AR round, seconds (the cost model only sees ratios)


def feed(g, rounds):
    """rounds: [(accepted, proposed, cost in AR rounds)]; returns the drafting flag before each."""
    seen = []
    for a, p, c in rounds:
        seen.append(g.drafting)
        g.round(a, p, c * AR)
    return seen


def useless_call(g, tokens):
    """Drive a call of `tokens` tokens with a draft that never agrees (rounds cost 2 AR)."""
    pattern = []
    for _ in range(tokens):
        if g.drafting:
            g.round(0, 4, 2.0 * AR)
            pattern.append("d")
        else:
            g.round(0, 0, AR)
            pattern.append(".")
    return "".join(pattern)


def test_cost_governor_starts_with_ar_rounds_then_drafts():
    g = gv.CostGovernor(GovernorConfig(ar_first=2))
    assert feed(g, [(0, 0, 1.0), (0, 0, 1.0), (4, 4, 2.0)]) == [False, False, True]
    seeded = gv.CostGovernor(GovernorConfig(ar_first=2), memory=gv.GovernorMemory(AR))
    assert seeded.drafting                      # an AR time from an earlier call suffices


def test_cost_governor_break_even_is_the_cost_model():
    # rounds of K=4 costing 2 AR tokens: alpha* = (2 (1 - margin) - 1) / 4
    cfg = GovernorConfig(margin=0.1, first_rounds=1)
    g = gv.CostGovernor(cfg, memory=gv.GovernorMemory(AR))
    feed(g, [(3, 4, 2.0)])
    assert g.break_even == pytest.approx((2.0 * 0.9 - 1.0) / 4)
    # the window's acceptance shrinks towards the call's, which shrinks towards prior_alpha
    call = (3 + 4 * 0.5) / (4 + 4)
    assert g.alpha_estimate == pytest.approx((3 + 2 * 4 * call) / (4 + 2 * 4))
    # the same acceptance at a higher cost trips: alpha* = (4 * 0.9 - 1) / 4 = 0.65
    h = gv.CostGovernor(cfg, memory=gv.GovernorMemory(AR))
    feed(h, [(2, 4, 4.0)])
    assert not h.drafting and h.trips == 1


def test_cost_governor_suspends_a_useless_draft_and_backs_off():
    cfg = GovernorConfig(first_rounds=2, backoff=16, backoff_growth=4, backoff_max=512)
    g = gv.CostGovernor(cfg, memory=gv.GovernorMemory(AR))
    pattern = useless_call(g, 400)
    runs = [len(r) for r in pattern.split("d") if r]
    drafted = [len(r) for r in pattern.split(".") if r]
    assert drafted[0] == 2                      # trips once first_rounds are in
    assert runs == [16, 64, 256, 400 - 2 - 16 - 1 - 64 - 1 - 256 - 1][:len(runs)]
    assert drafted[1:] == [1] * (len(drafted) - 1)    # a probe of a useless draft: one round
    assert g.trips == 4 and g.resumes == 3
    assert pattern.count("d") / len(pattern) < 0.02


def test_cost_governor_carries_a_useless_drafts_backoff_into_the_next_call():
    cfg = GovernorConfig(first_rounds=2, backoff=16, backoff_growth=4, backoff_max=512, carry_backoff=64)
    first = gv.CostGovernor(cfg, memory=gv.GovernorMemory(AR))
    assert useless_call(first, 256).count("d") == 4      # 2 rounds, then probes at 16, 64
    memory = first.memory()
    assert memory.backoff_left > 0 and memory.failures == 2 and memory.ar_seconds == pytest.approx(AR)
    later = gv.CostGovernor(cfg, memory=memory)
    pattern = useless_call(later, 256)
    # the next call probes once, after the carried back-off capped at 64 AR tokens
    assert pattern.index("d") == 64 and pattern.count("d") == 1
    assert later.trips == 1 and later.memory().backoff_left > 0
    # negative control: without the memory the same call probes three times
    assert useless_call(gv.CostGovernor(cfg, memory=gv.GovernorMemory(AR)), 256).count("d") == 4


def test_cost_governor_keeps_an_untested_verdict_across_short_calls():
    # 64-token calls: a call whose carried back-off outlasts it tests nothing, and the
    # verdict must reach the next call, which probes once instead of starting afresh
    cfg = GovernorConfig(first_rounds=2, backoff=16, backoff_growth=4, backoff_max=512, carry_backoff=64)
    g = gv.CostGovernor(cfg, memory=gv.GovernorMemory(AR))
    patterns = [useless_call(g, 64)]
    for _ in range(5):
        g = gv.CostGovernor(cfg, memory=g.memory())
        patterns.append(useless_call(g, 64))
    assert patterns[0].count("d") == 3                    # 2 first rounds, a probe at 16
    assert [p.count("d") for p in patterns[1:]] == [1, 0, 1, 0, 1]
    assert patterns[3].index("d") == 0                    # the untested verdict: probed at once
    assert g.memory().useless


def test_cost_governor_carries_nothing_from_a_call_where_the_draft_paid():
    cfg = GovernorConfig(first_rounds=2, backoff=16)
    g = gv.CostGovernor(cfg, memory=gv.GovernorMemory(AR))
    feed(g, [(4, 4, 2.0)] * 20 + [(0, 4, 2.0)] * 8)      # tripped once, at the end of a good call
    assert g.suspended and g.trips == 1
    memory = g.memory()
    assert memory.backoff_left == 0 and memory.failures == 0
    assert gv.CostGovernor(cfg, memory=memory).drafting   # the next call drafts at once
    assert gv.Governor(cfg).memory() == gv.GovernorMemory()   # the original's rule: per call


def test_decoder_leaves_the_governor_memory_on_its_proposer(monkeypatch):
    model = ToyModel(draft_noise=0.3, seed=5)
    prompts = toy_prompts(12, 2, seed=2)
    draft = MLXProposer(model, "draft", ring=4)
    assert draft.governor_memory is None
    SpeculativeDecoder(model, draft, "spec", k=3).generate(prompts[0], 12)
    # (its AR time may be None: on a loaded machine a drafting round can time below the AR
    # rounds, which drops the reference; the unit tests above feed the times)
    assert isinstance(draft.governor_memory, gv.GovernorMemory)
    # a new decoder around the same proposer (the API builds one per call) starts from it
    before, seen, real = draft.governor_memory, [], loop.make_governor
    monkeypatch.setattr(loop, "make_governor", lambda *a: seen.append(a[3]) or real(*a))
    SpeculativeDecoder(model, draft, "spec", k=3).generate(prompts[1], 8)
    assert seen == [before] and draft.governor_memory is not before


def test_cost_governor_ignores_the_time_of_rounds_that_built_a_pass():
    """A round that traced a new pass shape (`timed` False) counts for its acceptance,
    not its time: a 20-AR-token compile round does not trip a good draft (the same
    round timed does: the control), and an untimed AR round sets no AR reference."""
    cfg = GovernorConfig(first_rounds=1)
    untimed = gv.CostGovernor(cfg, memory=gv.GovernorMemory(AR))
    timed = gv.CostGovernor(cfg, memory=gv.GovernorMemory(AR))
    for g, flag in ((untimed, False), (timed, True)):
        g.round(4, 4, 1.5 * AR)
        g.round(3, 4, 20.0 * AR, timed=flag)
    assert untimed.drafting and untimed.trips == 0 and len(untimed.window) == 1
    assert untimed._accepted == 7 and untimed._proposed == 8
    assert not timed.drafting and timed.trips == 1
    fresh = gv.CostGovernor(GovernorConfig(ar_first=1))
    fresh.round(0, 0, 30.0 * AR, timed=False)
    assert not fresh.drafting and fresh.ar_seconds is None      # still waits for a timed AR round
    fresh.round(0, 0, AR)
    assert fresh.drafting and fresh.ar_seconds == pytest.approx(AR)


def test_decoder_marks_the_rounds_that_built_a_pass(monkeypatch):
    """The loop tells the governor which rounds traced a new pass shape (the n-gram's
    growing proposals on a fresh model): exactly those, and none once all are built."""
    pytest.importorskip("spel_mlx.model")
    from spel_mlx.config import ModelConfig
    from spel_mlx.model import SpelModel, init_weights
    cfg = ModelConfig(d_model=32, n_layers=4, n_heads=2, head_dim=16, d_ff=64, vocab=128,
                      max_seq=96, draft_map=(0, 3), spec_k=4).validate()
    model = SpelModel.from_weights(cfg, init_weights(cfg, seed=3))
    built = []      # the model's passes_built after the prefill, then after every round

    class Recorder(gv.Governor):
        def round(self, accepted, proposed, seconds, timed=True):
            self.flags.append(timed)
            built.append(model.passes_built)

    monkeypatch.setattr(loop, "make_governor", lambda *a, **k: Recorder(GovernorConfig()))
    dec = SpeculativeDecoder(model, make_proposer("ngram", model, k=4), "spec", k=4)
    prefill = dec.target.prefill
    dec.target.prefill = lambda tokens: (prefill(tokens), built.append(model.passes_built))
    prompt = [5, 6, 7, 8] * 6
    for call in range(2):
        built.clear()
        Recorder.flags = []
        dec.generate(prompt, 40)
        changed = [b != a for a, b in zip(built, built[1:])]
        assert Recorder.flags == [not c for c in changed]
        assert any(changed) if call == 0 else not any(changed)


def test_cost_governor_keeps_a_good_draft_through_bad_rounds():
    g = gv.CostGovernor(GovernorConfig(), memory=gv.GovernorMemory(AR))
    good = [(4, 4, 2.0)] * 10
    assert all(feed(g, good + [(0, 4, 2.6), (0, 4, 2.6)] + good))
    assert g.trips == 0
    # ... but suspends once its acceptance stays below break-even
    bad = 0
    while g.drafting:
        g.round(0, 4, 2.6 * AR)
        bad += 1
    assert 2 < bad <= 8 and g.trips == 1


def test_cost_governor_one_slow_round_does_not_trip():
    g = gv.CostGovernor(GovernorConfig(), memory=gv.GovernorMemory(AR))
    feed(g, [(2, 4, 2.0)] * 7)
    assert g.drafting
    feed(g, [(2, 4, 400.0)])                    # stalled: capped at 4x the window's median
    assert g.drafting and g.trips == 0
    assert g.break_even == pytest.approx(((7 * 2.0 + 8.0) / 8 * (1 - g.cfg.margin) - 1) / 4)


def test_cost_governor_probe_that_lasts_resets_the_backoff():
    cfg = GovernorConfig(window=4, first_rounds=1, backoff=8, backoff_growth=2, margin=0.1)
    g = gv.CostGovernor(cfg, memory=gv.GovernorMemory(AR))
    feed(g, [(0, 4, 2.0)])
    assert not g.drafting
    feed(g, [(0, 0, 1.0)] * 8)
    feed(g, [(0, 4, 2.0)])                      # a failed probe: 16 AR tokens next
    feed(g, [(0, 0, 1.0)] * 15)
    assert not g.drafting
    feed(g, [(0, 0, 1.0)])
    assert g.drafting
    feed(g, [(4, 4, 2.0)] * 5 + [(0, 4, 2.0)] * 4)  # lasted more than a window, then tripped
    assert not g.drafting
    assert feed(g, [(0, 0, 1.0)] * 8) == [False] * 8 and g.drafting   # back to 8


def test_cost_governor_ar_reference_is_a_capped_mean():
    g = gv.CostGovernor(GovernorConfig(ar_samples=4))
    feed(g, [(0, 0, 9.0), (0, 0, 1.0), (0, 0, 3.0), (0, 0, 1.0), (0, 0, 100.0)])
    # the last 4 kept; 100 capped at 4x their median (2.0)
    assert g.ar_seconds == pytest.approx((1.0 + 3.0 + 1.0 + 8.0) / 4 * AR)


def test_cost_governor_refreshes_its_ar_reference():
    g = gv.CostGovernor(GovernorConfig(ar_refresh=16), memory=gv.GovernorMemory(AR))
    seen = feed(g, [(4, 4, 2.0)] * 16)
    assert all(seen) and not g.drafting          # one AR round after 16 drafting rounds
    feed(g, [(0, 0, 1.0)])
    assert g.drafting and g.trips == 0


def test_cost_governor_drops_a_stale_ar_reference():
    # an AR time from a preempted round: drafting rounds then measure cheaper than AR
    # rounds, which they cannot be, so the reference is measured again
    g = gv.CostGovernor(GovernorConfig(ar_first=2, first_rounds=2), memory=gv.GovernorMemory(5 * AR))
    assert feed(g, [(0, 4, 2.0)] * 2) == [True, True]
    assert not g.drafting and g.ar_seconds is None and g.trips == 0
    assert feed(g, [(0, 0, 1.0), (0, 0, 1.0)]) == [False, False]
    assert feed(g, [(0, 4, 2.0)]) == [True]
    assert not g.drafting and g.trips == 1       # with a true AR time the useless draft trips


def test_policy_for_modes_and_sampling():
    cfg = GovernorConfig()
    assert cfg.policy_for("spec", smp.GREEDY) == "cost"
    assert cfg.policy_for("governed", smp.GREEDY) == "original"
    # residual-rule sampling: where rounds start changes the draws, so no timed governor;
    # the coupled rule (the default) draws ar's tokens whatever the rounds: the cost model's
    sampled = smp.SamplingParams(temperature=0.8, seed=1, accept="residual")
    assert cfg.policy_for("spec", sampled) == "off"
    assert cfg.policy_for("spec", smp.SamplingParams(temperature=0.8, seed=1)) == "cost"
    assert GovernorConfig(policy="cost").policy_for("spec", sampled) == "cost"
    assert GovernorConfig(policy="off").policy_for("governed", smp.GREEDY) == "off"
    with pytest.raises(ValueError, match="policy 'fast'"):
        GovernorConfig(policy="fast").policy_for("spec")
    assert gv.make_governor(cfg, "ar") is None and gv.make_governor(cfg, "forced") is None
    assert isinstance(gv.make_governor(cfg, "spec", smp.GREEDY), gv.CostGovernor)
    assert isinstance(gv.make_governor(cfg, "governed"), gv.Governor)


class ScriptedGovernor:
    """Drafts on the rounds a pattern says (deterministic): any policy's decisions."""

    policy = "scripted"
    ar_seconds = None

    def __init__(self, pattern):
        self.pattern, self.i = pattern, 0
        self.trips = self.resumes = 0

    @property
    def drafting(self):
        return self.pattern[self.i % len(self.pattern)] == "d"

    def round(self, accepted, proposed, seconds, timed=True):
        self.i += 1

    def ar_rounds_due(self):     # the governor protocol: no AR stretches of its own
        return 0

    def stats(self):
        return {"governor": self.policy}

    def memory(self):
        return gv.GovernorMemory()


@pytest.fixture
def scripted(monkeypatch):
    def use(pattern):
        monkeypatch.setattr(loop, "make_governor", lambda *a, **k: ScriptedGovernor(pattern))
    return use


PATTERNS = ["d", ".", "d.", "dd...", "d..d.dd....", "..ddddd.d"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_any_drafting_pattern_equals_ar(scripted, pattern):
    scripted(pattern)
    model = ToyModel(draft_noise=0.3, seed=5)
    for prompt in toy_prompts(12, 3, seed=2):
        ref = toy_ar(model, prompt, 40)
        for K in (1, 4):
            draft = MLXProposer(model, "draft", ring=K + 1)
            dec = SpeculativeDecoder(model, draft, "spec", k=K)
            assert dec.generate(prompt, 40) == ref
            st = dec.stats
            assert st.rounds == st.spec_rounds + st.ar_rounds
            assert (st.spec_rounds == 0) == ("d" not in pattern)
            # the draft caught up before every proposal: it holds a prefix of the history
            tc, dc = dec.target.state.committed, draft.state.committed
            assert dc == tc[:len(dc)]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_any_drafting_pattern_keeps_coupled_sampling_equal_to_sampled_ar(scripted, pattern):
    """Coupled sampling, like greedy decoding, does not depend on which rounds draft (so
    spec's cost governor is its default); the residual rule does (its default is off)."""
    scripted(pattern)
    model = ToyModel(draft_noise=0.3, seed=5)
    params = smp.SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.1, seed=4, accept="coupled")
    for prompt in toy_prompts(12, 3, seed=3):
        ref = SpeculativeDecoder(model, None, "ar", params=params).generate(prompt, 40)
        dec = SpeculativeDecoder(model, MLXProposer(model, "draft", ring=5), "spec", k=4, params=params)
        assert dec.generate(prompt, 40) == ref


@pytest.mark.parametrize("pattern", ["dd.", "ddd..", "d.dd.."])
def test_drafting_ahead_under_suspensions_equals_ar(scripted, pattern, shipped_c_run):
    """A continuation kept by an all-accepted round, then AR rounds: the catch-up drops it."""
    ck, model, prompt, ref = shipped_c_run
    draft = make_proposer("c", model, ck.weights, k=4, options=DraftOptions(threads=1, ahead=True))
    scripted(pattern)
    dec = SpeculativeDecoder(model, draft, "spec", k=4)
    assert dec.generate(prompt, 60) == ref
    assert dec.stats.ar_rounds > 0 and dec.stats.spec_rounds > 0
    draft.close()


# --- shadow probes: unverified proposals compared with the AR tokens after them ----------

def shadow_probe(g, accepted, proposed=4):
    for a in accepted:
        g.shadow_round(a, proposed)


def test_a_shadow_probe_decides_a_calls_first_drafting():
    """A fresh call with a proposer that shadows starts with a probe (AR rounds timing the
    target meanwhile): an agreeing draft then drafts; a useless one backs off 16 AR
    tokens, then probes again, and a second failure backs off 64."""
    good = gv.CostGovernor(GovernorConfig(ar_first=2))
    good.enable_shadow()
    assert good.probing and not good.drafting and good.ar_rounds_due() > 1
    feed(good, [(0, 0, 1.0), (0, 0, 1.0)])
    shadow_probe(good, [4, 3, 4])
    assert good.drafting and not good.probing and good.resumes == 1 and good.shadow_probes == 1
    useless = gv.CostGovernor(GovernorConfig(ar_first=2))
    useless.enable_shadow()
    feed(useless, [(0, 0, 1.0), (0, 0, 1.0)])
    shadow_probe(useless, [0, 1, 0])
    assert not useless.drafting and useless.suspended and useless.ar_rounds_due() == 16
    feed(useless, [(0, 0, 1.0)] * 16)
    assert useless.probing and not useless.drafting          # the back-off ends in a probe
    shadow_probe(useless, [0, 0, 0])
    assert useless.ar_rounds_due() == 64 and useless.trips == 0    # nothing was verified
    assert useless.stats()["shadow_proposed"] == 24


def test_no_shadow_probe_where_it_is_turned_off():
    g = gv.CostGovernor(GovernorConfig(ar_first=2, shadow=False))
    g.enable_shadow()
    assert not g.probing and not g.shadow
    feed(g, [(0, 0, 1.0), (0, 0, 1.0)])
    assert g.drafting                            # it probes by drafting, as before


def test_a_shadow_probe_weighs_its_acceptance_against_the_measured_cost():
    """alpha 0.5 at K=4 emits 3 tokens a round: it pays at a cost of 2 AR tokens a
    round (1.5x) and not at 3 (1.0x, below 1 + enter_gain), whatever prior_cost says."""
    for cost, prior, drafts in ((2.0, 4.0, True), (3.0, 4.0, False), (3.0, 2.0, False)):
        g = gv.CostGovernor(GovernorConfig(prior_cost=prior), memory=gv.GovernorMemory(AR, cost=cost))
        g.shadow = True
        g._start_probe()
        shadow_probe(g, [2, 2, 2])
        assert g.drafting == drafts, (cost, prior)
    # without a measured cost, prior_cost stands in
    g = gv.CostGovernor(GovernorConfig(prior_cost=3.0), memory=gv.GovernorMemory(AR))
    g.shadow = True
    g._start_probe()
    shadow_probe(g, [2, 2, 2])
    assert not g.drafting


def test_a_high_cost_is_measured_again_after_failed_probes():
    """A measured cost of 3 keeps an alpha-0.5 draft out, but not for ever: after
    recheck_after failed probes in a row the prior (2.0) decides, so drafting rounds
    measure the cost again (a useless draft stays out: the prior does not help it)."""
    for accepted, enters in ((2, True), (0, False)):
        g = gv.CostGovernor(GovernorConfig(), memory=gv.GovernorMemory(AR, cost=3.0))
        g.shadow = True
        g._start_probe()
        verdicts = []
        for _ in range(4):
            shadow_probe(g, [accepted] * 3)
            verdicts.append(g.drafting)
            if g.drafting:
                break
            feed(g, [(0, 0, 1.0)] * g.ar_rounds_due())
        assert verdicts == ([False] * 3 + [True] if enters else [False] * 4), accepted


def test_entering_and_leaving_drafting_have_different_thresholds():
    """Hysteresis: at an expected 0.91x of AR (alpha 0.25, rounds costing 2.2 AR tokens)
    a drafting call keeps drafting (it leaves below 1 - margin = 0.8x) and a probe does
    not start drafting (it enters from 1 + enter_gain = 1.05x)."""
    cfg = GovernorConfig(first_rounds=1, prior_cost=3.0)
    drafting = gv.CostGovernor(cfg, memory=gv.GovernorMemory(AR))
    assert all(feed(drafting, [(1, 4, 2.2)] * 12)) and drafting.trips == 0
    probe = gv.CostGovernor(cfg, memory=gv.GovernorMemory(AR, cost=2.2))
    probe.shadow = True
    probe._start_probe()
    shadow_probe(probe, [1, 1, 1])
    assert not probe.drafting and probe.suspended


def test_a_failed_shadow_probe_is_remembered_with_the_cost():
    g = gv.CostGovernor(GovernorConfig(ar_first=1), memory=gv.GovernorMemory(AR, cost=2.5))
    g.shadow = True
    g._start_probe()
    shadow_probe(g, [0, 0, 0])
    m = g.memory()
    assert m.useless and m.backoff_left == 16 and m.cost == 2.5 and (m.accepted, m.proposed) == (0, 12)
    nxt = gv.CostGovernor(GovernorConfig(), memory=m)
    nxt.enable_shadow()
    assert nxt.suspended and not nxt.probing and nxt.ar_rounds_due() == 16
    # a call whose probe found the draft good leaves no verdict, only the times
    ok = gv.CostGovernor(GovernorConfig(), memory=gv.GovernorMemory(AR, cost=2.0))
    ok.enable_shadow()
    assert not ok.probing                    # not fresh: it drafts at once
    assert not ok.memory().useless and ok.memory().cost == 2.0
