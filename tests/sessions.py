"""Verifier sessions shared by the tests of forwards over many sessions."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from drafter_svc.proposal import line_first
from verifier_svc.sampling import SamplingConfig

PROMPTS = [[5 + (7 * i + j) % 90 for j in range(4 + 5 * i)] for i in range(5)]
CAPTURES = [(0, 1), (), (1,), (0, 1), (0,)]


def close(got, want, rtol: float = 1e-3) -> None:
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    assert got.shape == want.shape
    assert np.allclose(got, want, rtol=rtol, atol=2e-3), np.abs(got - want).max()


def recorded(monkeypatch, target, method: str) -> list[list[int]]:
    """Rows per session of each call of the target's MLX forward `method`, as it runs."""
    return recorded_on(monkeypatch, target._mlx, method)


def recorded_on(monkeypatch, owner, method: str = "forward_many") -> list[list[int]]:
    """Rows per session of each call of `owner`'s forward over segments `method` (its class
    patched), as it runs: the MLX forwards', or the CPU kernels' (`Target.cpu_layers`)."""
    calls: list[list[int]] = []
    real = getattr(type(owner), method)

    def recording(self, segments, capture, *rest):
        calls.append([len(seg.token_ids) for seg in segments])
        return real(self, segments, capture, *rest)

    monkeypatch.setattr(type(owner), method, recording)
    return calls


def sessions_of(target) -> list:
    from verifier_svc.engine import prefill

    return [prefill(target, p, c).session for p, c in zip(PROMPTS, CAPTURES, strict=True)]


def round_plans(target) -> list[tuple[list[int], int]]:
    """(drafts, steps) per session of `sessions_of`: plain bursts, a verify long enough for
    chunked attention, one of the greedy continuation (all accepted), one rejected at once."""
    from verifier_svc.engine import decode

    greedy = decode(target, sessions_of(target)[3], 3).committed
    wrong = decode(target, sessions_of(target)[4], 1).committed[0] + 1
    return [([], 4), ([], 1), ([3, 1, 4, 1, 5, 9], 1), (greedy, 1), ([wrong, 5], 1)]


def run_alone(target, sessions, plans) -> list:
    from verifier_svc.engine import decode, verify

    return [
        verify(target, s, d) if d else decode(target, s, k)
        for s, (d, k) in zip(sessions, plans, strict=True)
    ]


def assert_same_rounds(alone, together) -> None:
    for a, b in zip(alone, together, strict=True):
        assert (b.committed, b.num_accepted, b.finished) == (a.committed, a.num_accepted,
                                                             a.finished)  # fmt: skip
        assert (a.rows is None) == (b.rows is None)
        if a.rows is not None:
            close(b.rows, a.rows)


def loaded_verifier(model_dir, **options):
    """A verifier servicer on `model_dir`, loaded (minimal warm-up, MLX forwards row by row
    unless `options` say otherwise) and its worker stopped: for calling its methods
    directly."""
    import asyncio

    from specd.service import MlxThread
    from verifier_svc.config import VerifierConfig
    from verifier_svc.servicer import VerifierServicer

    async def load():
        mlx = MlxThread()
        settings = {"gemv_rows": 0, "row_forwards": "on", **options}
        config = VerifierConfig(model=str(model_dir), warmup="minimal", **settings)
        verifier = VerifierServicer(config, mlx)
        await verifier.load()
        mlx.shutdown()
        return verifier

    return asyncio.run(load())


class RpcContext:
    """What the servicers' rpc wrapper needs of a grpc.aio context, for calling a servicer
    method directly; an abort fails the test with the status."""

    def invocation_metadata(self):
        return ()

    async def abort(self, code, details):
        raise AssertionError(f"{code}: {details}")


SAMPLING = SamplingConfig(temperature=1.0, top_k=20)


def greedy_after(target, tokens: list[int], n: int) -> list[int]:
    """The target's n likeliest next tokens one after another, from full forwards of the
    model (a session's caches untouched): drafts it keeps almost always."""
    out: list[int] = []
    for _ in range(n):
        logits = target.loaded.model(mx.array([[*tokens, *out]]))[0, -1]
        out.append(int(mx.argmax(logits).item()))
    return out


def mixed_sampled_rounds(target) -> tuple[list, list]:
    """(sessions, rounds) beside each other: a greedy burst, a sampled burst, a sampled verify
    of three drafts with the drafter's distributions (the first two the target's likeliest,
    given less than the target gives them, so kept; the third given far more, so rejected), a
    sampled verify of one-hot drafts and a
    greedy verify, each sampled session on a seed of its own. Called twice, the same rounds
    on fresh sessions."""
    from verifier_svc.engine import Round, prefill

    vocab = target.identity.vocab_size

    def opened(i: int, seed: int | None):
        sampling = SAMPLING if seed is not None else SamplingConfig()
        return prefill(target, PROMPTS[i], CAPTURES[i], sampling=sampling, seed=seed).session

    sessions = [opened(0, None), opened(1, 11), opened(2, 12), opened(3, 13), opened(4, None)]
    likely = greedy_after(target, [*PROMPTS[2], sessions[2].last_token], 2)
    drafts = [*likely, 9 if likely[1] != 9 else 8]
    on_draft = np.array([0.05, 0.05, 0.9])  # a draft's extra mass: kept where p > q
    probs = np.ones((len(drafts), vocab)) * ((1 - on_draft) / vocab)[:, None]
    probs[np.arange(len(drafts)), drafts] += on_draft
    one_hot = greedy_after(target, [*PROMPTS[3], sessions[3].last_token], 2)
    rounds = [
        Round(sessions[0], [], 4),
        Round(sessions[1], [], 5),
        Round(sessions[2], drafts, 1, draft_probs=probs),
        Round(sessions[3], one_hot, 1),
        Round(sessions[4], [3, 1], 1),
    ]
    return sessions, rounds


def run_rounds_alone(target, rounds) -> list:
    """Each round as the verifier runs one session's round by itself."""
    from verifier_svc.engine import decode, verify

    return [
        verify(target, r.session, r.drafts, r.draft_probs)
        if r.drafts
        else decode(target, r.session, r.steps)
        for r in rounds
    ]


def assert_plain_draws_share_and_equal_each_alone(target, monkeypatch, fail_once=False) -> None:
    """Sampled bursts by temperature alone, beside a greedy one and one sampling with top-k
    (drawn on the host), share the forwards and draw together by MLX (`device_draws`, a GPU's
    way), committing what each commits alone, their generators in step after. fail_once: the
    first shared step's draws fail after their uniforms were taken, and the rounds go on."""
    from verifier_svc import engine
    from verifier_svc.engine import Round, prefill, rounds_many

    monkeypatch.setattr(engine, "_on_gpu", lambda: True)  # as a GPU draws, on any device
    settings = [SamplingConfig(), SamplingConfig(0.6), SamplingConfig(1.0), SamplingConfig(1.4),
                SamplingConfig(1.0, top_k=5)]  # fmt: skip

    def opened():
        return [prefill(target, PROMPTS[i], CAPTURES[i], seed=20 + i, sampling=sampling).session
                for i, sampling in enumerate(settings)]  # fmt: skip

    alone_sessions = opened()
    alone = run_rounds_alone(target, [Round(s, [], 5) for s in alone_sessions])
    drawn, draw = [], engine.draw

    def counted(rows, *args):
        drawn.append(rows.shape[0])
        if fail_once and drawn.count(3) == 1 and rows.shape[0] == 3:
            raise RuntimeError("the device failed the step")
        return draw(rows, *args)

    monkeypatch.setattr(engine, "draw", counted)
    sessions = opened()
    together = rounds_many(target, [Round(s, [], 5) for s in sessions])
    assert 3 in drawn  # the three sessions sampling by temperature alone, drawn together
    assert_same_rounds(alone, together)
    for got, want in zip(sessions, alone_sessions, strict=True):
        if want.rng is not None:  # the generators took the same uniforms
            assert got.rng.random() == want.rng.random()


def joined_copies(monkeypatch, join: bool) -> None:
    """Sampled rows copied to the host joined in one (a GPU's way) or one by one (the CPU's),
    whatever the device running the test."""
    from functools import partial

    from verifier_svc import engine

    monkeypatch.setattr(engine, "_drawn_rows", partial(engine._drawn_rows, join=join))


def assert_sampled_rounds_share_and_equal_each_alone(target, forward_calls: list) -> None:
    """Sampled rounds take part in the shared forwards (`forward_calls`: rows per session of
    each, recorded) and commit what each commits alone: the same logits, the same draws from
    the session's own generator."""
    from verifier_svc.engine import rounds_many

    alone_sessions, alone_rounds = mixed_sampled_rounds(target)
    alone = run_rounds_alone(target, alone_rounds)
    sessions, rounds = mixed_sampled_rounds(target)
    forward_calls.clear()  # the prefills' forwards
    together = rounds_many(target, rounds)
    assert forward_calls and len(forward_calls[0]) == len(rounds)  # every session at once
    assert together[2].num_accepted == 2  # a kept prefix, then a rejection
    assert_same_rounds(alone, together)
    for got, want in zip(sessions, alone_sessions, strict=True):
        assert (got.position, got.last_token) == (want.position, want.last_token)
        assert got.cache[0].offset == got.position - 1
        if want.rng is not None:  # the generators drew the same numbers
            assert got.rng.random() == want.rng.random()


def tree_prompt(length: int) -> list[int]:
    return np.random.default_rng(length).integers(3, 200, length).tolist()


def tree_rounds(target, sampled_seed: int | None):
    """(sessions, rounds): a greedy tree whose second branch is right for two levels, a plain
    burst, a chain, and a tree on a sampled session (`sampled_seed`) whose second branch holds
    the target's likeliest tokens, beside each other."""
    from verifier_svc.engine import Round, decode, prefill

    prompts = [tree_prompt(7), tree_prompt(12), tree_prompt(5), tree_prompt(9)]
    right = decode(target, prefill(target, prompts[0]).session, 3).committed
    vocab = target.identity.vocab_size
    wrong = [(t + 1) % vocab for t in right]
    sampling = SamplingConfig(temperature=0.3, top_k=20)  # peaked: its likeliest mostly kept
    sessions = [prefill(target, p, (0, 1)).session for p in prompts[:3]]
    sessions.append(prefill(target, prompts[3], (1,), sampling=sampling, seed=sampled_seed).session)
    # listed depth-first as the drafters send trees (the right path second: it moves), its
    # positions out of runs; session 3's tree stays breadth-first
    order, parents = line_first([-1, -1, 0, 1, 2, 3])
    tree = [[wrong[0], right[0], wrong[1], right[1], wrong[2], wrong[2]][i] for i in order]
    likely = greedy_after(target, [*prompts[3], sessions[3].last_token], 2)
    other = [(t + 7) % vocab for t in likely]
    rounds = [
        Round(sessions[0], tree, 1, parents=parents),
        Round(sessions[1], [], 4),
        Round(sessions[2], [3, 4], 1),
        Round(sessions[3], [other[0], likely[0], other[1], likely[1]], 1, parents=[-1, -1, 0, 1]),
    ]
    return sessions, rounds


def assert_tree_rounds_share_and_equal_each_alone(target, forward_calls: list) -> None:
    """A draft tree's nodes go into the shared forward (`forward_calls`: rows per session of
    each, recorded) at their depths, each seeing its ancestors alone; the path kept, its rows
    and the compacted cache are those of `verify_tree` alone, greedy and sampled."""
    from verifier_svc.engine import rounds_many, verify, verify_tree

    alone_sessions, alone_rounds = tree_rounds(target, 21)
    alone = [
        verify_tree(target, r.session, r.drafts, r.parents)
        if r.parents
        else run_rounds_alone(target, [r])[0]
        for r in alone_rounds
    ]
    sessions, rounds = tree_rounds(target, 21)
    forward_calls.clear()  # the prefills' forwards
    together = rounds_many(target, rounds)
    assert forward_calls[0] == [7, 1, 3, 5]  # every round's first step in one forward
    assert together[0].num_accepted == 2 and together[3].num_accepted >= 1
    assert_same_rounds(alone, together)
    for got, want in zip(sessions, alone_sessions, strict=True):
        assert (got.position, got.last_token) == (want.position, want.last_token)
        assert got.cache[0].offset == got.position - 1
        # the caches hold the same context: the next rounds agree
        assert verify(target, got, []).committed == verify(target, want, []).committed
