"""Greedy rounds of several sessions sharing MLX forwards (`MlxForward.forward_many`, the GPU's
path): each session commits what it commits alone, with the same rows and caches."""

from __future__ import annotations

import pytest

from specd.models.load import load_target
from tests.sessions import (
    PROMPTS,
    assert_plain_draws_share_and_equal_each_alone,
    assert_same_rounds,
    assert_sampled_rounds_share_and_equal_each_alone,
    assert_tree_rounds_share_and_equal_each_alone,
    joined_copies,
    loaded_verifier,
    recorded,
    round_plans,
    run_alone,
    sessions_of,
)
from verifier_svc.engine import Round, Target, decode, prefill, rounds_many, verify
from verifier_svc.servicer import RoundAsked


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    """An all-MLX target (no CPU kernels) with the GPU's row-by-row products."""
    made = Target(load_target(str(tiny_model_dir), dtype="float32"), gemv_rows=0,
                  row_forwards=True)  # fmt: skip
    assert made.cpu_layers is None and made.row_forwards and made.shares_forwards
    return made


def test_a_sampled_prompt_on_a_half_precision_target_draws_from_its_logits(tiny_model_dir):
    """Its bfloat16 logits reach the draw as float32 (numpy reads no bfloat16 buffer)."""
    from verifier_svc.sampling import SamplingConfig

    half = Target(load_target(str(tiny_model_dir), dtype="bfloat16"), gemv_rows=0)
    near_greedy = SamplingConfig(temperature=1e-3)
    drawn = prefill(half, PROMPTS[0], sampling=near_greedy, seed=4)
    assert drawn.first_token == prefill(half, PROMPTS[0]).first_token


def test_without_row_by_row_products_sessions_run_one_after_the_other(tiny_model_dir):
    """A product over several sessions' rows could round unlike their decode steps."""
    own = Target(load_target(str(tiny_model_dir), dtype="float32"), gemv_rows=0)
    assert not own.shares_forwards
    sessions = [prefill(own, p).session for p in PROMPTS[:2]]
    assert own.shared_forward([Round(s, [], 2) for s in sessions]) is None


_sessions = sessions_of


def test_rounds_sharing_mlx_forwards_equal_each_alone(target, monkeypatch):
    plans = round_plans(target)  # 16 rows, one forward
    alone = run_alone(target, _sessions(target), plans)
    calls = recorded(monkeypatch, target, "forward_many")
    sessions = _sessions(target)
    together = rounds_many(
        target, [Round(s, d, k) for s, (d, k) in zip(sessions, plans, strict=True)]
    )
    assert calls and len(calls[0]) == len(plans)  # the first step: every session in one forward
    assert together[3].num_accepted == 3 and together[4].num_accepted == 0
    assert_same_rounds(alone, together)
    assert all(b.share < 1.0 for b in together)
    for session in sessions:
        assert session.cache[0].offset == session.position - 1
    # the caches hold what decoding alone leaves: the next steps agree too
    again = rounds_many(target, [Round(s, [], 3) for s in sessions])
    after_alone = [decode(target, s, 3).committed for s in _sessions_after(target, plans)]
    assert [r.committed for r in again] == after_alone


def _sessions_after(target: Target, plans):
    sessions = _sessions(target)
    for s, (d, k) in zip(sessions, plans, strict=True):
        verify(target, s, d) if d else decode(target, s, k)
    return sessions


def test_a_session_with_a_queued_look_ahead_joins_and_a_lone_round_keeps_it(target):
    first, second = _sessions(target)[:2]
    decode(target, first, 2, look_ahead=True)
    assert first.ahead is not None
    same = _sessions(target)[0]
    decode(target, same, 2)
    want = decode(target, same, 3).committed
    results = rounds_many(target, [Round(first, [], 3), Round(second, [], 3)])
    assert results[0].committed == want and first.ahead is None
    lone = rounds_many(target, [Round(second, [], 2, look_ahead=True)])
    assert len(lone[0].committed) == 2 and second.ahead is not None


def test_rounds_past_a_forwards_rows_join_as_rows_free_up(target, monkeypatch):
    from specd.models import rowwise

    monkeypatch.setattr(rowwise, "DEFAULT_MAX_ROWS", 4)
    sessions = _sessions(target)
    alone = [decode(target, s, 2).committed for s in _sessions(target)]
    calls = recorded(monkeypatch, target, "forward_many")
    rounds = [Round(s, [], 2) for s in sessions]
    rounds[1].drafts, rounds[1].steps = [7, 8], 1  # three rows of a forward
    results = rounds_many(target, rounds)
    assert [r.committed for n, r in enumerate(results) if n != 1] == alone[:1] + alone[2:]
    # the plain round and the verify; the verify done, the other three join the plain round's
    # second step; then their second steps
    assert calls == [[1, 3], [1, 1, 1, 1], [1, 1, 1]]


def test_a_failing_forward_fails_only_the_session_that_fails_alone(target, monkeypatch):
    from specd.models import rowwise

    monkeypatch.setattr(rowwise, "DEFAULT_MAX_ROWS", 2)
    sessions = _sessions(target)[:4]
    before = [(s.position, s.cache[0].offset) for s in sessions]
    real = type(target._mlx).forward_many

    def failing(self, segments, capture, *rest):
        if any(seg.cache is sessions[2].cache for seg in segments):
            raise RuntimeError("device out of memory")
        return real(self, segments, capture, *rest)

    monkeypatch.setattr(type(target._mlx), "forward_many", failing)
    # forwards of 2 and 2; the failed one's two rounds tried again one a step
    results = rounds_many(target, [Round(s, [], 1) for s in sessions])
    assert isinstance(results[2], RuntimeError)
    assert [len(results[i].committed) for i in (0, 1, 3)] == [1, 1, 1]
    assert (sessions[2].position, sessions[2].cache[0].offset) == before[2]
    assert [sessions[i].position for i in (0, 1, 3)] == [before[i][0] + 1 for i in (0, 1, 3)]


def test_a_second_call_for_one_session_in_a_batch_runs_after_the_first(tiny_model_dir):
    """A retried call waiting beside the original is checked once the original has run: it
    finds the session moved on, as it would one call at a time."""
    from specd.service import FailedPrecondition

    verifier = loaded_verifier(tiny_model_dir)
    target = verifier._ready()
    assert target.shares_forwards
    first, other = (prefill(target, p).session for p in PROMPTS[:2])
    want = decode(target, prefill(target, PROMPTS[0]).session, 3).committed
    items = [
        RoundAsked(first, first.position, [], 3),
        RoundAsked(other, other.position, [], 3),
        RoundAsked(first, first.position, [], 3),
    ]
    answers = verifier._rounds_many(items)
    assert answers[0].committed == want
    assert isinstance(answers[2], FailedPrecondition) and "position" in str(answers[2])
    assert first.position == 1 + len(PROMPTS[0]) + len(want)


@pytest.mark.parametrize("join", [False, True])
def test_sampled_rows_reach_the_host_as_each_sessions_float32_logits(join):
    import mlx.core as mx
    import numpy as np

    from verifier_svc.engine import _drawn_rows

    rng = np.random.default_rng(0)
    device = mx.array(rng.standard_normal((3, 50)).astype(np.float32))
    host = rng.standard_normal((2, 50)).astype(np.float32)  # the CPU kernels' logits
    prompt = mx.array(rng.standard_normal((4, 50)), dtype=mx.bfloat16)
    pending, to_host = _drawn_rows([device, host, prompt], [False, False, True], join=join)
    assert len(pending) == (1 if join else 2)  # joined: the step's rows in one copy
    mx.eval(pending)
    rows = to_host()
    assert rows[0].dtype == rows[2].dtype == np.float32
    assert np.array_equal(rows[0], np.array(device))
    assert rows[1] is host
    assert np.array_equal(rows[2], np.array(prompt[-1:].astype(mx.float32)))  # its last row
    assert _drawn_rows([], [], join=join)[0] == [] and _drawn_rows([], [], join=join)[1]() == []


@pytest.mark.parametrize("join", [False, True])
def test_sampled_rounds_share_mlx_forwards_and_equal_each_alone(target, monkeypatch, join):
    joined_copies(monkeypatch, join)
    calls = recorded(monkeypatch, target, "forward_many")
    assert_sampled_rounds_share_and_equal_each_alone(target, calls)


def test_tree_rounds_share_mlx_forwards_and_equal_each_alone(target, monkeypatch):
    calls = recorded(monkeypatch, target, "forward_many")
    assert_tree_rounds_share_and_equal_each_alone(target, calls)


def test_a_tree_the_target_cannot_verify_is_refused_in_a_batch(tiny_model_dir, monkeypatch):
    """On the CPU kernels trees go to the batched rounds; one the target cannot verify runs
    alone there and is answered FAILED_PRECONDITION, its session as it was, while the other
    session's round goes on."""
    from specd.service import FailedPrecondition

    verifier = loaded_verifier(tiny_model_dir, gemv_rows=None)  # the CPU kernels
    target = verifier._ready()
    assert target.shares_forwards
    monkeypatch.setattr(type(target), "supports_trees", lambda self, cache: False)
    tree, other = (prefill(target, p).session for p in PROMPTS[:2])
    position = tree.position
    answers = verifier._rounds_many(
        [RoundAsked(tree, position, [5, 6], 1, parents=[-1, -1]),
         RoundAsked(other, other.position, [], 2)]
    )  # fmt: skip
    assert isinstance(answers[0], FailedPrecondition)
    assert "draft chains instead" in str(answers[0])
    assert len(answers[1].committed) == 2
    assert tree.position == position and tree.cache[0].offset == position - 1


@pytest.mark.parametrize("fail_once", [False, True])
def test_plain_draws_share_the_forwards_and_equal_each_alone(target, monkeypatch, fail_once):
    assert_plain_draws_share_and_equal_each_alone(target, monkeypatch, fail_once)
