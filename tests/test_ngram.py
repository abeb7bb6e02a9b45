"""n-gram (prompt-lookup) drafter: the incremental index agrees with a plain scan; the
proposal length grows and shrinks by its rule."""
import numpy as np
import pytest

import spel_mlx  # noqa: F401
from spel_mlx.decoding.ngram import NgramIndex, NgramProposer, propose_ngram
from spel_mlx.decoding.sampling import GREEDY


def test_copies_continuation_of_latest_match():
    idx = NgramIndex(2, 4)
    idx.extend([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3])
    # suffix [1,2,3] last occurred at 5..7 followed by 5, 7, 1
    assert idx.lookup(3) == [5, 7, 1]
    # the match is 5 tokens back: past them the text goes on with period 5
    assert idx.lookup(10) == [5, 7, 1, 2, 3, 5, 7, 1, 2, 3]


def test_longest_suffix_wins():
    idx = NgramIndex(1, 3)
    # [8, 2] only matches at the start (-> 6); the 1-gram [2] matches later (-> 4)
    idx.extend([8, 2, 6, 2, 4, 8, 2])
    assert idx.lookup(1) == [6]


def test_no_match_and_never_self_match():
    idx = NgramIndex(2, 4)
    idx.extend([1, 2, 3, 4])
    assert idx.lookup(4) == []
    idx = NgramIndex(2, 2)
    idx.extend([5, 5])
    assert idx.lookup(2) == []    # the suffix itself is not an earlier occurrence
    idx.append(5)
    assert idx.lookup(2) == [5, 5]     # [5, 5] one back: period 1


@pytest.mark.parametrize("seed", range(6))
def test_incremental_index_equals_scan(seed):
    rng = np.random.default_rng(seed)
    V = 3 + seed  # small vocabularies repeat a lot
    toks = rng.integers(0, V, size=300).tolist()
    idx = NgramIndex(2, 4)
    for i, t in enumerate(toks):
        idx.append(t)
        for k in (1, 4):
            assert idx.lookup(k) == propose_ngram(toks[:i + 1], k, 2, 4), (i, k)


def test_bad_sizes():
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


def _rounds(proposer, text, start, rounds, k_cap=15):
    """Run `rounds` verify rounds of `proposer` against the true continuation `text`
    (greedy: the target's token is text's own); returns each round's proposal length."""
    lengths, L = [], start
    for _ in range(rounds):
        history, pending = text[:L], text[L]
        toks, _ = proposer.propose(history, pending, k_cap, GREEDY, 0)
        n = 0
        while n < len(toks) and toks[n] == text[L + 1 + n]:
            n += 1
        if toks:
            proposer.commit(n + 1)
        lengths.append(len(toks))
        L += n + 1
    return lengths


def test_ngram_length_grows_while_accepted_and_shrinks_on_rejection():
    text = [10, 11, 12, 13, 14, 15, 16] * 40
    p = NgramProposer(20, k=4, max_k=15)
    # every proposal of a cycle is right: K, then 2 more a round, up to max_k (a period
    # of 7 continued past the copy)
    assert _rounds(p, text, 16, 8) == [4, 6, 8, 10, 12, 14, 15, 15]
    # rejections: one shorter a round, never below K
    lengths = []
    for _ in range(14):
        lengths.append(len(p.propose(text[:100], text[100], 15, GREEDY, 0)[0]))
        p.commit(1)           # nothing accepted
    assert lengths == [15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 4, 4]
    # a round with a partial acceptance shrinks it too; one with every token grows it
    p.propose(text[:100], text[100], 15, GREEDY, 0)
    p.commit(3)
    assert p.length == 4
    p.propose(text[:100], text[100], 15, GREEDY, 0)
    p.commit(5)
    assert p.length == 6
    # the loop's cap wins (the end of a request): 3 asked, 3 proposed, all accepted
    assert len(p.propose(text[:100], text[100], 3, GREEDY, 0)[0]) == 3
    p.commit(4)
    assert p.length == 8
    # a round without a match proposes nothing (the loop then commits nothing to it)
    # and keeps the length
    text2 = [10, 11, 12, 13, 14, 15, 16] * 4 + list(range(30, 60))
    p.reset()
    assert _rounds(p, text2, 16, 1) == [4] and p.length == 6
    assert p.propose(text2[:45], text2[45], 15, GREEDY, 0)[0] == []
    assert p.length == 6


def test_ngram_fixed_length_control():
    text = [10, 11, 12, 13, 14, 15, 16] * 40
    for p in (NgramProposer(20, k=4, max_k=None), NgramProposer(20, k=4, max_k=4), NgramProposer(20, k=16)):
        assert p.max_k is None
        assert set(_rounds(p, text, 16, 6, k_cap=p.k)) == {p.k}


def test_ngram_bad_lengths():
    for kw in ({"k": 0}, {"k": 2.5}, {"max_k": 0}, {"max_k": "8"}):
        with pytest.raises(ValueError):
            NgramProposer(20, **kw)


@pytest.mark.parametrize("seed", range(6))
def test_lookup_after_equals_appending_and_leaves_the_index(seed):
    rng = np.random.default_rng(seed)
    toks = [int(t) for t in rng.integers(0, 5, 60)]
    ext = [int(t) for t in rng.integers(0, 5, 7)]
    idx, ref = NgramIndex(2, 4), NgramIndex(2, 4)
    idx.extend(toks)
    ref.extend(toks + ext)
    before = (list(idx.tokens), dict(idx._last))
    for k in (1, 4, 9):
        assert idx.lookup_after(ext, k) == ref.lookup(k)
    assert (idx.tokens, idx._last) == before


@pytest.mark.parametrize("seed", range(8))
def test_peek_predicts_the_next_proposal_after_a_full_acceptance(seed):
    """What `peek` returns is what the next round proposes when this round accepts its
    whole proposal and the target's token after it is the guess."""
    rng = np.random.default_rng(seed)
    page = [int(t) for t in rng.integers(0, 6, 9)]
    history = (page * 6)[:40 + seed]
    pending = history.pop()
    p = NgramProposer(6, k=4, max_k=15)
    prop, _ = p.propose(history, pending, 15, GREEDY, 0)
    checked = 0
    while prop and checked < 10:
        nxt = p.peek(prop, 15, 0.0)
        guess = p.index.lookup(len(prop) + 1)[len(prop)]
        p.commit(len(prop) + 1)                       # all accepted, and the guess was right
        history += [pending] + prop
        pending = guess
        prop, _ = p.propose(history, pending, 15, GREEDY, 0)
        assert nxt == ((guess, prop) if prop else None)
        checked += 1
    assert checked >= 3
