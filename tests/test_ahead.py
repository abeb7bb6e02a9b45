"""Drafting ahead or not (decoding.ahead): decisions from injected measurements, no timing."""
import pytest

import spel_mlx  # noqa: F401

from spel_mlx.decoding import SpeculativeDecoder, DecodeOptions, make_proposer, DraftOptions
from spel_mlx.decoding.ahead import AheadConfig, AheadPolicy, spare_core
from spel_mlx.decoding.governor import GovernorConfig

F = 0.0006      # a fresh proposal, seconds


def rounds(policy, n, hit_every=2, wait=0.0):
    """n rounds as the proposer reports them: ahead rounds hit every `hit_every`-th round
    and wait `wait` at the commit; plain rounds propose fresh and wait nothing."""
    seen = []
    for i in range(n):
        ahead = policy.ahead
        seen.append(ahead)
        hit = ahead and i % hit_every == 0
        policy.round(ahead, hit, None if hit else F, wait if ahead else 0.0)
    return seen


def test_quiet_machine_keeps_drafting_ahead():
    p = AheadPolicy()
    assert all(rounds(p, 200, hit_every=2, wait=0.02 * F))
    # no hits at all, but a hand-over-sized wait: never worth switching off for
    assert all(rounds(p, 100, hit_every=10**9, wait=0.2 * F)) and p.switches_off == 0


def test_busy_machine_switches_off_and_retries_with_backoff():
    cfg = AheadConfig(min_rounds=4, retry=32, retry_max=128)
    p = AheadPolicy(cfg)
    seen = rounds(p, 600, hit_every=2, wait=F)      # the wait is a whole proposal: W > h F
    runs = "".join("a" if s else "." for s in seen)
    # off for 32 rounds, then 64, 128 and 128 after each try that fails at once
    assert runs.startswith("aaaa" + "." * 32 + "aaaa" + "." * 64 + "aaaa" + "." * 128 + "aaaa" + "." * 128)
    assert p.switches_off >= 4
    # the machine gets quiet: the next try keeps it
    rest = rounds(p, 300, hit_every=2, wait=0.0)
    assert all(rest[-100:])


def test_hits_that_save_more_than_the_wait_keep_it():
    p = AheadPolicy(AheadConfig(margin=0.1))
    # hits every round but one in 10, waits of half a proposal: saves 0.9 F, costs 0.5 F
    seen = rounds(p, 200, hit_every=1, wait=0.5 * F)
    assert all(seen)
    q = AheadPolicy(AheadConfig(margin=0.1))
    # one hit in four, the same waits: saves 0.25 F, costs 0.5 F
    assert not all(rounds(q, 50, hit_every=4, wait=0.5 * F))


def test_starts_plain_when_the_machine_looks_busy():
    p = AheadPolicy(AheadConfig(first_retry=8), start_ahead=False)
    seen = rounds(p, 20, hit_every=2, wait=0.0)
    assert seen[:8] == [False] * 8 and all(seen[8:])


@pytest.mark.parametrize("cpus,load,spare", [(1, 0.0, False), (2, 0.9, True), (2, 1.6, False),
                                             (16, 3.0, True), (4, 3.6, False)])
def test_spare_core(cpus, load, spare):
    assert spare_core(cpus=cpus, load=load) is spare


def test_policy_off_drafts_plainly_with_the_same_output(shipped_c_run):
    """The ahead proposer under a policy that never drafts ahead: no continuation, the
    output still the ar output, then drafting ahead again once it is tried."""
    ck, model, prompt, ref = shipped_c_run
    draft = make_proposer("c", model, ck.weights, k=4, options=DraftOptions(threads=1, ahead="auto"))
    draft.policy = AheadPolicy(AheadConfig(first_retry=10**9), start_ahead=False)
    dec = SpeculativeDecoder(model, draft, "spec", k=4, options=DecodeOptions(governor=GovernorConfig(policy="off")))
    assert dec.generate(prompt, 60) == ref
    assert dec.stats.extra["ahead_hits"] == 0
    # tried after 3 plain rounds and then kept (min_rounds: no timed switch-off, which
    # a loaded machine could make before the first hit)
    draft.policy = AheadPolicy(AheadConfig(first_retry=3, min_rounds=10**9), start_ahead=False)
    assert dec.generate(prompt, 60) == ref
    assert dec.stats.extra["ahead_hits"] > 0
    draft.close()
