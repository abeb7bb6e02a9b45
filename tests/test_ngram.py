"""n-gram (prompt-lookup) drafter: the incremental index agrees with a plain scan."""
import numpy as np
import pytest

import spel_mlx  # noqa: F401
from spel_mlx.decoding.ngram import NgramIndex, propose_ngram


def test_copies_continuation_of_latest_match():
    idx = NgramIndex(2, 4)
    idx.extend([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3])
    # suffix [1,2,3] last occurred at 5..7 followed by 5, 7, 1
    assert idx.lookup(3) == [5, 7, 1]
    assert idx.lookup(10) == [5, 7, 1, 2, 3]


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
    assert idx.lookup(2) == [5]


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
