"""The round loop: draft, verify, commit. Pure: talks to two ports, knows no transport."""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from coordinator.adaptive import AdaptiveK, LinearCost, priced_cut

log = logging.getLogger("specd.rounds")


@dataclass
class Opened:
    session_id: str
    first_token: int
    finished: bool
    rows: Any  # [len(prompt), L*H] in the port's own form, passed through untouched
    compute_s: float = 0.0


@dataclass
class Verified:
    committed: list[int]
    num_accepted: int
    finished: bool
    rows: Any  # [1 + num_accepted, L*H]
    compute_s: float = 0.0
    share: float = 1.0  # its part of forwards the verifier shared with other sessions


@dataclass
class Drafted:
    ids: list[int]
    probs: Any = None  # [len(ids), vocab] or None for one-hot drafters
    compute_s: float = 0.0
    parents: list[int] | None = None  # a draft tree (see VerifyRequest.draft_parents)
    scores: list[float] | None = None  # a tree's path log-probabilities (DraftResponse)


class VerifierPort(Protocol):
    async def open(self, prompt_ids: list[int], capture_layers, sampling) -> Opened: ...
    async def verify(
        self,
        session_id: str,
        position: int,
        draft_ids,
        draft_probs,
        draft_parents=None,
        plain_steps: int = 0,
    ) -> Verified: ...
    async def close(self, session_id: str) -> None: ...


class DrafterPort(Protocol):
    capture_layers: tuple[int, ...]
    sends_draft_probs: bool  # a sampled request's drafts are drawn from q (and q is sent)

    async def open(self, context_ids: list[int], rows) -> str: ...
    async def draft(
        self,
        session_id: str,
        position: int,
        new_ids,
        rows: list,
        k: int,
        sampling,
        speculative_ids=(),
        tree=None,
    ) -> Drafted: ...
    async def close(self, session_id: str) -> None: ...


@dataclass
class Plan:
    max_tokens: int
    num_draft_tokens: int  # k, or the most k when adaptive; 0 = verify-only rounds
    sampling: Any = None
    adaptive: AdaptiveK | None = None  # None: k is pinned
    drafter_retry_s: float = 1.0  # after a drafter fault, verify-only rounds this long
    overlap: bool = False  # draft the next block while the verify runs, assuming acceptance
    tree: Any = None  # TreeShape asked of a tree drafter; None: the drafter's default
    decode_burst: int = 1  # tokens one verify call may decode when no drafts are wanted
    # after a drafter call that proposed nothing, ask the next one beside a decode burst (its
    # answer is matched as a chain: not for a drafter whose default is a tree)
    draft_beside_decode: bool = False
    # adaptive k drafts nothing while this says the coordinator is under load (None: never)
    under_load: Callable[[], bool] | None = None
    # a drafted tree is cut to the nodes worth their verify at these prices (`cut_at_prices`):
    # adaptive k's, or, k pinned, the coordinator's own, learned from the rounds; None: whole
    tree_prices: LinearCost | None = None


class RoundTime(NamedTuple):
    """Seconds of one round: RPC walls, the compute the services report inside them, and all."""

    draft: float
    verify: float
    total: float
    draft_compute: float = 0.0
    verify_compute: float = 0.0

    @property
    def outside_forwards(self) -> float:
        """RPC, serialization, scheduling and the coordinator's own work."""
        return max(0.0, self.total - self.draft_compute - self.verify_compute)


@dataclass
class RoundStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    verify_compute_s: float = 0.0
    draft_compute_s: float = 0.0
    total_s: float = 0.0
    drafter_failed: bool = False
    predrafted_rounds: int = 0  # rounds whose drafts were ready before the round began
    draft_calls: int = 0  # drafter calls it answered
    beside_calls: int = 0  # drafter calls made beside a decode burst (draft_beside_decode)
    # per verifier call, its forwards' rows over its own (1 / Verified.share), summed: about
    # how many sessions' rounds ran in each forward it took part in
    forward_sessions_sum: float = 0.0
    round_times: list[RoundTime] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.rounds if self.rounds else 0.0

    @property
    def verify_calls(self) -> int:
        """Verifier calls after the prefill: one timing is kept per call."""
        return len(self.round_times)

    @property
    def forward_sessions(self) -> float:
        """Sessions sharing a forward with this request's verifier calls, on average (1.0
        when every call ran alone): whether the verifier batched it under load."""
        return self.forward_sessions_sum / self.verify_calls if self.verify_calls else 1.0

    @property
    def coordinator_s(self) -> float:
        return max(0.0, self.total_s - self.prefill_s - self.draft_s - self.verify_s)

    @property
    def overhead_median_s(self) -> float:
        """Median over rounds of the time outside the draft and verify compute."""
        if not self.round_times:
            return 0.0
        return statistics.median(t.outside_forwards for t in self.round_times)


EMPTY_BACKOFF_AFTER = 4  # empty answers in a row before rounds skip the drafter
EMPTY_BACKOFF_MAX = 4  # rounds skipped at most between two calls


class DrafterLink:
    """The drafter side of one request: its session, what it has not heard yet, its faults.

    A failing drafter only costs speed: rounds go on without drafts, and after `retry_s` the
    session is re-opened from the committed tokens (and, for drafters that read target hidden
    rows, every row the verifier has sent, which this link keeps for that purpose).
    """

    def __init__(self, drafter: DrafterPort, stats: RoundStats, retry_s: float = 1.0):
        self.drafter = drafter
        self.stats = stats
        self.retry_s = retry_s
        self.session: str | None = None
        self.context: list[int] = []  # prompt + committed: the source of truth
        self.pending_ids: list[int] = []  # committed since the drafter last heard
        self.pending_rows: list = []
        self.retry_at: float | None = None  # set while the drafter is down
        self.carried: Drafted | None = None  # next block, drafted while the last verify ran
        self.empty_answers = 0  # drafter calls in a row that proposed nothing
        # drafter calls in a row the target kept nothing of: no draft, or drafts (a guess beside
        # a burst) wrong from the first; after empty answers they set the bursts and the backoff,
        # so a drafter whose rare proposals miss does not restart its bursts at one token
        self.fruitless_calls = 0
        self.calls_skipped = 0  # rounds in a row decoded without asking, after empty answers
        self.all_rows: list = []  # rows of every verified position, for a re-open
        self.opening: asyncio.Future | None = None  # the session's open, while in flight

    def open(self, context_ids: list[int], rows) -> None:
        """Open the drafter's session in the background: rounds that draft nothing (adaptive
        k's first plain bursts) go on meanwhile, and the first draft call waits for it."""
        self.context = list(context_ids)
        if self.drafter.capture_layers:
            self.all_rows = [rows]
        self.opening = asyncio.ensure_future(self._open(rows, list(self.context)))

    async def _open(self, rows, context: list[int]) -> None:
        try:
            self.session = await self.drafter.open(context, rows)
        except Exception as exc:  # noqa: BLE001 - any drafter fault only costs speed
            self._down(exc)

    async def opened(self) -> None:
        """The background open, done (the session, or the drafter down)."""
        if self.opening is not None:
            opening, self.opening = self.opening, None
            await opening

    def commit(self, ids: list[int], rows) -> None:
        self.context.extend(ids)
        self.pending_ids.extend(ids)
        self.pending_rows.append(rows)
        if self.drafter.capture_layers:
            self.all_rows.append(rows)

    async def draft(
        self, position: int, k: int, sampling, speculative_ids=(), tree=None
    ) -> Drafted:
        drafted = await self._draft(position, k, sampling, speculative_ids, tree)
        self.calls_skipped = 0
        if drafted is None:  # down or faulted: a call the target kept nothing of, no answer
            self.fruitless_calls += 1
            return Drafted([])
        self.empty_answers = 0 if drafted.ids else self.empty_answers + 1
        if not drafted.ids:
            self.fruitless_calls += 1  # an answer with drafts counts once judged (`judged`)
        return drafted

    def judged(self, kept: int) -> None:
        """An answer's drafts (or guess) met the target's tokens: `kept` of them right in a
        row."""
        self.fruitless_calls = 0 if kept else self.fruitless_calls + 1

    @property
    def down(self) -> bool:
        """Failed, and not yet due to be tried again: a round has no call to make."""
        return self.retry_at is not None and time.perf_counter() < self.retry_at

    def skip_call(self) -> bool:
        """After EMPTY_BACKOFF_AFTER fruitless calls in a row, ask only every few rounds (1, 2,
        then EMPTY_BACKOFF_MAX rounds skipped between calls): an answer that finds nothing
        still costs a call, and under load the CPU it takes from the verifier."""
        over = self.fruitless_calls - EMPTY_BACKOFF_AFTER
        if over < 0 or self.calls_skipped >= min(2**over, EMPTY_BACKOFF_MAX):
            return False
        self.calls_skipped += 1
        return True

    async def _draft(
        self, position: int, k: int, sampling, speculative_ids, tree
    ) -> Drafted | None:
        """The drafter's answer; None where it gave none (down, or failing now)."""
        await self.opened()
        if self.retry_at is not None:
            if self.down:
                return None
            await self._open(self.all_rows if self.drafter.capture_layers else None, self.context)
            if self.session is None:
                return None
            log.info("drafter is back; drafting again")
            self.retry_at, self.pending_ids, self.pending_rows = None, [], []
            # a drafter back (often a fresh process, or another one) starts its streaks anew
            self.empty_answers = self.fruitless_calls = 0
        if self.session is None:
            return None
        try:
            drafted = await self.drafter.draft(
                self.session, position, self.pending_ids, self.pending_rows, k, sampling,
                speculative_ids, tree,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            self._down(exc)
            return None
        self.pending_ids, self.pending_rows = [], []
        self.stats.draft_calls += 1
        return drafted

    def take_carried(self, k: int) -> Drafted | None:
        carried, self.carried = self.carried, None
        return Drafted(carried.ids[:k]) if carried is not None else None

    def carry(self, predrafted: Drafted, drafted: Drafted, verified: Verified) -> None:
        """Keep the next block when the bet held: every draft accepted and the bonus token
        equal to the pre-draft's first (one-hot drafts only: rows of q cannot be sliced here)."""
        self.carried = None
        bet_held = (
            verified.num_accepted == len(drafted.ids)
            and not verified.finished
            and len(predrafted.ids) > 1
            and predrafted.ids[0] == verified.committed[-1]
        )
        if bet_held and predrafted.probs is None:
            self.carried = Drafted(predrafted.ids[1:])

    def carry_guess(self, guess: Drafted, verified: Verified) -> int:
        """After a decode burst that ran beside a draft call made at its start: keep the
        guess's tail for the next round when the burst decoded exactly its head. Returns how
        many of the guess's tokens the burst decoded, in a row."""
        self.carried = None
        decoded = verified.committed
        matched = leading_matches(guess.ids, decoded)
        if (
            matched == len(decoded) < len(guess.ids)
            and not verified.finished
            and guess.probs is None
            and not guess.parents
        ):
            self.carried = Drafted(guess.ids[matched:])
        return matched

    def _down(self, exc: Exception) -> None:
        log.warning("drafter failed (%s); verify-only rounds until it is back", exc)
        self.stats.drafter_failed = True
        self.session = None
        self.retry_at = time.perf_counter() + self.retry_s

    async def close(self) -> None:
        await self.opened()  # a session opened is closed, not left to the drafter's timeout
        if self.session is not None:
            await close_quietly(self.drafter, self.session)


async def run_rounds(
    verifier: VerifierPort,
    drafter: DrafterPort | None,
    prompt_ids: list[int],
    plan: Plan,
    stats: RoundStats,
) -> AsyncIterator[tuple[list[int], bool]]:
    """Yield (newly committed ids, finished) per round until EOS or max_tokens.

    The caller may stop early (stop strings); sessions are closed either way.
    """
    start = time.perf_counter()
    stats.prompt_tokens = len(prompt_ids)
    if plan.num_draft_tokens <= 0:
        drafter = None
    capture = drafter.capture_layers if drafter else ()
    opened = await verifier.open(prompt_ids, capture, plan.sampling)
    stats.prefill_s = time.perf_counter() - start
    link = DrafterLink(drafter, stats, plan.drafter_retry_s) if drafter is not None else None
    shared = plan.adaptive.costs if plan.adaptive is not None else None
    if link is not None and shared is not None:
        link.fruitless_calls = shared.fruitless_calls
    try:
        request = _Request(verifier, link, opened.session_id, plan, stats, len(prompt_ids) + 1)
        stats.generated_tokens = 1
        finished = opened.finished or plan.max_tokens <= 1
        yield [opened.first_token], finished
        if link is not None and not finished:
            link.open([*prompt_ids, opened.first_token], opened.rows)
        while not finished:
            remaining = plan.max_tokens - stats.generated_tokens
            played = await _play_round(request, remaining)
            committed = played.verified.committed
            new = committed[:remaining]
            request.position += len(committed)
            if link is not None:
                link.commit(committed, played.verified.rows)
            _record(stats, played, new)
            if plan.adaptive is not None:
                _learn_round(plan.adaptive, played)
            elif plan.tree_prices is not None:
                _learn_price(plan.tree_prices, played)
            request.in_company = played.verified.share < COMPANY_SHARE
            finished = played.verified.finished or stats.generated_tokens >= plan.max_tokens
            stats.total_s = time.perf_counter() - start
            yield new, finished
            stats.round_times.append(played.times(time.perf_counter()))
    finally:
        stats.total_s = time.perf_counter() - start
        if link is not None and shared is not None:
            shared.fruitless_calls = link.fruitless_calls
        await _close_sessions(verifier, opened.session_id, link)


_END = object()  # rounds_ahead's last item: the rounds are over


async def rounds_ahead(rounds):
    """`rounds`' items in order, the rounds going on while the caller hands each to its client:
    a message to the client (~0.2 ms through gRPC's layers) then overlaps the next round's
    calls instead of delaying them. Its errors are raised here; closing it stops the rounds
    (a call in flight cancelled, the sessions closed) and waits for them to end."""
    items: asyncio.Queue = asyncio.Queue()

    async def produce():
        try:
            async with aclosing(rounds):
                async for item in rounds:
                    items.put_nowait(item)
        except Exception as exc:  # noqa: BLE001 - raised again on the reader's side
            items.put_nowait(exc)
        finally:  # cancelled too: the reader never waits for an item that cannot come
            items.put_nowait(_END)

    producer = asyncio.ensure_future(produce())
    try:
        while (item := await items.get()) is not _END:
            if isinstance(item, Exception):
                raise item
            yield item
        if producer.cancelled():  # not by the reader: the loop is shutting down
            raise asyncio.CancelledError
    finally:
        producer.cancel()
        await asyncio.wait([producer])  # the sessions closed and the stats final


@dataclass
class _Request:
    """One generation's sessions and where it stands."""

    verifier: VerifierPort
    link: DrafterLink | None
    session_id: str
    plan: Plan
    stats: RoundStats
    position: int  # tokens in context, the last committed one included
    # the last call's forwards ran other sessions' rows too (Verified.share): under load a
    # short call leaves the session out of the batched forwards that run while its answer
    # travels, so rounds without drafts decode as long a burst as drafting off would
    in_company: bool = False


@dataclass
class Round:
    """One round: its kind, what was drafted and verified, and when each part ended.

    Kinds: "verify" (drafts, carried drafts or none, in one verify call), "overlap" (the verify
    beside a draft call for the block after it), "plain" (a decode burst, no drafts wanted),
    "beside" (a decode burst beside a draft call, after calls that proposed nothing)."""

    k: int
    start: float
    kind: str = "verify"
    drafted: Drafted = field(default_factory=lambda: Drafted([]))
    whole: Drafted | None = None  # a tree as drafted, before its cut at prices
    called_drafter: bool = False  # the drafts came from a call made for this round
    tree: Any = None
    steps: int = 1  # tokens the verifier may decode in the call (plain and beside)
    verified: Verified | None = None
    forwards: int = 1  # target forwards the round took
    guess: Drafted | None = None  # beside: the draft call's answer
    guess_k: int = 0  # beside: the drafts the call asked for
    model_probe: bool = False  # beside: adaptive k's probe of a drafter reading hidden rows
    matched: int = 0  # beside: the guess's tokens the burst decoded, in a row
    decode_s: float = 0.0  # beside: the burst's own wall time
    guess_s: float | None = None  # beside: the call's own wall time; None: no call made
    draft_done: float = 0.0
    verify_done: float = 0.0
    crowded: bool = False  # the coordinator was under load (Plan.under_load): no drafts

    @property
    def verify_price_s(self) -> float:
        """The verify call's time at its share of the forwards it shared with other sessions:
        in a batch, drafts' rows slow every session in it."""
        return (self.verify_done - self.draft_done) * self.verified.share

    def times(self, now: float) -> RoundTime:
        return RoundTime(
            self.draft_done - self.start,
            self.verify_done - self.draft_done,
            now - self.start,
            self.drafted.compute_s,
            self.verified.compute_s,
        )


async def _play_round(request: _Request, remaining: int) -> Round:
    plan = request.plan
    k, crowded = min(plan.num_draft_tokens, remaining - 1), False
    if plan.adaptive is not None:
        crowded = plan.under_load is not None and plan.under_load()
        k = 0 if crowded else plan.adaptive.choose(remaining - 1)
    played = Round(k, time.perf_counter(), crowded=crowded)
    played.kind = _round_kind(request, played, remaining)
    if played.kind == "draft":
        played.drafted = await request.link.draft(
            request.position, k, plan.sampling, (), played.tree
        )
        played.called_drafter, played.kind = True, "verify"
        if not played.drafted.ids:
            played.steps = _steps_after_empty_answer(request, remaining)
            played.kind = "plain" if played.steps > 1 else "verify"
        elif plan.tree_prices is not None and not (plan.adaptive and plan.adaptive.probing):
            # adaptive k keeps a node: a round cut to nothing would teach it nothing
            paid, least = time.perf_counter() - played.start, int(plan.adaptive is not None)
            played.whole = played.drafted
            played.drafted = cut_at_prices(played.drafted, plan.tree_prices, paid, least)
    played.draft_done = time.perf_counter()
    drafts = played.drafted
    if played.kind == "verify" and plan.overlap and drafts.ids and not drafts.parents:
        played.kind = "overlap"
    await _ROUNDS[played.kind](request, played, remaining)
    played.verify_done = time.perf_counter()
    _judge_answer(request.link, played)
    return played


def _judge_answer(link: DrafterLink | None, played: Round) -> None:
    """What the target kept of the round's drafts, or of the guess made beside its burst."""
    if link is None:
        return
    if played.kind in ("verify", "overlap") and played.drafted.ids:
        link.judged(played.verified.num_accepted)
    elif played.kind == "beside" and played.guess is not None and played.guess.ids:
        link.judged(played.matched)


def cut_at_prices(drafted: Drafted, prices: LinearCost, paid: float, least: int = 0) -> Drafted:
    """A drafted tree cut to the nodes worth their verify at the measured prices
    (`priced_cut`; at least `least` of them), `paid` seconds of the round spent already.
    Chains, sampled drafts (their q rows) and trees without a usable score for each node stay
    whole; a child scored above its parent counts at its parent's score, so the kept nodes
    hold their ancestors whatever a drafter sends (the verifier checks the tree itself)."""
    parents, scores = drafted.parents, drafted.scores
    if not parents or scores is None or drafted.probs is not None:
        return drafted
    if len(scores) != len(parents) or not all(math.isfinite(s) for s in scores):
        return drafted
    if any(not -1 <= p < i for i, p in enumerate(parents)):
        return drafted  # not parents first: the verifier refuses it with its own error
    capped = list(scores)
    for i, p in enumerate(parents):
        if p >= 0:
            capped[i] = min(capped[i], capped[p])
    keep = priced_cut(capped, prices.predict, paid, least)
    if len(keep) == len(drafted.ids):
        return drafted
    where = {old: new for new, old in enumerate(keep)}
    kept_parents = [-1 if parents[i] < 0 else where[parents[i]] for i in keep]
    return Drafted([drafted.ids[i] for i in keep], None, drafted.compute_s, kept_parents,
                   [scores[i] for i in keep])  # fmt: skip


def _round_kind(request: _Request, played: Round, remaining: int) -> str:
    """The policy: which kind of round to play ("draft": a verify of drafts asked for now).
    Takes up drafts carried from the last round."""
    link, plan, k = request.link, request.plan, played.k
    if link is None or k == 0:
        if link is not None:
            link.take_carried(0)  # drafts made for this position are stale after it
        if played.crowded:  # drafting off's burst: no probe until the load falls
            played.steps = _burst(plan, remaining)
        else:
            played.steps = _plain_steps(plan, link, k, remaining, request.in_company)
        return "plain" if played.steps > 1 else "verify"
    if link.down:
        # nothing to ask until its retry: drafting off's burst, and no answer counted against
        # the drafter (a streak the fault made would slow it in later requests once back)
        link.take_carried(0)
        played.steps = _burst(plan, remaining)
        return "plain" if played.steps > 1 else "verify"
    carried = link.take_carried(k)
    played.tree = plan.tree
    if plan.adaptive is not None and plan.adaptive.tree_shape is not None:
        played.tree = plan.adaptive.tree_shape
    if carried is not None:
        request.stats.predrafted_rounds += 1
        played.drafted = carried
        return "verify"
    probe_beside = _probe_beside(request)
    # a drafter due to be re-opened after a fault: its open runs beside the burst too
    unsure = link.empty_answers or link.retry_at is not None
    if plan.draft_beside_decode and played.tree is None and (unsure or probe_beside):
        # the last call found nothing (or a probe: _probe_beside); this one will likely find
        # nothing of use too, so decode meanwhile instead of waiting for it with one token to
        # verify. A model drafter's probes are spaced by adaptive k's probe wait alone:
        # skip_call does not skip them
        model_probe = probe_beside and bool(link.drafter.capture_layers)
        if not model_probe and link.skip_call():
            played.steps = _burst(plan, remaining)  # no call: drafting off's burst
            return "plain"
        if probe_beside:
            played.steps = _burst(plan, remaining)
        else:
            played.steps = _steps_after_empty_answer(request, remaining)
        played.model_probe = model_probe
        return "beside"
    return "draft"


def _steps_after_empty_answer(request: _Request, remaining: int) -> int:
    """Tokens to decode after the drafter proposed nothing (asked before the verify, or
    expected to find nothing again beside it): in company, and in a request's first round,
    drafting off's burst, since a call of one token leaves the session a whole wait for the
    batched forwards behind the others (on MT-bench n-gram's first answer is nearly always
    empty); alone later, a burst as long as the streak of calls that gave nothing kept."""
    plan = request.plan
    if request.in_company or request.stats.rounds == 0:
        return _burst(plan, remaining)
    return min(plan.decode_burst, max(1, request.link.fruitless_calls), remaining)


def _probe_beside(request: _Request) -> bool:
    """Whether adaptive k's probe is asked beside a decode burst, its guess checked against
    the burst's tokens as a verify would check it, rather than in a verify call of its own.

    A model drafter's (one that reads the target's hidden rows, so its call first catches up
    on every row of the plain spell): a probe would otherwise cost two round trips, its draft
    call and then a short verify of its own, every probe wait, while the drafter does not
    pay. A guess matches a token as a verify accepts it where the drafts are one-hot (greedy
    requests, or a drafter that drafts by argmax); a sampled guess drawn from q (DFlash)
    matches less often, so that probe keeps its verify. A drafter without hidden rows
    (n-gram) only in company: there a probe's call waits for the batched forwards for a token
    or two where a burst gets drafting off's."""
    plan, drafter = request.plan, request.link.drafter
    if plan.adaptive is None or not plan.adaptive.probing:
        return False
    if drafter.capture_layers:
        greedy = plan.sampling is None or plan.sampling.temperature <= 0
        return greedy or not drafter.sends_draft_probs
    return request.in_company


async def _verify_round(request: _Request, played: Round, remaining: int) -> None:
    drafts = played.drafted
    played.verified = await request.verifier.verify(
        request.session_id, request.position, drafts.ids, drafts.probs, drafts.parents
    )


async def _plain_round(request: _Request, played: Round, remaining: int) -> None:
    played.verified = await request.verifier.verify(
        request.session_id, request.position, [], None, None, plain_steps=played.steps
    )
    played.forwards = len(played.verified.committed)


async def _overlap_round(request: _Request, played: Round, remaining: int) -> None:
    played.verified = await _verify_and_predraft(
        request.verifier, request.link, request.session_id, request.position, played.drafted,
        request.plan.sampling,
    )  # fmt: skip


async def _beside_round(request: _Request, played: Round, remaining: int) -> None:
    link, plan = request.link, request.plan
    played.guess_k = min(max(played.k, plan.num_draft_tokens), remaining - 1)
    played.verified, played.guess, played.decode_s, played.guess_s = await _decode_beside_draft(
        request.verifier, link, request.session_id, request.position, played.steps,
        played.guess_k, plan.sampling,
    )  # fmt: skip
    request.stats.beside_calls += played.guess_s is not None
    played.matched = link.carry_guess(played.guess, played.verified)
    played.forwards = len(played.verified.committed)


_ROUNDS = {
    "verify": _verify_round,
    "plain": _plain_round,
    "overlap": _overlap_round,
    "beside": _beside_round,
}


def _record(stats: RoundStats, played: Round, new: list[int]) -> None:
    stats.rounds += played.forwards  # a round is one target forward: tau stays per forward
    stats.drafted += len(played.drafted.ids)
    stats.accepted += played.verified.num_accepted
    stats.generated_tokens += len(new)
    stats.draft_s += played.draft_done - played.start
    stats.verify_s += played.verify_done - played.draft_done
    stats.draft_compute_s += played.drafted.compute_s
    stats.verify_compute_s += played.verified.compute_s
    stats.forward_sessions_sum += 1.0 / played.verified.share


def _learn_price(prices: LinearCost, played: Round) -> None:
    """A pinned round's verify time (`Round.verify_price_s`), for the tree cut."""
    verify_s = played.verify_price_s
    if played.kind == "plain":
        prices.observe(1, verify_s / played.forwards)
    elif played.kind == "verify":
        prices.observe(len(played.drafted.ids) + 1, verify_s)


def _learn_round(adaptive: AdaptiveK, played: Round) -> None:
    """What the round tells adaptive k: acceptance, and the cost of drafts and verifies (a
    verify at its share of shared forwards, `Round.verify_price_s`)."""
    verify_s = played.verify_price_s
    if played.kind == "beside":
        # a model drafter's probe asks for k_max drafts where its round's k is 1
        asked = played.guess_k if played.model_probe else played.k
        _learn_beside(
            adaptive, played.k, asked, played.guess, played.verified, played.matched,
            played.decode_s, played.guess_s,
        )  # fmt: skip
    elif played.kind == "plain":
        adaptive.observe_plain(played.forwards)
        adaptive.costs.verify.observe(1, verify_s / played.forwards)
    else:
        _learn(
            adaptive, played.k, played.drafted, played.verified, played.draft_done - played.start,
            verify_s, played.called_drafter, played.whole,
        )  # fmt: skip


def _plain_steps(
    plan: Plan, link: DrafterLink | None, k: int, remaining: int, in_company: bool = False
) -> int:
    """Tokens to decode in one verifier call: more than one only when no drafts are wanted
    for that long (no drafter, or adaptive k at 0 until its next probe; in company, a whole
    burst, the probe after it)."""
    if k > 0 or plan.decode_burst <= 1:
        return 1
    if link is None:
        return _burst(plan, remaining)
    if plan.adaptive is None or plan.adaptive.probing:
        return 1
    if in_company:
        return _burst(plan, remaining)
    return min(_burst(plan, remaining), plan.adaptive.plain_rounds_ahead())


FIRST_BURST = 4  # a request's first bursts stay short so its stream starts at once
# a call whose rows were under this part of its forwards' rows ran beside other sessions
COMPANY_SHARE = 0.75


def _burst(plan: Plan, remaining: int) -> int:
    """Up to --decode-burst tokens, and no more than the request has produced so far (at least
    FIRST_BURST): long bursts save calls, short first ones keep the first chunks prompt."""
    produced = plan.max_tokens - remaining
    return min(plan.decode_burst, max(FIRST_BURST, produced), remaining)


async def _verify_and_predraft(
    verifier, link: DrafterLink, session_id: str, position: int, drafted: Drafted, sampling
) -> Verified:
    """Verify, and meanwhile ask the drafter for the block after it, betting that every draft
    is accepted; its first token is the guess for the bonus. Hides the draft RPC when it holds."""
    verify = asyncio.ensure_future(
        verifier.verify(session_id, position, drafted.ids, drafted.probs)
    )
    try:
        predrafted = await link.draft(position, len(drafted.ids) + 1, sampling, drafted.ids)
    except BaseException:
        verify.cancel()
        raise
    verified = await verify
    link.carry(predrafted, drafted, verified)
    return verified


async def _decode_beside_draft(
    verifier, link: DrafterLink, session_id: str, position: int, steps: int, k: int, sampling
) -> tuple[Verified, Drafted, float, float]:
    """Decode `steps` tokens and meanwhile ask the drafter for k from the same point. The
    guess costs no wait: if the burst decodes its head, its tail drafts the next round.
    Returns the burst, the guess, and the seconds each took on its own (the call's None when
    none was made: the drafter is down)."""
    start, answered = time.perf_counter(), link.stats.draft_calls

    async def timed_decode() -> tuple[Verified, float]:
        # timed from its own start: an in-process drafter runs its call to the end first
        began = time.perf_counter()
        plain_steps = steps if steps > 1 else 0
        verified = await verifier.verify(
            session_id, position, [], None, None, plain_steps=plain_steps
        )
        return verified, time.perf_counter() - began

    decode = asyncio.ensure_future(timed_decode())
    try:
        guess = await link.draft(position, k, sampling)
    except BaseException:
        decode.cancel()
        if decode.done() and not decode.cancelled():
            decode.exception()  # retrieved: the drafter's exception is the one to raise
        raise
    guess_s = time.perf_counter() - start if link.stats.draft_calls > answered else None
    verified, decode_s = await decode
    return verified, guess, decode_s, guess_s


def _learn_beside(
    adaptive: AdaptiveK,
    k: int,
    asked: int,  # the drafts the call asked for: its price is a draft of that many
    guess: Drafted,
    verified: Verified,
    matched: int,  # the guess's tokens the burst decoded, in a row
    decode_s: float,
    guess_s: float | None,  # None: no call was made (the drafter is down)
) -> None:
    """A burst beside a draft call: the guess's head met the target's tokens as drafts would
    have, so it counts as acceptance evidence; the burst prices plain steps and the call a
    draft of the drafts it asked for, each timed on its own."""
    checked = min(len(guess.ids), len(verified.committed))
    adaptive.observe(k, checked, matched)
    adaptive.costs.verify.observe(1, decode_s * verified.share / max(1, len(verified.committed)))
    if guess_s is not None:
        adaptive.costs.draft.observe(asked, guess_s)


def _learn(
    adaptive: AdaptiveK,
    k: int,
    drafted: Drafted,
    verified: Verified,
    draft_s: float,
    verify_s: float,
    called_drafter: bool,
    whole: Drafted | None = None,
) -> None:
    adaptive.observe(k, _path_length(drafted), verified.num_accepted)
    # a cut tree's ranks are learned over the tree as drafted: the target's committed tokens
    # still say which of the nodes cut away it would have taken
    tree = whole or drafted
    adaptive.observe_tree(tree.ids, tree.parents, verified.committed)
    adaptive.costs.verify.observe(len(drafted.ids) + 1, verify_s)
    if called_drafter:
        adaptive.costs.draft.observe(k, draft_s)


def leading_matches(guess, tokens) -> int:
    """How many of `guess` equal `tokens`, in a row from the first."""
    matched = 0
    for guessed, token in zip(guess, tokens, strict=False):
        if guessed != token:
            break
        matched += 1
    return matched


def _path_length(drafted: Drafted) -> int:
    """Drafts the target could accept in one round: the chain, or the tree's depth."""
    if not drafted.parents:
        return len(drafted.ids)
    depth: list[int] = []
    for p in drafted.parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth)


_closing: set[asyncio.Future] = set()  # closes that outlive a cancelled caller


def close_in_background(*closes) -> asyncio.Future:
    """Run these closes to their end even if whoever awaits them is cancelled (its client
    went away): a session left open holds a slot on its service until it idles out."""
    closing = asyncio.gather(*closes)
    _closing.add(closing)
    closing.add_done_callback(_closing.discard)
    return closing


async def _close_sessions(verifier, session_id: str, link: DrafterLink | None) -> None:
    """Close both sessions, together, to the end even if we are cancelled again."""
    drafter_close = [link.close()] if link is not None else []
    await asyncio.shield(close_in_background(close_quietly(verifier, session_id), *drafter_close))


async def close_quietly(port, session_id: str) -> None:
    try:
        await port.close(session_id)
    except Exception as exc:  # noqa: BLE001 - closing is best effort; idle sessions expire
        log.debug("close %s failed: %s", session_id, exc)
