"""The round loop in one process: identity with plain decoding, stats, limits, faults."""

import asyncio
import math
import random

import pytest

from coordinator.adaptive import AdaptiveK, LinearCost, SpeculationCosts
from coordinator.local import LocalDrafter, LocalVerifier
from coordinator.rounds import Drafted, Plan, RoundStats, RoundTime, run_rounds
from drafter_svc.ngram import NgramConfig, NgramProposer
from drafter_svc.proposal import Proposal
from specd.models.load import load_target
from verifier_svc.engine import Target

PROMPTS = [[3, 40, 41, 42, 43, 40, 41, 42, 50], [7, 7, 7, 7], list(range(3, 60))]


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return Target(load_target(str(tiny_model_dir), dtype="float32"))


def collect(verifier, drafter, prompt, plan):
    async def go():
        stats, out = RoundStats(), []
        async for ids, _finished in run_rounds(verifier, drafter, prompt, plan, stats):
            out.extend(ids)
        return out, stats

    return asyncio.run(go())


class GarbageProposer:
    kind, capture_layers, sends_draft_probs, accepts_speculative_ids = "garbage", (), False, False

    def __init__(self, vocab, seed=0):
        self.vocab, self.rng = vocab, random.Random(seed)

    def open(self, context, rows):
        return None

    def extend(self, state, new_ids, rows):
        pass

    def propose(self, state, k, sampling=None, speculative=(), tree=None):
        return Proposal([self.rng.randrange(self.vocab) for _ in range(k)])


class FailingDrafter(LocalDrafter):
    async def draft(self, *args):
        raise ConnectionError("drafter went away")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_speculation_equals_plain_rounds(target, prompt):
    verifier = LocalVerifier(target)
    plain, _ = collect(verifier, None, prompt, Plan(max_tokens=60, num_draft_tokens=0))
    ngram = LocalDrafter(NgramProposer(NgramConfig(min_n=1, max_n=3)))
    spec, stats = collect(verifier, ngram, prompt, Plan(max_tokens=60, num_draft_tokens=5))
    adaptive = AdaptiveK(SpeculationCosts(), k_max=6)
    adapted, _ = collect(verifier, ngram, prompt, Plan(60, 6, adaptive=adaptive))
    assert adapted == plain
    garbage = LocalDrafter(GarbageProposer(target.identity.vocab_size))
    noisy, _ = collect(verifier, garbage, prompt, Plan(max_tokens=60, num_draft_tokens=4))
    assert spec == plain and noisy == plain
    assert len(plain) <= 60
    assert stats.generated_tokens == len(spec)
    assert stats.tau == pytest.approx(1 + stats.accepted / stats.rounds)
    assert not verifier.sessions  # closed
    # one timing per verify call, each with the compute the services reported inside it
    assert len(stats.round_times) == stats.rounds
    assert all(t.verify_compute > 0 and t.total >= t.draft + t.verify for t in stats.round_times)
    assert 0 < stats.overhead_median_s < max(t.total for t in stats.round_times)


def test_round_overhead_is_the_time_outside_both_computes():
    stats = RoundStats(
        round_times=[
            RoundTime(
                draft=0.010, verify=0.070, total=0.081, draft_compute=0.004, verify_compute=0.068
            ),
            RoundTime(0.0, 0.062, 0.0625, 0.0, 0.060),
            RoundTime(0.008, 0.075, 0.0845, 0.005, 0.071),
        ]
    )
    outside = [t.outside_forwards for t in stats.round_times]
    assert outside == pytest.approx([0.009, 0.0025, 0.0085])
    assert stats.overhead_median_s == pytest.approx(0.0085)
    assert RoundStats().overhead_median_s == 0.0


class RecordingDrafter(LocalDrafter):
    def __init__(self, proposer):
        super().__init__(proposer)
        self.calls = []  # (tokens generated so far, k)

    async def draft(self, session_id, position, new_ids, rows, k, sampling, *rest):
        self.calls.append((position - len(PROMPTS[1]), k))
        return await super().draft(session_id, position, new_ids, rows, k, sampling, *rest)


@pytest.mark.parametrize("beside", [False, True])
def test_max_tokens_is_exact_and_drafts_stop_short_of_it(target, beside):
    for max_tokens in (1, 2, 7, 33):
        # beside: the first calls find nothing, so later ones run beside decode bursts
        proposer = SilentProposer(2, NgramProposer()) if beside else NgramProposer()
        drafter = RecordingDrafter(proposer)
        out, stats = collect(
            LocalVerifier(target),
            drafter,
            PROMPTS[1],
            Plan(max_tokens, 8, decode_burst=4, draft_beside_decode=beside),
        )
        assert len(out) == max_tokens or out[-1] in target.eos_ids
        assert drafter.calls or max_tokens <= 2  # k = 0 when one token is left
        assert (stats.beside_calls > 0) == (beside and max_tokens >= 7), stats.beside_calls
        assert all(done + k + 1 <= max_tokens for done, k in drafter.calls)


def test_drafter_failure_falls_back_to_plain_rounds(target):
    verifier = LocalVerifier(target)
    plain, _ = collect(verifier, None, PROMPTS[0], Plan(max_tokens=40, num_draft_tokens=0))
    failing = FailingDrafter(NgramProposer())
    out, stats = collect(verifier, failing, PROMPTS[0], Plan(max_tokens=40, num_draft_tokens=4))
    assert out == plain and stats.drafter_failed


class FlakyDrafter(LocalDrafter):
    """Fails its first `failures` draft calls, then works (a drafter that restarted)."""

    def __init__(self, proposer, failures):
        super().__init__(proposer)
        self.failures = failures
        self.opens = 0

    async def open(self, context_ids, rows):
        self.opens += 1
        return await super().open(context_ids, rows)

    async def draft(self, *args):
        if self.failures:
            self.failures -= 1
            self.sessions.clear()  # a restarted drafter has lost its sessions
            raise ConnectionError("drafter restarting")
        return await super().draft(*args)


def test_drafting_resumes_when_the_drafter_is_back(target):
    verifier = LocalVerifier(target)
    plain, _ = collect(verifier, None, PROMPTS[0], Plan(max_tokens=40, num_draft_tokens=0))
    flaky = FlakyDrafter(NgramProposer(NgramConfig(min_n=1)), failures=2)
    plan = Plan(max_tokens=40, num_draft_tokens=4, drafter_retry_s=0.0)
    out, stats = collect(verifier, flaky, PROMPTS[0], plan)
    assert out == plain and stats.drafter_failed
    assert flaky.opens == 3  # the first open, then one re-open after each fault
    assert stats.drafted > 0


def test_while_the_drafter_is_down_rounds_decode_drafting_offs_bursts(target):
    """Between a fault and its retry there is no call to make: each round decodes drafting
    off's burst, not bursts grown again from one token, and none counts as the drafter's
    empty answer, so the streak a request leaves to the next ones (adaptive k) is the
    drafter's answers', not the fault's rounds."""
    off = CountingVerifier(target)
    plain, _ = collect(off, None, PROMPTS[0], Plan(60, 0, decode_burst=8))
    for beside in (False, True):
        verifier = CountingVerifier(target)
        plan = Plan(60, 4, decode_burst=8, draft_beside_decode=beside, drafter_retry_s=3600)
        out, stats = collect(verifier, FailingDrafter(NgramProposer()), PROMPTS[0], plan)
        assert out == plain and stats.drafter_failed
        assert verifier.calls == off.calls  # the failed call's round was the first burst
    costs = SpeculationCosts()
    for _ in range(2):
        plan = Plan(60, 4, adaptive=AdaptiveK.for_session(costs, 4, text_driven=True),
                    decode_burst=8, draft_beside_decode=True, drafter_retry_s=3600)  # fmt: skip
        out, _ = collect(LocalVerifier(target), FailingDrafter(NgramProposer()), PROMPTS[0], plan)
        assert out == plain
    assert costs.fruitless_calls == 2  # each request's one failed call


def test_a_drafter_back_after_a_fault_starts_its_streak_anew(target):
    """A streak of calls that found nothing, left by earlier requests, ends when the drafter
    comes back after a fault (a restarted or replaced process): it is asked every round
    again, its own answers counted from zero."""
    costs = SpeculationCosts(fruitless_calls=50)
    flaky = FlakyDrafter(SilentProposer(silent=3), failures=1)
    plan = Plan(60, 4, adaptive=AdaptiveK.for_session(costs, 4, text_driven=True),
                decode_burst=8, draft_beside_decode=True, drafter_retry_s=0.0)  # fmt: skip
    out, stats = collect(CountingVerifier(target), flaky, PROMPTS[0], plan)
    plain, _ = collect(LocalVerifier(target), None, PROMPTS[0], Plan(60, 0))
    assert out == plain and stats.drafter_failed and flaky.opens == 2
    # back, three empty answers and then garbage: a streak of its own, not 50 and more
    assert costs.fruitless_calls < 50


class OracleProposer:
    """Knows the continuation: drafts are always right, speculative context included."""

    kind, capture_layers, sends_draft_probs, accepts_speculative_ids = "oracle", (), False, True

    def __init__(self, full_sequence):
        self.full = full_sequence

    def open(self, context, rows):
        return list(context)

    def extend(self, state, new_ids, rows):
        state.extend(new_ids)

    def propose(self, state, k, sampling=None, speculative=(), tree=None):
        done = len(state) + len(speculative)
        return Proposal(self.full[done : done + k])


def test_overlap_drafts_the_next_block_during_verify(target):
    verifier = LocalVerifier(target)
    prompt = PROMPTS[0]
    plain, _ = collect(verifier, None, prompt, Plan(max_tokens=60, num_draft_tokens=0))
    oracle = LocalDrafter(OracleProposer(prompt + plain))
    out, stats = collect(verifier, oracle, prompt, Plan(60, 4, overlap=True))
    assert out == plain
    assert stats.predrafted_rounds >= stats.rounds // 2  # the bet holds every time here
    ngram = LocalDrafter(NgramProposer(NgramConfig(min_n=1)))
    out, _ = collect(verifier, ngram, prompt, Plan(60, 4, overlap=True))
    assert out == plain


class CountingVerifier(LocalVerifier):
    """Records the plain_steps of every verify call."""

    def __init__(self, target):
        super().__init__(target)
        self.calls = []

    async def verify(self, session_id, position, draft_ids, draft_probs, draft_parents=None,
                     plain_steps=0):  # fmt: skip
        self.calls.append((len(draft_ids), plain_steps))
        return await super().verify(
            session_id, position, draft_ids, draft_probs, draft_parents, plain_steps
        )


@pytest.mark.parametrize("burst", [1, 3, 8, 16])
def test_decode_bursts_without_a_drafter_equal_plain_rounds(target, burst):
    plain, _ = collect(LocalVerifier(target), None, PROMPTS[0], Plan(41, 0))
    verifier = CountingVerifier(target)
    out, stats = collect(verifier, None, PROMPTS[0], Plan(41, 0, decode_burst=burst))
    assert out == plain
    assert stats.rounds == len(out) - 1  # a round per target forward, bursts included
    # each burst: up to --decode-burst, and no longer than the output before it (at least 4)
    expected, produced = [], 1  # the prefill's token
    while produced < len(out):
        steps = min(burst, max(4, produced), 41 - produced)
        expected.append(steps if steps > 1 else 0)  # one token: a plain verify
        produced += steps
    assert [steps for _, steps in verifier.calls] == expected


def test_adaptive_bursts_stop_at_each_probe(target, monkeypatch):
    # adaptive k reads measured costs: a fake clock (each reading 10 ms later) makes the
    # choices, and so the probe waits, the same on any machine
    ticks = iter(range(10**9))
    monkeypatch.setattr("coordinator.rounds.time.perf_counter", lambda: next(ticks) * 0.01)
    plain, _ = collect(LocalVerifier(target), None, PROMPTS[2], Plan(90, 0))
    garbage = LocalDrafter(GarbageProposer(target.identity.vocab_size))
    adaptive = AdaptiveK(SpeculationCosts(), k_max=4, probe_every=8, probe_every_max=16)
    verifier = CountingVerifier(target)
    out, stats = collect(verifier, garbage, PROMPTS[2], Plan(90, 4, adaptive=adaptive,
                                                             decode_burst=5))  # fmt: skip
    assert out == plain
    assert any(steps > 1 for _, steps in verifier.calls)
    # plain tokens between two drafting rounds: exactly the probe wait (8, doubling to 16)
    runs, plain_run = [], 0
    for drafts, steps in verifier.calls:
        if drafts:
            runs.append(plain_run)
            plain_run = 0
        else:
            plain_run += max(steps, 1)
    waits = [r for r in runs if r]
    assert waits[:3] == [8, 16, 16], runs


class SilentProposer(GarbageProposer):
    """Proposes nothing for its first `silent` calls (an n-gram drafter without a match),
    then what `then` proposes."""

    def __init__(self, silent, then=None):
        self.silent, self.then, self.calls = silent, then, 0

    def open(self, context, rows):
        return self.then.open(context, rows) if self.then else None

    def extend(self, state, new_ids, rows):
        if self.then:
            self.then.extend(state, new_ids, rows)

    def propose(self, state, k, sampling=None, speculative=(), tree=None):
        self.calls += 1
        if self.calls <= self.silent or self.then is None:
            return Proposal([])
        return self.then.propose(state, k, sampling, speculative, tree)


def test_draft_calls_after_empty_ones_run_beside_growing_decode_bursts(target):
    plain, _ = collect(LocalVerifier(target), None, PROMPTS[2], Plan(41, 0))
    verifier = CountingVerifier(target)
    silent = LocalDrafter(SilentProposer(silent=10**9))
    plan = Plan(41, 4, decode_burst=4, draft_beside_decode=True)
    out, stats = collect(verifier, silent, PROMPTS[2], plan)
    assert out == plain
    # the first call finds nothing before drafting off's first burst (not a one-token
    # verify); each later one runs beside a burst one token longer than the last, up to
    # --decode-burst
    assert verifier.calls[:6] == [(0, 4), (0, 0), (0, 2), (0, 3), (0, 4), (0, 4)]
    # all but the first call ran beside a burst; after four empty answers in a row some
    # bursts ran without a call (DrafterLink.skip_call)
    assert stats.beside_calls == silent.proposer.calls - 1 < len(verifier.calls) - 2
    assert stats.draft_calls == silent.proposer.calls
    assert stats.rounds == len(out) - 1 and stats.drafted == 0
    serial = CountingVerifier(target)
    out, _ = collect(serial, LocalDrafter(SilentProposer(10**9)), PROMPTS[2], Plan(41, 4))
    assert out == plain and len(serial.calls) == len(out) - 1  # off: one token a call


def test_rounds_that_skip_the_drafter_decode_drafting_offs_bursts(target):
    """Past the empty-answer backoff a round that calls no drafter has nothing to wait for: it
    decodes a whole burst, so a drafter that keeps finding nothing costs few extra calls."""
    plain, _ = collect(LocalVerifier(target), None, PROMPTS[2], Plan(80, 0, decode_burst=16))
    verifier = CountingVerifier(target)
    silent = LocalDrafter(SilentProposer(silent=10**9))
    plan = Plan(80, 4, decode_burst=16, draft_beside_decode=True)
    out, stats = collect(verifier, silent, PROMPTS[2], plan)
    assert out == plain
    # the first round decodes drafting off's first burst (4); the calls beside bursts then grow
    # one token per empty answer (a 1-token verify, 2, 3, then 4 and 5), and past four empty
    # answers the rounds between calls (1, 2, then at most 4 skipped: DrafterLink.skip_call)
    # decode drafting off's bursts: as many tokens as are out (11), then 16
    assert [n for _, n in verifier.calls] == [4, 0, 2, 3, 11, 4, 16, 16, 5, 16, 0]
    assert silent.proposer.calls == 6 and stats.draft_calls == 6


class CompanyVerifier(CountingVerifier):
    """Answers as a verifier whose forwards also ran other sessions' rows (half of them)."""

    async def verify(self, *args, **kwargs):
        verified = await super().verify(*args, **kwargs)
        verified.share = 0.5
        return verified


def test_in_company_rounds_without_drafts_decode_drafting_offs_bursts(target, monkeypatch):
    """Under load a short call leaves its session out of the batched forwards that run while
    its answer travels: after empty answers, and between adaptive probes, a session whose
    forwards ran beside others decodes whole bursts, as drafting off does."""
    ticks = iter(range(10**9))  # adaptive k's costs from a fake clock, as above
    monkeypatch.setattr("coordinator.rounds.time.perf_counter", lambda: next(ticks) * 0.01)
    plain, _ = collect(LocalVerifier(target), None, PROMPTS[2], Plan(60, 0))
    produced, bursts = 1, []  # the prefill's token
    while produced < len(plain):
        bursts.append(min(8, max(4, produced), 60 - produced))  # drafting off's (_burst)
        produced += bursts[-1]
    for adaptive in (None, AdaptiveK(SpeculationCosts(), k_max=4)):
        alone, company = CountingVerifier(target), CompanyVerifier(target)
        plans = [Plan(60, 4, adaptive=adaptive, decode_burst=8, draft_beside_decode=True)
                 for _ in range(2)]  # fmt: skip
        out_alone, stats_alone = collect(alone, LocalDrafter(SilentProposer(10**9)), PROMPTS[2],
                                         plans[0])  # fmt: skip
        out, stats = collect(company, LocalDrafter(SilentProposer(10**9)), PROMPTS[2], plans[1])
        assert out == out_alone == plain
        # the first call's empty answer decodes drafting off's first burst; then alone the
        # bursts grow with the empty answers (1, 2, 3, ...), in company they are drafting
        # off's: as long as the output so far, up to 8
        assert [steps for _, steps in alone.calls][:4] == [4, 0, 2, 3]
        assert [steps for _, steps in company.calls] == bursts
        assert stats.verify_calls == len(company.calls) < len(alone.calls)
        assert stats.rounds == len(out) - 1 and stats.drafted == 0
        assert stats.forward_sessions == 2.0  # half of every forward's rows were its own
        assert stats_alone.forward_sessions == 1.0


class CountingOracle(OracleProposer):
    calls = 0

    def propose(self, *args, **kwargs):
        self.calls += 1
        return super().propose(*args, **kwargs)


def test_adaptive_k_drafts_nothing_while_the_coordinator_is_under_load(target, monkeypatch):
    """While Plan.under_load says so, an adapted session drafts nothing, even with drafts
    that are always right, and asks no drafter: drafting off's bursts. Once the load falls it
    drafts again."""
    ticks = iter(range(10**9))  # adaptive k's costs from a fake clock, as above
    monkeypatch.setattr("coordinator.rounds.time.perf_counter", lambda: next(ticks) * 0.01)
    prompt = PROMPTS[2]
    plain, _ = collect(LocalVerifier(target), None, prompt, Plan(90, 0))
    oracle = CountingOracle(prompt + plain)
    verifier = CountingVerifier(target)
    loaded = iter([False] + [True] * 5 + [False] * 1000)  # asked once a round
    asked = []  # (under load, drafter calls so far) at each round's start

    def under_load():
        asked.append((next(loaded), oracle.calls))
        return asked[-1][0]

    plan = Plan(90, 4, adaptive=AdaptiveK(SpeculationCosts(), k_max=4), decode_burst=8,
                draft_beside_decode=True, under_load=under_load)  # fmt: skip
    out, stats = collect(verifier, LocalDrafter(oracle), prompt, plan)
    assert out == plain
    calls = verifier.calls
    assert calls[0][0] > 0 and oracle.calls >= 1  # not loaded: it drafted
    loaded_calls = calls[1:6]
    assert not any(drafts for drafts, _ in loaded_calls)  # loaded: drafting off's bursts
    # drafting off's bursts: as long as the output so far (4 at least), up to 8
    assert [steps for _, steps in loaded_calls] == [4, 8, 8, 8, 8]
    assert asked[1][1] == asked[6][1] > 0  # no drafter call in the loaded rounds
    assert any(drafts for drafts, _ in calls[6:])  # the load fell: it drafts again
    assert stats.accepted > 0


def test_without_a_load_signal_adapted_sessions_draft(target, monkeypatch):
    ticks = iter(range(10**9))
    monkeypatch.setattr("coordinator.rounds.time.perf_counter", lambda: next(ticks) * 0.01)
    prompt = PROMPTS[2]
    plain, _ = collect(LocalVerifier(target), None, prompt, Plan(60, 0))
    oracle = CountingOracle(prompt + plain)
    plan = Plan(60, 4, adaptive=AdaptiveK(SpeculationCosts(), k_max=4), decode_burst=8,
                draft_beside_decode=True, under_load=lambda: False)  # fmt: skip
    out, stats = collect(CountingVerifier(target), LocalDrafter(oracle), prompt, plan)
    assert out == plain and oracle.calls > 1 and stats.accepted > 0


def test_in_company_probes_of_a_text_drafter_run_beside_bursts(target, monkeypatch):
    """Under load a probe's own verify call would commit a token or two for a whole wait for
    the batched forwards: a drafter that needs no hidden rows is asked beside a burst instead,
    and its wrong guesses still count against it. Alone, probes verify their drafts."""
    ticks = iter(range(10**9))  # adaptive k's costs from a fake clock, as above
    monkeypatch.setattr("coordinator.rounds.time.perf_counter", lambda: next(ticks) * 0.01)
    plain, _ = collect(LocalVerifier(target), None, PROMPTS[2], Plan(90, 0))
    runs = {}
    for verifier in (CountingVerifier(target), CompanyVerifier(target)):
        adaptive = AdaptiveK(SpeculationCosts(), k_max=4, probe_every=8, probe_every_max=16)
        garbage = LocalDrafter(GarbageProposer(target.identity.vocab_size))
        plan = Plan(90, 4, adaptive=adaptive, decode_burst=8, draft_beside_decode=True)
        out, stats = collect(verifier, garbage, PROMPTS[2], plan)
        assert out == plain
        runs[type(verifier)] = verifier.calls, stats, adaptive
    (alone, alone_stats, _), (company, stats, adaptive) = runs.values()
    # adaptive k drafts at first (its prior), then only probes once the drafts fail
    first_plain = next(i for i, (drafts, _) in enumerate(company) if not drafts)
    assert any(drafts for drafts, _ in alone[first_plain:])  # alone, probes verify drafts
    assert not any(drafts for drafts, _ in company[first_plain:])
    assert stats.beside_calls > alone_stats.beside_calls == 0
    assert len(company) < len(alone)
    assert adaptive.acceptance < 0.2  # the guesses beside the bursts were judged, and wrong


class RowsReadingGarbageProposer(GarbageProposer):
    """Wrong drafts from a drafter that reads the target's hidden rows, as a model drafter
    does (its rows are sent on with every call)."""

    capture_layers = (0,)


@pytest.mark.parametrize("fruitless", [0, 20])
def test_a_model_drafters_probes_run_beside_bursts_and_cost_no_call_of_their_own(
    target, monkeypatch, fruitless
):
    """A model drafter's probe would cost two round trips (its draft call, then a short verify
    of its own) every probe wait while it does not pay: asked beside a burst of drafting off's
    length instead, its guess is judged against the burst's tokens, and a long streak of
    fruitless calls does not skip it (adaptive k's probe wait alone spaces them)."""
    ticks = iter(range(10**9))  # adaptive k's costs from a fake clock, as above
    monkeypatch.setattr("coordinator.rounds.time.perf_counter", lambda: next(ticks) * 0.01)
    plain, _ = collect(LocalVerifier(target), None, PROMPTS[2], Plan(90, 0, decode_burst=8))
    runs = []
    for beside in (True, False):
        verifier = CountingVerifier(target)
        costs = SpeculationCosts()
        costs.fruitless_calls = fruitless  # calls of earlier requests that found nothing
        adaptive = AdaptiveK(costs, k_max=4, probe_every=8, probe_every_max=16)
        drafter = LocalDrafter(RowsReadingGarbageProposer(target.identity.vocab_size))
        plan = Plan(90, 4, adaptive=adaptive, decode_burst=8, draft_beside_decode=beside)
        out, stats = collect(verifier, drafter, PROMPTS[2], plan)
        assert out == plain
        runs.append((verifier.calls, stats, adaptive))
    (calls, stats, adaptive), (serial_calls, serial_stats, _) = runs
    # adaptive k drafts at first (its prior), then only probes once the drafts fail
    first_plain = next(i for i, (drafts, _) in enumerate(calls) if not drafts)
    assert not any(drafts for drafts, _ in calls[first_plain:])
    assert stats.beside_calls >= 3 and serial_stats.beside_calls == 0
    assert any(drafts for drafts, _ in serial_calls[first_plain:])  # serial: probes verify
    assert adaptive.acceptance < 0.2  # the guesses beside the bursts were judged, and wrong
    assert len(calls) < len(serial_calls)
    # every call but the last decodes a burst: no probe is a call of one token
    assert all(steps > 1 for _, steps in calls[first_plain:-1]), calls


def test_a_bursts_time_beside_a_draft_call_is_its_own(target, monkeypatch):
    """The burst beside a draft call prices plain steps, so its time must not hold the call's:
    an in-process drafter (`--in-process`, the tests) runs its call to the end first."""
    from coordinator.rounds import DrafterLink, _decode_beside_draft

    now = [0.0]
    monkeypatch.setattr("coordinator.rounds.time.perf_counter", lambda: now[0])

    class SlowProposer(RowsReadingGarbageProposer):
        def propose(self, *args, **kwargs):
            now[0] += 1.0  # the call takes a second of the fake clock
            return super().propose(*args, **kwargs)

    async def go():
        verifier = LocalVerifier(target)
        opened = await verifier.open(PROMPTS[2], (0,), None)
        link = DrafterLink(LocalDrafter(SlowProposer(target.identity.vocab_size)), RoundStats())
        link.open(PROMPTS[2] + [opened.first_token], opened.rows)
        await link.opened()  # as in a later round: the call starts at once
        return await _decode_beside_draft(
            verifier, link, opened.session_id, len(PROMPTS[2]) + 1, 4, 3, None
        )

    verified, guess, decode_s, guess_s = asyncio.run(go())
    assert len(verified.committed) == 4 and len(guess.ids) == 3
    assert guess_s == pytest.approx(1.0) and decode_s < 0.5


class SampledRowsReadingProposer(RowsReadingGarbageProposer):
    """As above, its sampled drafts drawn from a q it sends (as DFlash's are)."""

    sends_draft_probs = True


@pytest.mark.parametrize("q_rows", [True, False])
def test_a_sampled_requests_probes_beside_bursts_only_where_drafts_are_one_hot(
    target, monkeypatch, q_rows
):
    """A guess drawn from a drafter's q matches a sampled token less often than a verify
    accepts it, so such a drafter's probes keep their verify in a sampled request; one that
    drafts by argmax (EAGLE-3) is judged alike either way, and probes beside bursts."""
    from specd.v1 import common_pb2

    ticks = iter(range(10**9))  # adaptive k's costs from a fake clock, as above
    monkeypatch.setattr("coordinator.rounds.time.perf_counter", lambda: next(ticks) * 0.01)
    monkeypatch.setattr(target, "eos_ids", set())  # a sampled reply runs to its probes
    verifier = CountingVerifier(target)
    adaptive = AdaptiveK(SpeculationCosts(), k_max=4, probe_every=8, probe_every_max=16)
    kind = SampledRowsReadingProposer if q_rows else RowsReadingGarbageProposer
    drafter = LocalDrafter(kind(target.identity.vocab_size))
    sampling = common_pb2.SamplingParams(temperature=0.8, seed=0)
    plan = Plan(90, 4, sampling, adaptive=adaptive, decode_burst=8, draft_beside_decode=True)
    out, stats = collect(verifier, drafter, PROMPTS[2], plan)
    assert len(out) == 90
    first_plain = next(i for i, (drafts, _) in enumerate(verifier.calls) if not drafts)
    probes_verified = any(drafts for drafts, _ in verifier.calls[first_plain:])
    assert probes_verified == q_rows
    assert (stats.beside_calls > 0) == (not q_rows)


def test_after_fruitless_calls_the_drafter_is_asked_every_few_rounds():
    from coordinator.rounds import EMPTY_BACKOFF_AFTER, DrafterLink

    link = DrafterLink(drafter=None, stats=RoundStats())
    link.fruitless_calls = EMPTY_BACKOFF_AFTER - 1
    assert not link.skip_call()  # before the backoff every round asks
    link.judged(0)  # drafts wrong from the first count as a call that found nothing
    rounds = ""
    for _ in range(15):  # S: a round without a call; C: a call, and it finds nothing again
        if link.skip_call():
            rounds += "S"
        else:
            rounds += "C"
            link.fruitless_calls += 1
            link.calls_skipped = 0  # as DrafterLink.draft does
    assert rounds == "SCSSCSSSSCSSSSC"  # 1, 2, then at most 4 rounds between calls
    link.judged(2)  # an answer the target kept some of: every round asks again
    assert link.fruitless_calls == 0 and not link.skip_call()


def test_a_request_starts_from_the_fruitless_streak_the_last_one_left(target):
    """With adaptive k the drafter's streak of calls that gave nothing kept is shared by the
    coordinator's requests: after a request in which it found nothing, the next one does not
    begin again with bursts of one token beside its calls, and one that finds drafts resets it."""
    from coordinator.adaptive import AdaptiveK, SpeculationCosts

    plain, _ = collect(LocalVerifier(target), None, PROMPTS[2], Plan(80, 0, decode_burst=16))
    costs = SpeculationCosts()
    calls = []
    for _ in range(2):
        verifier = CountingVerifier(target)
        plan = Plan(80, 4, adaptive=AdaptiveK.for_session(costs, 4, text_driven=True),
                    decode_burst=16, draft_beside_decode=True)  # fmt: skip
        out, _ = collect(verifier, LocalDrafter(SilentProposer(silent=10**9)), PROMPTS[2], plan)
        assert out == plain
        calls.append([n for _, n in verifier.calls])
    # the first request's bursts beside its calls grow from one token (a verify of one, then
    # 2, 3, ...); the next one's start where the first left off: none under drafting off's
    # first burst, fewer calls (here 11, then 8)
    assert {0, 2, 3} <= set(calls[0][:6]) and costs.fruitless_calls > 4
    assert min(calls[1][:-1]) >= 4 and len(calls[1]) < len(calls[0])
    oracle = LocalDrafter(OracleProposer(PROMPTS[2] + plain))
    plan = Plan(80, 4, adaptive=AdaptiveK.for_session(costs, 4, text_driven=True),
                decode_burst=16, draft_beside_decode=True)  # fmt: skip
    out, stats = collect(CountingVerifier(target), oracle, PROMPTS[2], plan)
    assert out == plain and stats.accepted > 0 and costs.fruitless_calls == 0


class RarelyWrongProposer(GarbageProposer):
    """Proposes nothing but on every `every`-th call, and then tokens the target never
    chooses (an n-gram drafter's rare matches that miss, as on MT-bench)."""

    def __init__(self, every):
        super().__init__(vocab=1)
        self.every, self.calls = every, 0

    def propose(self, state, k, sampling=None, speculative=(), tree=None):
        self.calls += 1
        return Proposal([] if self.calls % self.every else [10**6] * k)


def test_proposals_the_target_rejects_do_not_restart_the_bursts_at_one_token(target):
    """After empty answers a lone session's bursts grow with the calls that gave it nothing;
    an answer whose drafts (or guess beside a burst) are wrong from the first is one of them,
    so a drafter that rarely proposes, and wrongly, costs few calls more than drafting off."""
    plain, _ = collect(LocalVerifier(target), None, PROMPTS[2], Plan(80, 0, decode_burst=16))
    verifier = CountingVerifier(target)
    drafter = LocalDrafter(RarelyWrongProposer(every=3))
    plan = Plan(80, 4, decode_burst=16, draft_beside_decode=True)
    out, stats = collect(verifier, drafter, PROMPTS[2], plan)
    assert out == plain and stats.accepted == 0
    bursts = [n for _, n in verifier.calls]
    # the first burst (4), then one and two tokens beside the first calls; past the wrong guess
    # of the third call the bursts go on growing (wrong answers count as empty ones) and the
    # backoff's rounds decode whole bursts: 11 calls for 80 tokens, where restarting at one
    # token after each wrong answer took 57, one a token and a half
    assert bursts[:3] == [4, 0, 2], bursts
    assert min(bursts[3:-1]) >= 4 and len(verifier.calls) <= 12, bursts


def test_a_guess_made_beside_a_burst_drafts_the_next_round_when_the_burst_matches(target):
    prompt = PROMPTS[0]
    plain, _ = collect(LocalVerifier(target), None, prompt, Plan(60, 0))
    oracle = OracleProposer(prompt + plain)
    verifier = CountingVerifier(target)
    drafter = LocalDrafter(SilentProposer(silent=3, then=oracle))
    plan = Plan(60, 6, decode_burst=3, draft_beside_decode=True)
    out, stats = collect(verifier, drafter, prompt, plan)
    assert out == plain
    # the 4th call guessed right beside a burst of 3: its other 3 drafts were verified next
    # round without a call, and drafting went on as usual after that
    assert stats.beside_calls == 3 and stats.predrafted_rounds == 1
    assert verifier.calls[:5] == [(0, 3), (0, 0), (0, 2), (0, 3), (3, 0)]
    assert stats.accepted == stats.drafted > 3


class WaitingVerifier(LocalVerifier):
    """Its verify starts by setting `started`, so a drafter can tell it is running."""

    started: asyncio.Event

    async def verify(self, *args, **kwargs):
        self.started.set()
        await asyncio.sleep(0)
        return await super().verify(*args, **kwargs)


class WaitingDrafter(LocalDrafter):
    """Answers only once the verifier is working: a call made before the verify starts
    times out, and the round loop counts a drafter fault."""

    def __init__(self, proposer, verifier):
        super().__init__(proposer)
        self.verifier = verifier
        self.waited = 0

    async def draft(self, *args):
        if self.proposer.calls >= 1:  # the first call is made before any burst
            self.verifier.started.clear()
            await asyncio.wait_for(self.verifier.started.wait(), timeout=5)
            self.waited += 1
        return await super().draft(*args)


def test_a_draft_call_beside_a_burst_runs_while_the_verifier_decodes(target):
    plain, _ = collect(LocalVerifier(target), None, PROMPTS[2], Plan(30, 0))

    async def go():
        verifier = WaitingVerifier(target)
        verifier.started = asyncio.Event()
        drafter = WaitingDrafter(SilentProposer(silent=10**9), verifier)
        plan = Plan(30, 4, decode_burst=4, draft_beside_decode=True, drafter_retry_s=60)
        stats, out = RoundStats(), []
        async for ids, _ in run_rounds(verifier, drafter, PROMPTS[2], plan, stats):
            out.extend(ids)
        return out, stats, drafter

    out, stats, drafter = asyncio.run(go())
    assert out == plain
    assert not stats.drafter_failed and drafter.waited == stats.beside_calls > 3


def test_a_guess_beside_a_burst_is_evidence_as_drafts_would_be():
    from coordinator.rounds import Verified, _learn_beside

    adaptive = AdaptiveK(SpeculationCosts(), k_max=4)
    adaptive.costs.draft.observe(1, 0.001)  # drafts of one, priced twice: their own mean
    adaptive.costs.draft.observe(1, 0.001)
    successes, trials = adaptive.successes, adaptive.trials
    burst = Verified(committed=[5, 6, 7], num_accepted=0, finished=False, rows=None)
    # a probe (k = 1) whose call asked for 4: two of the burst's three tokens guessed, then a
    # miss: two successes in three trials
    _learn_beside(adaptive, 1, 4, Drafted([5, 6, 9, 9]), burst, 2, decode_s=0.03, guess_s=0.002)
    assert adaptive.successes == pytest.approx(successes * adaptive.decay + 2)
    assert adaptive.trials == pytest.approx(trials * adaptive.decay + 3)
    # each burst token prices a plain step; the call prices a draft of the 4 it asked for
    assert adaptive.costs.verify.predict(1) == pytest.approx(0.01, rel=0.3)
    assert adaptive.costs.draft.predict(4) == pytest.approx(0.002, rel=0.01)
    assert adaptive.costs.draft.predict(1) == pytest.approx(0.001)  # not the probe's k
    # an empty guess says nothing; no call made (drafter down) prices nothing
    successes, trials = adaptive.successes, adaptive.trials
    _learn_beside(adaptive, 4, 4, Drafted([]), burst, 0, decode_s=0.03, guess_s=None)
    assert (adaptive.successes, adaptive.trials) == (successes, trials)


class ScriptedK(AdaptiveK):
    """Chooses k from a script, then 1."""

    script: list

    def choose(self, limit: int) -> int:
        self.probing, self.tree_shape = False, None
        return min(self.script.pop(0) if self.script else 1, limit)


def test_drafts_carried_from_a_guess_do_not_outlive_a_round_without_drafts(target):
    prompt = PROMPTS[0]
    plain, _ = collect(LocalVerifier(target), None, prompt, Plan(30, 0))
    oracle = SilentProposer(silent=1, then=OracleProposer(prompt + plain))
    verifier = CountingVerifier(target)
    # round 1: nothing found; 2: a right guess beside a 1-token burst, its tail carried;
    # 3: k = 0, a plain step; 4: drafts again, and must ask for them at the new position
    adaptive = ScriptedK(SpeculationCosts(), k_max=4)
    adaptive.script = [4, 4, 0, 4]
    plan = Plan(30, 4, adaptive=adaptive, decode_burst=4, draft_beside_decode=True)
    out, stats = collect(verifier, LocalDrafter(oracle), prompt, plan)
    assert out == plain
    assert verifier.calls[:4] == [(0, 4), (0, 0), (0, 4), (4, 0)]
    assert oracle.calls >= 3 and stats.predrafted_rounds == 0
    assert stats.accepted == stats.drafted  # the oracle's drafts: never a stale one


class SlowOpeningDrafter(LocalDrafter):
    """Its open waits until released, as a drafter warming up or far away does; it records
    the verifier's calls made before the open finished."""

    def __init__(self, proposer, verifier):
        super().__init__(proposer)
        self.verifier, self.release = verifier, asyncio.Event()
        self.calls_before_open = None

    async def open(self, context_ids, rows):
        context = list(context_ids)
        await self.release.wait()
        self.calls_before_open = len(self.verifier.calls)
        return await super().open(context, rows)


def test_rounds_that_draft_nothing_go_on_while_the_drafter_opens(target):
    """The drafter's session opens in the background: adaptive k's plain rounds run
    meanwhile, the first draft call waits for it, and the tokens committed in between reach
    the drafter once, as the first call's news (the oracle's drafts are then all right)."""
    prompt = PROMPTS[0]
    plain, _ = collect(LocalVerifier(target), None, prompt, Plan(40, 0))
    verifier = CountingVerifier(target)
    drafter = SlowOpeningDrafter(OracleProposer(prompt + plain), verifier)
    adaptive = ScriptedK(SpeculationCosts(), k_max=4)
    adaptive.script = [0, 0, 0, 4, 4]

    plan = Plan(40, 4, adaptive=adaptive, decode_burst=4)

    async def go():
        stats, out = RoundStats(), []
        async for ids, _finished in run_rounds(verifier, drafter, prompt, plan, stats):
            out.extend(ids)
            if len(verifier.calls) == 3:
                drafter.release.set()
        return out, stats

    out, stats = asyncio.run(asyncio.wait_for(go(), 60))  # an open awaited first never ends
    assert out == plain
    assert drafter.calls_before_open == 3  # three plain bursts ran while it opened
    assert verifier.calls[3][0] == 4 and stats.drafted > 0
    assert stats.accepted == stats.drafted  # its context: the prompt, then each token once
    assert not drafter.sessions  # closed at the end


def test_a_shared_forward_prices_a_verify_at_the_rounds_share():
    """A verify the verifier ran together with other sessions' costs adaptive k its share of
    the forward (its rows over all rows), not the whole forward's wall time."""
    from coordinator.rounds import Round, Verified, _learn_round

    def priced(share: float) -> float:
        adaptive = AdaptiveK(SpeculationCosts(), k_max=4)
        for _ in range(40):
            played = Round(k=3, start=0.0, drafted=Drafted([5, 6, 7]), called_drafter=True)
            played.verified = Verified([5, 6, 7, 8], 3, False, None, share=share)
            played.draft_done, played.verify_done = 0.01, 0.09  # 80 ms of wall time
            _learn_round(adaptive, played)
        return adaptive.costs.verify.predict(4)

    assert priced(1.0) == pytest.approx(0.08, rel=0.05)
    assert priced(0.25) == pytest.approx(0.02, rel=0.05)


class ScoredTreeProposer:
    """Trees of the target's own next tokens (a line of `depth`, each node sure of itself),
    each with a sibling it gives almost nothing, scored as a tree drafter scores them."""

    kind, capture_layers, sends_draft_probs, accepts_speculative_ids = "scored", (), False, False
    default_draft_tokens = 3

    def __init__(self, reply: list[int], prompt_len: int, depth: int = 3):
        self.reply, self.prompt_len, self.depth = reply, prompt_len, depth
        self.position = prompt_len

    def open(self, context, rows):
        self.position = len(context)

    def extend(self, state, new_ids, rows):
        self.position += len(new_ids)

    def propose(self, state, k, sampling=None, speculative=(), tree=None):
        at = self.position - self.prompt_len  # the reply's tokens committed so far
        line = self.reply[at : at + self.depth]
        ids, parents, scores = [], [], []
        for d, token in enumerate(line):
            parent = -1 if d == 0 else 2 * (d - 1)
            ids += [token, (token + 1) % 50]
            parents += [parent, parent]
            scores += [math.log(0.9) * (d + 1), math.log(0.9) * d + math.log(1e-9)]
        return Proposal(ids, parents=parents, scores=scores)


class FixedPrices:
    """A verify of t tokens costs 1 + t / 2 (seconds, say), whatever the rounds measure."""

    def predict(self, tokens):
        return 1.0 + tokens / 2

    def observe(self, tokens, seconds):
        pass


def test_pinned_trees_cut_at_the_measured_prices_equal_plain_rounds(target):
    prompt = PROMPTS[2]
    verifier = CountingVerifier(target)
    plain, _ = collect(verifier, None, prompt, Plan(max_tokens=30, num_draft_tokens=0))
    # the drafter opens on the prompt and the prefill's first token; the reply goes on after
    proposer = ScoredTreeProposer(plain[1:], len(prompt) + 1)
    verifier.calls.clear()
    plan = Plan(max_tokens=30, num_draft_tokens=3, tree_prices=FixedPrices())
    cut, stats = collect(verifier, LocalDrafter(proposer), prompt, plan)
    assert cut == plain
    # at these prices the line of three (0.9, 0.81, 0.73) pays and no 1e-9 sibling does: every
    # round verifies the three drafts the target takes, the last one what is left
    assert [n for n, _ in verifier.calls][:-1] == [3] * (len(verifier.calls) - 1)
    assert stats.accepted == 3 * (len(verifier.calls) - 1)
    proposer.position = len(prompt) + 1
    learned = CountingVerifier(target)  # prices the rounds measure: the output is the same
    out, _ = collect(learned, LocalDrafter(proposer), prompt,
                     Plan(max_tokens=30, num_draft_tokens=3,
                          tree_prices=LinearCost(base=0.06, per_token=0.006)))  # fmt: skip
    assert out == plain and max(n for n, _ in learned.calls) <= 6
    whole_verifier = CountingVerifier(target)
    proposer.position = len(prompt) + 1
    whole, _ = collect(whole_verifier, LocalDrafter(proposer), prompt,
                       Plan(max_tokens=30, num_draft_tokens=3))  # fmt: skip
    assert whole == plain
    assert max(n for n, _ in whole_verifier.calls) == 6  # without prices: every node sent


def test_rounds_ahead_goes_on_while_the_reader_is_busy_and_stops_when_closed():
    """rounds_ahead: the next round starts while the reader still holds the last one's tokens
    (a client's write); an error is raised to the reader after the items before it; closing
    it early cancels the round in flight and returns once the rounds' cleanup has run."""
    from contextlib import aclosing

    from coordinator.rounds import rounds_ahead

    events: list[str] = []
    third_started = asyncio.Event()

    async def rounds():
        try:
            for i in range(3):
                if i == 2:
                    third_started.set()
                    await asyncio.sleep(3600)  # a call in flight
                events.append(f"round {i}")
                yield [i], False
        finally:
            events.append("sessions closed")

    async def read_slowly():
        async with aclosing(rounds_ahead(rounds())) as ahead:
            async for ids, _finished in ahead:
                events.append(f"read {ids[0]}")
                if ids == [0]:  # the reader busy with its client until the rounds go on
                    await asyncio.wait_for(third_started.wait(), 5)
                if ids == [1]:
                    break
        events.append("closed")

    asyncio.run(read_slowly())
    assert events == ["round 0", "round 1", "read 0", "read 1", "sessions closed", "closed"]

    async def read_all(ahead):
        got = []
        with pytest.raises(RuntimeError, match="went away"):
            async for ids, _finished in ahead:
                got.append(ids)
        return got

    async def rounds_failing():
        yield [0], False
        yield [1], False
        raise RuntimeError("the verifier went away")

    assert asyncio.run(read_all(rounds_ahead(rounds_failing()))) == [[0], [1]]


def test_rounds_ahead_cancelled_from_outside_ends_its_reader_cancelled():
    """The rounds' task cancelled by anyone but the reader (the loop shutting down) leaves no
    reader waiting for an item that cannot come."""
    from coordinator.rounds import rounds_ahead

    async def rounds():
        yield [0], False
        await asyncio.sleep(3600)
        yield [1], False

    async def read(got: list):
        async for ids, _finished in rounds_ahead(rounds()):
            got.append(ids)
            tasks = asyncio.all_tasks()
            next(t for t in tasks if t.get_coro().__name__ == "produce").cancel()

    async def main():
        got: list = []
        reader = asyncio.ensure_future(read(got))
        done, _ = await asyncio.wait({reader}, timeout=5)
        ended_cancelled = reader in done and reader.cancelled()
        reader.cancel()
        return got, ended_cancelled

    assert asyncio.run(main()) == ([[0]], True)


def test_a_fault_is_no_empty_answer_and_the_re_open_runs_beside_a_burst(target):
    """The round that finds the drafter due again after a fault re-opens its session beside a
    decode burst, as after an empty answer, so the re-open costs no wait."""
    prompt = PROMPTS[0]
    plain, _ = collect(LocalVerifier(target), None, prompt, Plan(max_tokens=40, num_draft_tokens=0))
    flaky = FlakyDrafter(OracleProposer(prompt + plain), failures=1)
    plan = Plan(40, 3, decode_burst=8, draft_beside_decode=True, drafter_retry_s=0.0)
    out, stats = collect(CountingVerifier(target), flaky, prompt, plan)
    assert out == plain and stats.drafter_failed and flaky.opens == 2
    assert stats.beside_calls == 1  # the re-open; the oracle's answers are never empty
    assert stats.accepted > 0


def test_a_faulted_draft_call_is_no_empty_answer():
    """A fault is no answer: it counts as a call the target kept nothing of, but the streak of
    empty answers (what sends the next call beside a burst) stays as it was."""
    from coordinator.rounds import DrafterLink

    async def go():
        link = DrafterLink(FlakyDrafter(NgramProposer(), failures=1), RoundStats(), retry_s=0.0)
        link.open([3, 4, 5, 3, 4], None)
        return link, await link.draft(5, 4, None)

    link, drafted = asyncio.run(go())
    assert drafted.ids == [] and link.retry_at is not None  # down until its retry
    assert (link.empty_answers, link.fruitless_calls) == (0, 1)
