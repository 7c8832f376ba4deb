"""The incremental n-gram proposer against a brute-force search of the whole sequence."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paxkv.host.ngram_proposer import NgramProposer


def _brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule read literally: longest suffix first, latest earlier occurrence, its
    followers copied one at a time from the sequence extended by what is copied."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n :]
        for i in range(length - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                extended = list(tokens)
                for j in range(k):
                    extended.append(extended[i + n + j])
                return extended[length:]
    return []


def test_hand_computed():
    #        0  1  2  3  4  5  6  7
    tokens = [1, 2, 3, 4, 9, 2, 3, 4]
    proposer = NgramProposer(1, 3, tokens)
    # suffix (2, 3, 4) occurred at 1..3, followed by 9, 2, 3
    assert proposer.propose(3) == [9, 2, 3]
    # past the sequence's end the proposal repeats its period (9, 2, 3, 4)
    assert proposer.propose(10) == [9, 2, 3, 4, 9, 2, 3, 4, 9, 2]
    assert proposer.propose(0) == []
    proposer.extend([7])
    assert proposer.propose(2) == []  # 7 never occurred before
    proposer.extend([1])
    assert proposer.propose(2) == [2, 3]  # (7, 1) did not occur; (1,) did, at 0


def test_latest_occurrence_and_longest_n_win():
    # (5,) occurs at 0 and 2; the latest (2) is followed by 8.
    assert NgramProposer(1, 1, [5, 6, 5, 8, 5]).propose(1) == [8]
    # n=2 suffix (4, 5) matches at 0 (-> 6) although n=1 (5,) matches later (-> 7).
    assert NgramProposer(1, 2, [4, 5, 6, 5, 7, 4, 5]).propose(1) == [6]
    assert NgramProposer(1, 1, [4, 5, 6, 5, 7, 4, 5]).propose(1) == [7]


def test_repeated_token_run_proposes_itself():
    assert NgramProposer(2, 2, [3, 3, 3]).propose(4) == [3, 3, 3, 3]
    assert NgramProposer(1, 2, [1, 2, 1, 2]).propose(5) == [1, 2, 1, 2, 1]


def test_bad_arguments():
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(0, 2)
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(3, 2)
    with pytest.raises(ValueError, match="k="):
        NgramProposer(1, 2, [1]).propose(-1)


@settings(max_examples=200, deadline=None)
@given(
    stream=st.lists(st.integers(0, 3), min_size=0, max_size=60),
    chunks=st.lists(st.integers(1, 7), min_size=1, max_size=20),
    min_n=st.integers(1, 3),
    extra_n=st.integers(0, 3),
    k=st.integers(0, 6),
)
def test_incremental_equals_brute_force(stream, chunks, min_n, extra_n, k):
    """Appending in random chunks, every proposal equals a fresh brute-force search."""
    max_n = min_n + extra_n
    prompt_len = chunks[0] % (len(stream) + 1)
    proposer = NgramProposer(min_n, max_n, stream[:prompt_len])
    seen = prompt_len
    steps = iter(chunks[1:] * 10)
    while True:
        assert len(proposer) == seen
        assert proposer.propose(k) == _brute_force(stream[:seen], min_n, max_n, k)
        if seen == len(stream):
            break
        step = next(steps, 1)
        proposer.extend(stream[seen : seen + step])
        seen = min(seen + step, len(stream))


def test_matches_happen_in_the_random_streams():
    """The hypothesis test's vocabulary is small enough that most proposals are non-empty."""
    stream = random.Random(0).choices(range(4), k=60)
    proposer = NgramProposer(2, 3)
    found = 0
    for token in stream:
        proposer.extend([token])
        found += bool(proposer.propose(2))
    assert found >= 40
