import random

import pytest

from drafter_svc.ngram import NgramConfig, NgramProposer, propose_ngram


def reference(tokens, k, min_n, max_n):
    """Literal reading of the rule, O(n^2): longest n first, earliest start first."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_proposes_continuation_of_earlier_copy():
    tokens = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    assert propose_ngram(tokens, 3, 1, 3) == [8, 9, 1]


def test_prefers_longest_ngram_over_earliest_short_match():
    # "7" appears first at 0 (followed by 1), but "6 7" only at 3 (followed by 2)
    tokens = [7, 1, 0, 6, 7, 2, 3, 6, 7]
    assert propose_ngram(tokens, 2, 1, 2) == [2, 3]
    assert propose_ngram(tokens, 2, 1, 1) == [1, 0]


def test_takes_earliest_occurrence():
    tokens = [1, 2, 10, 1, 2, 20, 1, 2]
    assert propose_ngram(tokens, 1, 2, 2) == [10]
    assert propose_ngram(tokens, 1, 2, 2, pick="latest") == [20]  # benchmarks/ngram_replay.py


def test_fewer_tokens_when_context_ends_and_overlap_allowed():
    # suffix [3, 3] occurs at 0 and 1 (overlapping the suffix at 2)
    assert propose_ngram([3, 3, 3, 3], 5, 2, 2) == [3, 3]


def test_suffix_itself_is_not_a_match():
    assert propose_ngram([1, 2, 3], 3, 1, 3) == []


@pytest.mark.parametrize("tokens", [[], [4], [4, 4]])
def test_short_context(tokens):
    assert propose_ngram(tokens, 3, 3, 3) == []


def test_nothing_for_k_zero_or_bad_bounds():
    assert propose_ngram([1, 1, 1], 0, 1, 2) == []
    assert propose_ngram([1, 1, 1], 2, 3, 2) == []
    assert propose_ngram([1, 1, 1], 2, 0, 2) == []


def test_matches_reference_on_random_contexts():
    rng = random.Random(0)
    for _ in range(500):
        vocab = rng.randint(2, 6)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        k, min_n = rng.randint(1, 6), rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        assert propose_ngram(tokens, k, min_n, max_n) == reference(tokens, k, min_n, max_n)


def test_proposer_state_follows_committed_context():
    proposer = NgramProposer(NgramConfig(min_n=1, max_n=2))
    state = proposer.open([1, 2, 3])
    proposer.extend(state, [1, 2])
    proposal = proposer.propose(state, 4)
    assert proposal.ids == [3, 1, 2] and proposal.probs is None and proposal.parents is None


def test_speculative_tokens_extend_the_context_for_one_call_only():
    proposer = NgramProposer(NgramConfig(min_n=1, max_n=2))
    state = proposer.open([1, 2, 3, 4, 1, 2])
    assert proposer.propose(state, 2, None, [3]).ids == [4, 1]
    assert state == [1, 2, 3, 4, 1, 2]  # nothing kept
