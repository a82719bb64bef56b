"""Sessions whose KV caches live in one pool (`verifier_svc.kv_pool`): alone they compute what
per-session caches compute, and the rounds of many run as one batched forward that
commits what each commits alone."""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest

from specd.models.load import device_kind, load_target
from tests.sessions import (
    CAPTURES,
    PROMPTS,
    RpcContext,
    assert_plain_draws_share_and_equal_each_alone,
    assert_same_rounds,
    assert_sampled_rounds_share_and_equal_each_alone,
    assert_tree_rounds_share_and_equal_each_alone,
    close,
    joined_copies,
    loaded_verifier,
    recorded,
    round_plans,
    run_alone,
    sessions_of,
)
from verifier_svc.engine import Round, Target, decode, prefill, rounds_many, verify, verify_tree
from verifier_svc.kv_pool import CAPACITY_STEP, KVPool, PooledCache


def _target(model_dir, pooled: bool) -> Target:
    return Target(load_target(str(model_dir), dtype="float32"), gemv_rows=0, row_forwards=True,
                  kv_pool=pooled)  # fmt: skip


@pytest.fixture(scope="module")
def pooled(tiny_model_dir):
    made = _target(tiny_model_dir, True)
    assert made.kv_pool is not None and made.cpu_layers is None
    return made


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    made = _target(tiny_model_dir, False)
    assert made.kv_pool is None
    return made


_sessions = sessions_of


def test_a_pooled_session_alone_computes_what_its_own_cache_does(pooled, plain):
    for p, c in zip(PROMPTS, CAPTURES, strict=True):
        a, b = prefill(plain, p, c), prefill(pooled, p, c)
        assert isinstance(b.session.cache[0], PooledCache)
        assert a.session.last_token == b.session.last_token
        if a.rows is not None:
            close(b.rows, a.rows)
        steps_a, steps_b = decode(plain, a.session, 5), decode(pooled, b.session, 5)
        assert steps_a.committed == steps_b.committed
        drafts = [3, 1, 4, 1, 5]
        va, vb = verify(plain, a.session, drafts), verify(pooled, b.session, drafts)
        assert (va.committed, va.num_accepted) == (vb.committed, vb.num_accepted)
        assert b.session.cache[0].offset == a.session.cache[0].offset == a.session.position - 1
        assert decode(plain, a.session, 3).committed == decode(pooled, b.session, 3).committed


def test_a_draft_tree_on_a_pooled_session_keeps_the_same_path(pooled, plain):
    parents = [-1, 0, 0, 1, 2, 3]
    out = []
    for target in (plain, pooled):
        session = prefill(target, PROMPTS[2], (1,)).session
        greedy = decode(target, prefill(target, PROMPTS[2]).session, 3).committed
        drafts = [greedy[0], greedy[0] + 1, greedy[1], 9, greedy[2], 11]
        result = verify_tree(target, session, drafts, parents)
        out.append((result.committed, result.num_accepted, decode(target, session, 3).committed))
    assert out[0] == out[1] and out[0][1] >= 2


def test_pooled_rounds_run_as_one_forward_and_commit_what_each_does_alone(
    pooled, plain, monkeypatch
):
    plans = round_plans(plain)
    alone = run_alone(plain, _sessions(plain), plans)
    calls = recorded(monkeypatch, pooled, "forward_pooled")
    sessions = _sessions(pooled)
    together = rounds_many(
        pooled, [Round(s, d, k) for s, (d, k) in zip(sessions, plans, strict=True)]
    )
    assert calls[0] == [1, 1, 7, 4, 3]  # every session's first step in one forward
    assert calls[1:] == [[1]] * 3  # then the one plain round still going
    assert together[3].num_accepted == 3 and together[4].num_accepted == 0
    assert_same_rounds(alone, together)
    for session in sessions:
        assert session.cache[0].offset == session.position - 1
    again = rounds_many(pooled, [Round(s, [], 3) for s in sessions])
    reference = _sessions(plain)
    run_alone(plain, reference, plans)
    assert [r.committed for r in again] == [decode(plain, s, 3).committed for s in reference]


def test_a_pooled_steps_greedy_choices_are_taken_over_every_row_at_once(pooled, plain, monkeypatch):
    """One argmax a step however many sessions share it (not one per session), choosing what
    each session chooses alone."""
    from verifier_svc import engine

    plans = round_plans(plain)
    alone = run_alone(plain, _sessions(plain), plans)
    sessions = _sessions(pooled)
    passes = []
    real = engine._greedy_next

    def counted(logits):
        passes.append(logits.shape[0])
        return real(logits)

    monkeypatch.setattr(engine, "_greedy_next", counted)
    steps = recorded(monkeypatch, pooled, "forward_pooled")
    together = rounds_many(
        pooled, [Round(s, d, k) for s, (d, k) in zip(sessions, plans, strict=True)]
    )
    assert steps == [[1, 1, 7, 4, 3]] + [[1]] * 3
    assert passes == [16, 1, 1, 1]
    assert_same_rounds(alone, together)


def test_the_pool_grows_past_its_capacity_and_its_slots(pooled, plain):
    long_prompt = [5 + j % 80 for j in range(CAPACITY_STEP - 3)]
    prompts = [long_prompt, *PROMPTS]  # six sessions: more than the first four slots
    mine = [prefill(pooled, p).session for p in prompts]
    theirs = [prefill(plain, p).session for p in prompts]
    assert pooled.kv_pool.slots >= 6
    got = rounds_many(pooled, [Round(s, [], 6) for s in mine])  # the long one crosses 256
    assert pooled.kv_pool.capacity == 2 * CAPACITY_STEP
    assert [r.committed for r in got] == [decode(plain, s, 6).committed for s in theirs]


def test_closed_sessions_free_their_slots_and_the_last_frees_the_memory(tiny_model_dir):
    target = _target(tiny_model_dir, True)
    pool = target.kv_pool
    sessions = _sessions(target)
    assert pool.open_slots == 5 and pool.nbytes > 0
    slots = sorted(s.cache[0].slot for s in sessions)
    assert slots == list(range(5))
    held = sessions[1].cache[0].slot
    del sessions[1]
    gc.collect()
    assert pool.open_slots == 4
    again = prefill(target, PROMPTS[0]).session
    assert again.cache[0].slot == held  # the lowest free slot: the used ones stay packed
    del sessions, again
    gc.collect()
    assert pool.open_slots == 0 and pool.nbytes == 0


def test_a_failed_pooled_forward_leaves_every_session_as_it_was(pooled, monkeypatch):
    sessions = _sessions(pooled)[:3]
    before = [(s.position, s.cache[0].offset) for s in sessions]
    want = [decode(pooled, s, 2).committed for s in _sessions(pooled)[:3]]

    def failing(self, segments, capture, *rest):
        raise RuntimeError("device out of memory")

    with monkeypatch.context() as patch:
        patch.setattr(type(pooled._mlx), "forward_pooled", failing)
        results = rounds_many(pooled, [Round(s, [], 2) for s in sessions])
    # tried again with fewer a step, then each fails alone
    assert all(isinstance(r, RuntimeError) for r in results)
    assert [(s.position, s.cache[0].offset) for s in sessions] == before
    assert [r.committed for r in rounds_many(pooled, [Round(s, [], 2) for s in sessions])] == want


def test_the_verifier_option_pools_and_reports_the_pool_as_its_kv(tiny_model_dir):

    verifier = loaded_verifier(tiny_model_dir, kv_pool="on")
    target = verifier._ready()
    assert isinstance(target.kv_pool, KVPool)
    session = prefill(target, PROMPTS[1]).session
    assert isinstance(session.cache[0], PooledCache)
    assert verifier.kv_bytes() == target.kv_pool.nbytes > 0


async def _pooled_servicer(model_dir, **options):
    """A loaded verifier servicer on the KV pool (MLX forwards row by row, `options` added), its
    MLX worker thread without inline rounds (as on a GPU); returns (servicer, thread)."""
    from specd.service import MlxThread
    from verifier_svc.config import VerifierConfig
    from verifier_svc.servicer import VerifierServicer

    mlx = MlxThread(inline_rounds=False)
    config = VerifierConfig(model=str(model_dir), warmup="minimal", gemv_rows=0,
                            row_forwards="on", kv_pool="on", **options)  # fmt: skip
    verifier = VerifierServicer(config, mlx)
    await verifier.load()
    return verifier, mlx


def test_the_verifier_frees_the_pool_once_its_last_session_closes(tiny_model_dir):
    """Sessions opened and stepped through the servicer's RPCs, on its MLX worker, then all
    closed: no reference to the last job's session is left behind (the worker waiting for
    its next job held one), so the pool's memory goes as it does for the engine alone."""
    import asyncio

    from specd.v1 import common_pb2, verifier_pb2

    async def main():
        verifier, mlx = await _pooled_servicer(tiny_model_dir)
        opened = await asyncio.gather(*(
            verifier.OpenSession(verifier_pb2.OpenSessionRequest(prompt_ids=p), RpcContext())
            for p in PROMPTS[:3]
        ))  # fmt: skip
        await asyncio.gather(*(
            verifier.Verify(verifier_pb2.VerifyRequest(session_id=o.session_id,
                                                       position=o.position, plain_steps=2),
                            RpcContext())
            for o in opened
        ))  # fmt: skip
        in_use = verifier.kv_bytes()
        for o in opened:
            request = common_pb2.CloseSessionRequest(session_id=o.session_id)
            await verifier.CloseSession(request, RpcContext())
        for _ in range(250):  # until the worker, its last job settled, is back at its queue
            gc.collect()
            if verifier.kv_bytes() == 0:
                break
            await asyncio.sleep(0.02)
        left = verifier.kv_bytes(), verifier.target.kv_pool.open_slots
        mlx.shutdown()
        return in_use, left

    in_use, left = asyncio.run(main())
    assert in_use > 0 and left == (0, 0)


def test_a_prompt_prefilled_a_layer_at_a_time_into_the_pool_is_the_same(pooled, plain):
    from verifier_svc.engine import advance, prefill_steps

    prompt = [5 + j % 70 for j in range(40)]
    whole = prefill(plain, prompt, (0, 1))
    steps, sliced, layers = prefill_steps(pooled, prompt, (0, 1), sliced=True), None, 0
    while sliced is None:
        sliced, layers = advance(steps), layers + 1
    assert layers > 2  # a layer per step
    assert sliced.session.last_token == whole.session.last_token
    close(sliced.rows, whole.rows)
    assert decode(pooled, sliced.session, 4).committed == decode(plain, whole.session, 4).committed


@pytest.mark.parametrize("pool_alone", [True, False])
def test_the_full_warm_up_prefills_and_steps_pooled_sessions_together(
    tiny_model_dir, pool_alone, monkeypatch
):
    from verifier_svc import engine
    from verifier_svc.warmup import full_warmup

    target = Target(load_target(str(tiny_model_dir), dtype="float32"), gemv_rows=0,
                    row_forwards=True, kv_pool=True, pool_alone=pool_alone)  # fmt: skip
    calls = recorded(monkeypatch, target, "forward_pooled")
    monkeypatch.setattr(engine, "_on_gpu", lambda: True)  # its draws as a GPU makes them
    draws, draw = [], engine.draw
    monkeypatch.setattr(engine, "draw", lambda rows, *a: draws.append(len(rows)) or draw(rows, *a))
    full_warmup(target, 3, long_context=80)
    # the two prompts' heads, their last tokens, two plain steps (the first beside a verify
    # of 4), then a plain step, a sampled verify of 3 and a tree of 4 in one batch, then a
    # plain step beside a sampled one drawn on the device
    assert calls[:6] == [[63, 39], [1, 1], [1, 4], [1], [1, 3, 4], [1, 1]]
    assert draws  # its kernels compiled here, not at a client's first sampled request
    gc.collect()
    assert target.kv_pool.open_slots == 0  # the warm-up's sessions gave their slots back


@pytest.mark.parametrize("join", [False, True])
def test_prompts_prefilled_together_open_the_sessions_each_prefill_opens(
    pooled, plain, monkeypatch, join
):
    from verifier_svc.engine import PromptToPrefill, prefill_many
    from verifier_svc.sampling import SamplingConfig

    joined_copies(monkeypatch, join)
    sampled = SamplingConfig(temperature=0.8)
    asks = [PromptToPrefill(p, c) for p, c in zip(PROMPTS, CAPTURES, strict=True)]
    asks += [PromptToPrefill([42], (0,)), PromptToPrefill(PROMPTS[2], (), sampling=sampled, seed=3)]
    asks.append(PromptToPrefill(PROMPTS[0], (), sampling=SamplingConfig(temperature=1.3), seed=5))
    calls = recorded(monkeypatch, pooled, "forward_pooled")
    together = prefill_many(pooled, asks)
    assert len(calls) == 2 and len(calls[1]) == len(asks)  # the prompts' heads, then their lasts
    for ask, got in zip(asks, together, strict=True):
        _assert_opened_as_alone(pooled, plain, ask, got)


def _assert_opened_as_alone(pooled, plain, ask, got) -> None:
    """A prompt prefilled beside others opens what `prefill` opens alone: its first token,
    position, cache and rows, and the tokens after (greedy) or its generator (sampled)."""
    alone = prefill(plain, ask.prompt_ids, ask.capture, ask.rows_dtype, ask.sampling, ask.seed)
    assert got.first_token == alone.first_token
    assert got.session.position == alone.session.position
    assert got.session.cache[0].offset == len(ask.prompt_ids)
    assert (got.rows is None) == (alone.rows is None)
    if alone.rows is not None:
        # MLX's CUDA products of a batch of prompts and of one prompt sum in other orders
        # (on an H200 up to 0.031 at rows near 22); the CPU's agree within 1e-3
        close(got.rows, alone.rows, rtol=1e-3 if device_kind() == "cpu" else 5e-3)
    if ask.sampling.greedy:
        assert decode(pooled, got.session, 4).committed == decode(plain, alone.session, 4).committed
    else:  # its generator goes on as the one `prefill` seeded
        assert got.session.rng.random() == alone.session.rng.random()


def test_prompts_prefilled_together_with_no_session_open_are_all_pooled(tiny_model_dir, plain):
    """With pool_alone off, prompts of one batched prefill are company for each other: none
    keeps a cache of its own, since their forward is the pool's shared one."""
    from verifier_svc.engine import PromptToPrefill, prefill_many

    target = Target(load_target(str(tiny_model_dir), dtype="float32"), gemv_rows=0,
                    row_forwards=True, kv_pool=True, pool_alone=False)  # fmt: skip
    assert target.open_sessions == 0
    together = prefill_many(target, [PromptToPrefill(p) for p in PROMPTS])
    assert all(isinstance(r.session.cache[0], PooledCache) for r in together)
    assert [r.first_token for r in together] == [prefill(plain, p).first_token for p in PROMPTS]
    assert target.open_sessions == len(PROMPTS)


def test_sessions_opened_at_once_are_prefilled_in_shared_forwards(
    tiny_model_dir, plain, monkeypatch
):
    import asyncio
    import threading

    from specd.v1 import verifier_pb2
    from verifier_svc import engine

    groups: list[int] = []
    real = engine._prefill_group

    def recording(target, prompts, group, answers):
        groups.append(len(group))
        return real(target, prompts, group, answers)

    async def main():
        verifier, mlx = await _pooled_servicer(tiny_model_dir)
        gate = threading.Event()
        mlx.submit(gate.wait)  # the worker busy while the calls queue up
        calls = [
            verifier.OpenSession(verifier_pb2.OpenSessionRequest(prompt_ids=p), RpcContext())
            for p in PROMPTS
        ]
        tasks = [asyncio.ensure_future(c) for c in calls]
        await asyncio.sleep(0.3)
        gate.set()
        opened = await asyncio.gather(*tasks)
        mlx.shutdown()
        return opened

    monkeypatch.setattr(engine, "_prefill_group", recording)
    opened = asyncio.run(main())
    assert groups == [len(PROMPTS)]
    assert [o.first_token for o in opened] == [prefill(plain, p).first_token for p in PROMPTS]


def test_a_sessions_own_writes_touch_its_slot_alone_and_no_scatter_runs():
    """A session stepping alone writes its rows as a slice of its slot (no index, no scatter):
    the other slots' rows stay as they were, its own read back as written."""
    pool = KVPool(1)
    first, second = pool.open()[0], pool.open()[0]
    rows = [mx.random.normal((1, 2, n, 4)) for n in (5, 3, 1)]
    first.update_and_fetch(rows[0], rows[0] * 2)
    before = [np.array(a) for a in first.fetch()]
    calls = []
    pool.write = lambda *a: calls.append(a)  # the batched path's scatter
    second.update_and_fetch(rows[1], rows[1] * 2)
    keys, values = second.update_and_fetch(rows[2], rows[2] * 2)
    assert calls == [] and second.offset == 4 and first.offset == 5
    expected = np.concatenate([np.array(rows[1]), np.array(rows[2])], axis=2)
    np.testing.assert_array_equal(np.array(keys), expected)
    np.testing.assert_array_equal(np.array(values), expected * 2)
    for was, now in zip(before, first.fetch(), strict=True):
        np.testing.assert_array_equal(was, np.array(now))


def test_with_pool_alone_off_a_lone_session_keeps_its_own_cache_until_company_comes(
    tiny_model_dir, plain, monkeypatch
):
    target = Target(load_target(str(tiny_model_dir), dtype="float32"), gemv_rows=0,
                    row_forwards=True, kv_pool=True, pool_alone=False)  # fmt: skip
    first, *others = sessions_of(target)[:3]
    assert not isinstance(first.cache[0], PooledCache)  # opened alone
    assert all(isinstance(s.cache[0], PooledCache) for s in others)  # opened beside it
    theirs = sessions_of(plain)[:3]
    alone = rounds_many(target, [Round(first, [], 2)])  # no company: it stays on its own cache
    assert not isinstance(first.cache[0], PooledCache)
    calls = recorded(monkeypatch, target, "forward_pooled")
    got = rounds_many(target, [Round(s, [], 4) for s in (first, *others)])
    want = [decode(plain, theirs[0], 2).committed + decode(plain, theirs[0], 4).committed,
            *(decode(plain, s, 4).committed for s in theirs[1:])]  # fmt: skip
    assert [alone[0].committed + got[0].committed, *(r.committed for r in got[1:])] == want
    # with company the first moved into the pool (its rows copied), and all three shared
    assert isinstance(first.cache[0], PooledCache) and first.cache[0].offset == first.position - 1
    assert calls and all(len(rows) == 3 for rows in calls)
    assert target.open_sessions == 3  # moving a session neither opened nor closed one
    del first, others, got
    gc.collect()
    assert target.open_sessions == 0 and target.kv_pool.open_slots == 0
    assert not isinstance(prefill(target, PROMPTS[0]).session.cache[0], PooledCache)


def test_auto_on_a_gpu_pools_sessions_opened_beside_another_and_counts_both_kinds(
    tiny_model_dir, monkeypatch
):

    from verifier_svc import servicer as servicer_module

    monkeypatch.setattr(servicer_module, "device_kind", lambda: "gpu")

    verifier = loaded_verifier(tiny_model_dir, look_ahead="off")
    target = verifier._ready()
    assert target.kv_pool is not None and not target.pool_alone
    alone = prefill(target, PROMPTS[1]).session
    beside = prefill(target, PROMPTS[2]).session
    assert isinstance(beside.cache[0], PooledCache) and not isinstance(alone.cache[0], PooledCache)
    verifier.sessions.add(alone)
    verifier.sessions.add(beside)
    own = sum(layer.nbytes for layer in alone.cache)
    assert own > 0 and verifier.kv_bytes() == target.kv_pool.nbytes + own


def test_a_round_that_would_grow_the_pool_past_the_kv_limit_is_refused(tiny_model_dir):
    from dataclasses import replace

    from specd.service import ResourceExhausted

    verifier = loaded_verifier(tiny_model_dir, kv_pool="on")
    target = verifier._ready()
    session = prefill(target, [5 + j % 80 for j in range(CAPACITY_STEP - 11)]).session
    verifier.sessions.add(session)
    held = target.kv_pool.nbytes
    verifier.config = replace(verifier.config, max_kv_bytes=int(held * 1.5))
    verifier._check_round(session, session.position, 0, 8)  # within the slots' capacity
    with pytest.raises(ResourceExhausted, match="--max-kv-memory") as refused:
        verifier._check_round(session, session.position, 0, 16)  # past it: every slot doubles
    assert f"{target.kv_pool.slots} slots" in str(refused.value)
    assert target.kv_pool.bytes_at(CAPACITY_STEP + 1) == 2 * held
    verifier.config = replace(verifier.config, max_kv_bytes=2 * held)
    verifier._check_round(session, session.position, 0, 16)  # room for the doubled pool


@pytest.mark.parametrize("join", [False, True])
def test_sampled_rounds_run_in_the_pooled_forward_and_equal_each_alone(pooled, monkeypatch, join):
    joined_copies(monkeypatch, join)
    calls = recorded(monkeypatch, pooled, "forward_pooled")
    assert_sampled_rounds_share_and_equal_each_alone(pooled, calls)


def test_tree_rounds_run_in_the_pooled_forward_and_equal_each_alone(pooled, monkeypatch):
    calls = recorded(monkeypatch, pooled, "forward_pooled")
    assert_tree_rounds_share_and_equal_each_alone(pooled, calls)


def test_a_round_whose_move_into_the_pool_would_pass_the_kv_limit_is_refused(
    tiny_model_dir, monkeypatch
):
    """As on a GPU (auto): a session opened alone keeps caches of its own and moves into the
    pool once its rounds have company; a move that would grow the pool past --max-kv-memory
    is refused before it happens, the session as it was."""
    from dataclasses import replace

    from specd.service import ResourceExhausted
    from verifier_svc import servicer as servicer_module

    monkeypatch.setattr(servicer_module, "device_kind", lambda: "gpu")
    verifier = loaded_verifier(tiny_model_dir, look_ahead="off")
    target = verifier._ready()
    assert target.kv_pool is not None and not target.pool_alone
    alone = prefill(target, [5 + j % 80 for j in range(CAPACITY_STEP + 10)]).session
    verifier.sessions.add(alone)
    verifier.config = replace(verifier.config, max_kv_bytes=verifier.kv_bytes() + 1)
    verifier._check_round(alone, alone.position, 0, 4)  # alone: its own caches, no move
    beside = prefill(target, PROMPTS[1]).session
    assert isinstance(beside.cache[0], PooledCache) and not isinstance(alone.cache[0], PooledCache)
    verifier.sessions.add(beside)
    held = target.kv_pool.nbytes
    verifier.config = replace(verifier.config, max_kv_bytes=verifier.kv_bytes() + 1)
    with pytest.raises(ResourceExhausted, match="moving this session into the KV pool"):
        verifier._check_round(alone, alone.position, 0, 4)  # every slot to its length
    assert not isinstance(alone.cache[0], PooledCache) and target.kv_pool.nbytes == held
    verifier.config = replace(verifier.config, max_kv_bytes=2 * held)
    verifier._check_round(alone, alone.position, 0, 4)  # room for the pool at its length


def test_a_trees_rows_see_the_cache_and_their_ancestors_and_padding_stays_apart():
    from types import SimpleNamespace

    from verifier_svc.kv_pool import PooledStep
    from verifier_svc.tree import ancestor_mask

    caches = [SimpleNamespace(slot=2, offset=3), SimpleNamespace(slot=0, offset=5)]
    tree = (np.array([5, 6, 6]), ancestor_mask([-1, -1]))  # a root and two children
    step = PooledStep.of(caches, 3, [None, tree])
    mask = np.array(step.mask)[:, 0]  # [B, T, L]
    assert mask.shape == (2, 3, 8)
    assert mask[0, 0].tolist() == [True] * 4 + [False] * 4  # a plain row: its cache and itself
    assert mask[1, 1].tolist() == [True] * 7 + [False]  # a child: the cache, the root, itself
    assert mask[1, 2].tolist() == [True] * 6 + [False, True]  # not its sibling
    # a tree makes the rows ragged, each rotated at its own position: the plain session's in
    # a line, the tree's at their depths
    assert np.array(step.ragged.positions).tolist() == [3, 4, 5, 5, 6, 6]
    assert PooledStep.of(caches, 3, [None, None]).ragged is None
    # the same sessions with their real rows (1 and 3): the products over 4 rows
    ragged = PooledStep.of(caches, 3, [None, tree], np.array([1, 3]))
    assert np.array_equal(ragged.mask, step.mask)
    assert np.array(ragged.ragged.positions).tolist() == [3, 5, 6, 6]
    assert np.array(ragged.ragged.padded).tolist() == [0, 0, 0, 1, 2, 3]  # padding: its last
    assert np.array(ragged.ragged.real).tolist() == [0, 3, 4, 5]


def test_a_ragged_steps_writes_go_to_each_sessions_own_rows():
    pool = KVPool(1)
    pool.reserve(10)
    index = np.array(pool.ragged_rows(np.array([1, 0]), np.array([4, 2]), np.array([1, 2]), 2))
    capacity = pool.capacity
    # (row, head): session 1's row at 4, then session 0's rows at 2 and 3
    want = [(1 * 2 + h) * capacity + pos for pos in [4] for h in range(2)]
    want += [(0 * 2 + h) * capacity + pos for pos in [2, 3] for h in range(2)]
    assert index.tolist() == want


def _tree_beside_plain_steps(pooled) -> list[Round]:
    """Two bursts of 2, a tree of 4 rows (its first draft right), a plain step."""
    sessions = _sessions(pooled)[:4]
    greedy = decode(pooled, prefill(pooled, PROMPTS[2]).session, 1).committed
    return [Round(sessions[0], [], 2), Round(sessions[1], [], 2),
            Round(sessions[2], [greedy[0], 7, 8], 1, parents=[-1, -1, 0]),
            Round(sessions[3], [], 1)]  # fmt: skip


def test_sessions_of_different_lengths_run_as_one_ragged_forward(pooled, monkeypatch):
    """A tree of 4 beside three plain steps: 7 real rows, within a limit of 8 (a batch padded
    to the longest would be 16), as one forward whose products take the real rows alone."""
    from verifier_svc import engine, kv_pool

    monkeypatch.setattr(engine, "POOLED_MAX_ROWS", 8)
    rounds = _tree_beside_plain_steps(pooled)
    calls = recorded(monkeypatch, pooled, "forward_pooled")
    products = []
    real = kv_pool._ragged_attention

    def recording(attn, x, pool, layer, step):
        products.append(x.shape)
        return real(attn, x, pool, layer, step)

    monkeypatch.setattr(kv_pool, "_ragged_attention", recording)
    results = rounds_many(pooled, rounds)
    assert calls == [[1, 1, 4, 1], [1, 1]]
    assert products and all(shape[:2] == (1, 7) for shape in products)  # the first forward's
    assert results[2].num_accepted >= 1 and [len(r.committed) for r in results] == [2, 2, 2, 1]


def test_a_pooled_batchs_attention_grid_is_bounded_too(pooled, monkeypatch):
    """Ragged rows keep the products small, but attention runs on sessions x the longest: a
    tree of 4 beside two plain steps would make a grid of 3 x 4, past a bound of 8, so it waits
    for them and then runs with the plain round behind it (2 x 4)."""
    from verifier_svc import engine

    monkeypatch.setattr(engine, "POOLED_MAX_GRID", 8)
    rounds = _tree_beside_plain_steps(pooled)
    calls = recorded(monkeypatch, pooled, "forward_pooled")
    results = rounds_many(pooled, rounds)
    assert calls == [[1, 1], [1, 1], [4, 1]]
    assert [len(r.committed) for r in results] == [2, 2, 1 + results[2].num_accepted, 1]


@pytest.fixture(scope="module")
def compiled_pooled(tiny_model_dir):
    made = Target(load_target(str(tiny_model_dir), dtype="float32"), gemv_rows=0,
                  row_forwards=True, kv_pool=True, compiled_pooled=True)  # fmt: skip
    assert made._mlx.compiled_pooled is not None
    return made


def test_the_verifier_says_how_its_batched_forwards_run(tiny_model_dir, compiled_pooled, plain):
    # off CUDA the pool kernel (auto) cannot run: the mask says where attention looks
    assert compiled_pooled.pooled_path == "compiled, attention through a mask"
    op_by_op = Target(load_target(str(tiny_model_dir), dtype="float32"), gemv_rows=0,
                      row_forwards=True, kv_pool=True, pool_kernel="on")  # fmt: skip
    assert op_by_op.pooled_path == "op by op, attention through a mask"
    assert plain.pooled_path is None


def _rows_traced(monkeypatch) -> list[int]:
    """Row counts of each call of the compiled pooled forward, as it runs."""
    from specd.models.compiled import CompiledForward

    counts: list[int] = []
    real = CompiledForward.forward_rows

    def recording(self, token_ids, positions, attend, capture=frozenset()):
        counts.append(token_ids.shape[0])
        return real(self, token_ids, positions, attend, capture)

    monkeypatch.setattr(CompiledForward, "forward_rows", recording)
    return counts


def test_compiled_pooled_rounds_commit_what_each_session_does_alone(
    compiled_pooled, plain, monkeypatch
):
    plans = round_plans(plain)
    alone = run_alone(plain, _sessions(plain), plans)
    traced = _rows_traced(monkeypatch)
    sessions = _sessions(compiled_pooled)
    together = rounds_many(
        compiled_pooled, [Round(s, d, k) for s, (d, k) in zip(sessions, plans, strict=True)]
    )
    assert traced[0] == 16  # 1 + 1 + 7 + 4 + 3 rows in one compiled forward
    assert_same_rounds(alone, together)
    for session in sessions:
        assert session.cache[0].offset == session.position - 1


def test_compiled_pooled_sampled_and_tree_rounds_equal_each_alone(compiled_pooled, monkeypatch):
    from specd.models.compiled import traced_rows

    traced = _rows_traced(monkeypatch)
    calls = recorded(monkeypatch, compiled_pooled, "forward_pooled")
    assert_sampled_rounds_share_and_equal_each_alone(compiled_pooled, calls)
    assert_tree_rounds_share_and_equal_each_alone(compiled_pooled, calls)
    # the tree rounds' forwards (`calls` holds those since its prefills), each compiled, padded
    assert traced[-len(calls) :] == [traced_rows(sum(rows)) for rows in calls]
    assert traced_rows(7 + 1 + 3 + 5) == 16 and traced_rows(1) == 1


def test_compiled_pooled_forwards_with_spare_rows_equal_the_models_own(
    pooled, compiled_pooled, monkeypatch
):
    """Rows padded to a traced count write where nothing reads: two ragged forwards in a row
    (10 real rows run as 16, then 3 as 3), a tree among them, give the model's own logits and
    captured rows, and each session's cache after them is the model's own."""
    from specd.cpu.llama import Segment
    from verifier_svc.tree import ancestor_mask

    traced = _rows_traced(monkeypatch)
    results = []
    for target in (pooled, compiled_pooled):
        sessions = _sessions(target)[:3]
        base = sessions[2].cache[0].offset
        tree = (base + np.array([0, 1, 1, 2, 2, 3]), ancestor_mask([-1, -1, 0, 0, 2]))
        first = target._mlx.forward_pooled(
            [Segment(np.array([5]), sessions[0].cache), Segment(np.array([6, 7, 8]),
             sessions[1].cache), Segment(np.arange(10, 16), sessions[2].cache, *tree)],
            frozenset({1}),
        )  # fmt: skip
        second = target._mlx.forward_pooled(
            [Segment(np.array([9]), s.cache) for s in sessions], frozenset({1})
        )
        results.append(first + second)
    assert traced == [16, 3]
    for (want_logits, want_rows), (got_logits, got_rows) in zip(*results, strict=True):
        assert mx.allclose(got_logits, want_logits, rtol=1e-5, atol=1e-4).item()
        assert mx.array_equal(mx.argmax(got_logits, -1), mx.argmax(want_logits, -1)).item()
        assert mx.allclose(got_rows[1], want_rows[1], rtol=1e-5, atol=1e-4).item()


def test_the_full_warm_up_traces_every_row_count_of_the_compiled_pooled_forward(
    tiny_model_dir, monkeypatch
):
    """Both in the full warm-up and in the serving process's (`separate` mode: traces live in
    the process that made them), whatever the longest verify."""
    from specd.models.compiled import MAX_POOLED_ROWS, traced_rows
    from verifier_svc.warmup import full_warmup, serving_warmup

    target = Target(load_target(str(tiny_model_dir), dtype="float32"), gemv_rows=0,
                    row_forwards=True, kv_pool=True, compiled_pooled=True)  # fmt: skip
    every = {traced_rows(n) for n in range(2, MAX_POOLED_ROWS + 1)}
    for warm_up in (lambda: full_warmup(target, 3, long_context=80),
                    lambda: serving_warmup(target)):  # fmt: skip
        traced = _rows_traced(monkeypatch)
        warm_up()
        assert set(traced) >= every and max(traced) == MAX_POOLED_ROWS
        gc.collect()
        assert target.kv_pool.open_slots == 0


@pytest.mark.parametrize("compiled", [False, True])
def test_a_long_session_beside_a_verify_of_a_short_one_finds_the_pool_grown(
    tiny_model_dir, plain, compiled
):
    """The attention grid reaches the furthest offset plus the longest rows (here 251 + 8,
    past the first 256 of capacity) though no session's own rows reach it."""
    target = Target(load_target(str(tiny_model_dir), dtype="float32"), gemv_rows=0,
                    row_forwards=True, kv_pool=True, compiled_pooled=compiled)  # fmt: skip
    prompts = [[(5 * i + 3) % 90 + 3 for i in range(n)] for n in (251, 10)]
    runs = []
    for made in (target, plain):
        long_one, short = (prefill(made, p).session for p in prompts)
        drafts = [3, 1, 4, 1, 5, 9, 2]
        runs.append(rounds_many(made, [Round(long_one, [], 1), Round(short, drafts, 1)]))
    assert_same_rounds(runs[1], runs[0])


@pytest.mark.parametrize(
    ("rows_a_step", "in_a_step", "want_steps"),
    [
        (64, 128, [[1, 1, 13, 1, 18], [1, 1, 1, 1], [1, 1]]),  # a one-token prompt: alone
        (8, 128, [[1, 1, 8, 1, 8], [1, 1, 5, 8], [1, 1, 1, 2], [1]]),  # chunks, then the last
        # prompts past a step's share wait, the rounds behind them go on; the last, left
        # with no company, is prefilled alone
        (8, 8, [[1, 1, 8], [1, 1, 5, 1], [1, 1, 1]]),
    ],
)
def test_prompts_open_as_rows_of_the_running_rounds_steps(
    pooled, plain, monkeypatch, rows_a_step, in_a_step, want_steps
):
    """A prompt joins the batched steps beside running rounds: all but its last token in
    chunks of PROMPT_ROWS_A_STEP a step, then the last, the prompts of a step bringing
    PROMPT_ROWS_IN_A_STEP rows at most; its first token, rows and cache as `prefill` makes
    them, the rounds beside it committing what they commit alone."""
    from verifier_svc import engine
    from verifier_svc.engine import PrefillResult, PromptToPrefill, prompt_round
    from verifier_svc.sampling import SamplingConfig

    monkeypatch.setattr(engine, "PROMPT_ROWS_A_STEP", rows_a_step)
    monkeypatch.setattr(engine, "PROMPT_ROWS_IN_A_STEP", in_a_step)
    sessions = [prefill(pooled, PROMPTS[i], CAPTURES[i]).session for i in (0, 1)]
    reference = [prefill(plain, PROMPTS[i], CAPTURES[i]).session for i in (0, 1)]
    sampled = SamplingConfig(temperature=0.8)
    asks = [PromptToPrefill(PROMPTS[2], CAPTURES[2]), PromptToPrefill([42], (0,)),
            PromptToPrefill(PROMPTS[3], (), sampling=sampled, seed=5)]  # fmt: skip
    steps = recorded(monkeypatch, pooled, "forward_pooled")
    rounds = [Round(s, [], 3) for s in sessions] + [prompt_round(pooled, a) for a in asks]
    results = rounds_many(pooled, rounds)
    assert steps == want_steps
    assert [r.committed for r in results[:2]] == [decode(plain, s, 3).committed for s in reference]
    in_steps = [True, True, in_a_step > rows_a_step]
    for ask, got, stepped in zip(asks, results[2:], in_steps, strict=True):
        assert isinstance(got, PrefillResult) and got.in_steps == stepped
        _assert_opened_as_alone(pooled, plain, ask, got)


def test_prompts_past_a_steps_share_wait_in_order(pooled, monkeypatch):
    """A prompt past a step's share of prompt rows waits, and so do the prompts behind it,
    however short (one that took the room would keep it waiting); the rounds behind go on."""
    from verifier_svc import engine
    from verifier_svc.engine import PromptToPrefill, prompt_round

    monkeypatch.setattr(engine, "PROMPT_ROWS_A_STEP", 8)
    monkeypatch.setattr(engine, "PROMPT_ROWS_IN_A_STEP", 10)
    sessions = [prefill(pooled, PROMPTS[i]).session for i in (0, 1)]
    asks = [PromptToPrefill(PROMPTS[2]), PromptToPrefill(PROMPTS[3]), PromptToPrefill([42])]
    steps = recorded(monkeypatch, pooled, "forward_pooled")
    rounds = [Round(sessions[0], [], 4), *(prompt_round(pooled, a) for a in asks),
              Round(sessions[1], [], 4)]  # fmt: skip
    results = rounds_many(pooled, rounds)
    # the one-token prompt would fit beside the first chunk, but waits behind the second prompt
    assert steps[0] == [1, 8, 1]
    assert all(r.in_steps for r in results[1:4])
    assert [len(r.committed) for r in (results[0], results[4])] == [4, 4]


def test_a_prompts_chunk_keeps_the_step_in_the_pool_kernel():
    """A prompt's chunk is no wider than the pool kernel attends in place, so a step of decode
    rows beside the prompts' share of chunks keeps its per-row attention (row_info); a wider
    chunk would send the step through a grid padded to its rows for every session."""
    from specd.models import pool_attention
    from verifier_svc.engine import PROMPT_ROWS_A_STEP, PROMPT_ROWS_IN_A_STEP

    sessions = 64 + PROMPT_ROWS_IN_A_STEP // PROMPT_ROWS_A_STEP
    lengths = np.array([1] * 64 + [PROMPT_ROWS_A_STEP] * (sessions - 64))
    slots, offsets = np.arange(sessions), np.full(sessions, 700)
    assert pool_attention.row_info(slots, offsets, lengths) is not None
    lengths[-1] = 64
    assert pool_attention.row_info(slots, offsets, lengths) is None


def test_a_prompt_whose_step_fails_is_answered_with_the_error_and_leaves_no_slot(
    pooled, monkeypatch
):
    from verifier_svc.engine import PromptToPrefill, prompt_round
    from verifier_svc.forwards import MlxForward

    session = prefill(pooled, PROMPTS[0]).session
    before = session.cache[0].offset
    real = MlxForward.forward_pooled
    calls = []

    def failing_second(self, segments, capture, *rest):
        calls.append(len(segments))
        if len(calls) >= 2:  # tried again one round a step, each fails alone
            raise RuntimeError("device lost")
        return real(self, segments, capture, *rest)

    monkeypatch.setattr(MlxForward, "forward_pooled", failing_second)
    slots = pooled.kv_pool.open_slots
    results = rounds_many(
        pooled, [Round(session, [], 4), prompt_round(pooled, PromptToPrefill(PROMPTS[2]))]
    )
    assert all(isinstance(r, RuntimeError) for r in results)
    assert session.cache[0].offset == before  # as it was before the round
    del results
    gc.collect()
    assert pooled.kv_pool.open_slots == slots  # the prompt's slot given back
    monkeypatch.setattr(MlxForward, "forward_pooled", real)
    assert len(rounds_many(pooled, [Round(session, [], 2)])[0].committed) == 2


@pytest.mark.parametrize("fails", ["wide", "third step"])
def test_a_step_that_fails_with_many_rounds_goes_on_with_fewer_and_the_same_results(
    pooled, monkeypatch, fails
):
    """A shared forward failing while it holds more than two sessions (a device out of memory
    passes with fewer rows), or once in the middle of the rounds: its rounds, a prompt's
    among them, go on from where the step found them, at most half as many a step, and
    commit what they commit with no failure."""
    from verifier_svc.engine import PromptToPrefill, prompt_round
    from verifier_svc.forwards import MlxForward

    def rounds():
        sessions = [prefill(pooled, p).session for p in PROMPTS[:3]]
        asked = [Round(s, [], 4) for s in sessions]
        return asked + [prompt_round(pooled, PromptToPrefill(PROMPTS[3] * 3))]

    def outcome(results):
        return [r.committed if hasattr(r, "committed") else r.first_token for r in results]

    want = outcome(rounds_many(pooled, rounds()))
    real = MlxForward.forward_pooled
    widths = []

    def failing(self, segments, capture, *rest):
        widths.append(len(segments))
        # the caches' offsets moved: rolled back on failure
        outs = real(self, segments, capture, *rest)
        if len(segments) > 2 if fails == "wide" else len(widths) == 3:
            raise RuntimeError("cudaMallocAsync: out of memory")
        return outs

    monkeypatch.setattr(MlxForward, "forward_pooled", failing)
    results = rounds_many(pooled, rounds())
    assert not any(isinstance(r, Exception) for r in results)
    assert outcome(results) == want
    failed = 0 if fails == "wide" else 2
    assert widths[failed : failed + 2] == [4, 2]  # failed, then half as many a step


def _verify_beside_opens(model_dir, prompts: list[list[int]]):
    """A Verify of 4 plain steps and OpenSessions of `prompts` queued together on a verifier
    with `--prefill-in-steps 64`: (the Verify's answer, each open's answer or error, the load
    line)."""
    import asyncio
    import threading

    from specd.v1 import verifier_pb2

    async def main():
        verifier, mlx = await _pooled_servicer(model_dir, prefill_in_steps=64)
        first = await verifier.OpenSession(
            verifier_pb2.OpenSessionRequest(prompt_ids=PROMPTS[0]), RpcContext()
        )
        gate = threading.Event()
        mlx.submit(gate.wait)  # the worker busy while the calls queue up
        request = verifier_pb2.VerifyRequest(
            session_id=first.session_id, position=first.position, plain_steps=4
        )
        calls = [verifier.Verify(request, RpcContext())] + [
            verifier.OpenSession(verifier_pb2.OpenSessionRequest(prompt_ids=p), RpcContext())
            for p in prompts
        ]
        tasks = [asyncio.ensure_future(c) for c in calls]
        await asyncio.sleep(0.3)
        gate.set()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        line = verifier.load_stats.take().line(0, 0)
        mlx.shutdown()
        return done[0], done[1:], line

    return asyncio.run(main())


def test_the_verifier_opens_short_prompts_in_the_running_rounds_steps(
    tiny_model_dir, plain, monkeypatch
):
    """`--prefill-in-steps N`: an OpenSession of at most N tokens queued beside Verify calls
    joins their batched steps (no prefill job), answering what `prefill` answers."""
    from verifier_svc import engine

    jobs: list[int] = []
    monkeypatch.setattr(engine, "_prefill_group", lambda *args: jobs.append(1))
    verified, opened, line = _verify_beside_opens(tiny_model_dir, PROMPTS[1:3])
    assert not jobs  # no prefill job ran
    assert "2 prompts prefilled in the steps" in line
    assert [o.first_token for o in opened] == [prefill(plain, p).first_token for p in PROMPTS[1:3]]
    reference = prefill(plain, PROMPTS[0]).session
    assert list(verified.committed_ids) == decode(plain, reference, 4).committed


def test_a_prompt_opened_in_the_steps_leaves_no_caller_for_the_rounds_to_wait_for(
    tiny_model_dir,
):
    """A prompt's caller comes back as its session's rounds, never as a prompt: after an
    OpenSession in the steps the lone session's next round finds no caller missing, so the
    worker does not wait `Batch.gather_s` before it (it did, for half a second after every
    prompt, on a GPU's default --prefill-in-steps)."""
    import asyncio
    import time

    from specd.v1 import verifier_pb2
    from verifier_svc.servicer import RoundAsked

    async def main():
        verifier, mlx = await _pooled_servicer(tiny_model_dir, prefill_in_steps=64)
        ran, record = [], verifier._rounds.ran
        verifier._rounds.ran = lambda items, now: ran.extend(items) or record(items, now)
        opened = await verifier.OpenSession(
            verifier_pb2.OpenSessionRequest(prompt_ids=PROMPTS[0]), RpcContext()
        )
        session = verifier.sessions.get(opened.session_id)
        asked = RoundAsked(session, opened.position, [], 1)
        waits = verifier._rounds.missing([asked], time.perf_counter())
        mlx.shutdown()
        return [type(item).__name__ for item in ran], waits

    ran, waits = asyncio.run(main())
    assert ran == ["PromptAsked"]  # the prompt went through the rounds' batch
    assert not waits


def test_a_prompt_that_cannot_open_in_the_steps_fails_alone(tiny_model_dir, plain, monkeypatch):
    """A prompt whose session cannot be made (here: its pool slot) gets the error; the rounds
    and the other prompt in the same steps go on."""
    from verifier_svc import servicer

    real = servicer.prompt_round

    def refusing(target, ask):
        if ask.prompt_ids == PROMPTS[1]:
            raise MemoryError("no room for another pool slot")
        return real(target, ask)

    monkeypatch.setattr(servicer, "prompt_round", refusing)
    verified, (refused, opened), _ = _verify_beside_opens(tiny_model_dir, PROMPTS[1:3])
    assert "INTERNAL" in str(refused) and "no room for another pool slot" in str(refused)
    assert opened.first_token == prefill(plain, PROMPTS[2]).first_token
    reference = prefill(plain, PROMPTS[0]).session
    assert list(verified.committed_ids) == decode(plain, reference, 4).committed


def test_a_prompt_round_with_no_company_opens_its_session_as_prefill_does(tiny_model_dir, plain):
    """Alone, a prompt round is `prefill` into the cache it opened: with pool_alone off a
    cache of its own (no pool slot taken), one session open, none once it is dropped."""
    from mlx_lm.models.cache import KVCache

    from verifier_svc.engine import PromptToPrefill, prompt_round

    target = Target(load_target(str(tiny_model_dir), dtype="float32"), gemv_rows=0,
                    row_forwards=True, kv_pool=True, pool_alone=False)  # fmt: skip
    (opened,) = rounds_many(target, [prompt_round(target, PromptToPrefill(PROMPTS[1]))])
    assert not opened.in_steps and type(opened.session.cache[0]) is KVCache
    assert opened.first_token == prefill(plain, PROMPTS[1]).first_token
    assert target.open_sessions == 1 and target.kv_pool.open_slots == 0
    del opened
    gc.collect()
    assert target.open_sessions == 0


@pytest.mark.parametrize("fail_once", [False, True])
def test_plain_draws_share_the_forwards_and_equal_each_alone(pooled, monkeypatch, fail_once):
    assert_plain_draws_share_and_equal_each_alone(pooled, monkeypatch, fail_once)
