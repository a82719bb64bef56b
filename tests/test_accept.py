import pytest

from verifier_svc.accept import accept_greedy

EOS = {2}


def test_all_accepted_adds_bonus():
    a = accept_greedy([5, 6, 7], [5, 6, 7, 8], EOS)
    assert (a.committed, a.num_accepted, a.finished) == ([5, 6, 7, 8], 3, False)


def test_first_mismatch_adds_recovered_token():
    a = accept_greedy([5, 9, 7], [5, 6, 7, 8], EOS)
    assert (a.committed, a.num_accepted, a.finished) == ([5, 6], 1, False)


def test_no_drafts_is_a_decode_step():
    a = accept_greedy([], [4], EOS)
    assert (a.committed, a.num_accepted) == ([4], 0)


def test_eos_inside_accepted_prefix_ends_there():
    a = accept_greedy([5, 2, 7], [5, 2, 7, 8], EOS)
    assert (a.committed, a.num_accepted, a.finished) == ([5, 2], 2, True)


def test_eos_as_recovered_token():
    a = accept_greedy([5, 9], [5, 2, 3], EOS)
    assert (a.committed, a.num_accepted, a.finished) == ([5, 2], 1, True)


def test_wrong_target_length_is_refused():
    with pytest.raises(ValueError):
        accept_greedy([1, 2], [1, 2], EOS)
