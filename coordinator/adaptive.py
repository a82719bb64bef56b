"""Adaptive draft length: pick k each round to maximize expected tokens per second.

Model (documented in docs/adaptive.md):
- acceptance is geometric: each draft is accepted with probability a given the previous ones
  were, so a round with k drafts commits 1 + a (1 - a^k) / (1 - a) tokens on average;
- a verify of n tokens costs v0 + v1 (n - 1) seconds and a draft of k tokens d0 + d1 k,
  both fitted online by least squares with forgetting; a size seen twice or more is priced
  by its own recent mean instead;
- k = argmax over 0..k_max of expected tokens / (draft cost + verify cost), where k = 0 costs
  no draft call.
- Draft trees choose their size n as well: the target's token is a node's r-th best drafted
  child with probability p[r] (estimated per session from the paths the target kept), so the
  best tree of n nodes expects the sum of its n largest path products (a greedy expansion
  finds it), and n, with that tree's depth and fan-out, maximizes the same rate.
- A session's acceptance estimate starts from the drafter's recent acceptance over all sessions
  (two pseudo-trials), or 1/2 until there are ten trials of evidence.
- After `probe_every` rounds at k = 0 one round drafts `probe_tokens` (a cheap look: with a weak
  drafter a full-length probe costs a long verify every few rounds; a tree probe is the best
  tree of `probe_tokens` nodes), so a session notices when drafts start matching;
  acceptance then raises k by itself. Each probe that is wholly rejected doubles the wait
  before the next (up to `probe_every_max`); an accepted draft resets it, except a chain
  probe's while acceptance stays far below break-even. A chain session whose drafter's recent
  acceptance is that far below starts with the longest wait.
- A size's own mean is trusted only while it was seen lately (`stale_after` observations);
  after `cost_probe_every` drafting rounds in a row a session decodes plainly until a plain
  step is priced afresh, so a slow spell cannot leave it drafting at a loss.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LinearCost:
    """seconds ~ base + per_token * n, fitted with exponential forgetting; a size seen at
    least twice is predicted by its own recent mean instead, since real costs are not a line
    (a CPU verify is concave in n, and a line through 4- and 16-token trees under-predicts
    the 4-token one)."""

    base: float  # prior until observations say otherwise
    per_token: float
    decay: float = 0.97  # ~30 recent observations dominate: costs drift with context length
    # a size's own mean is trusted only while it was seen within this many observations (of
    # any size): one measured in a slow spell of the host must not price it for good
    stale_after: int = 32
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # w, wn, wt, wnn, wnt
    _by_size: dict[int, list[float]] = field(default_factory=dict)  # n -> [weight, mean]
    _seen_at: dict[int, int] = field(default_factory=dict)  # n -> observation count then
    _count: int = 0

    def observe(self, n: int, seconds: float) -> None:
        w, wn, wt, wnn, wnt = (s * self.decay for s in self._sums)
        self._sums = [w + 1, wn + n, wt + seconds, wnn + n * n, wnt + n * seconds]
        self._count += 1
        weight, mean = self._by_size.get(n, (0.0, 0.0)) if self._fresh(n) else (0.0, 0.0)
        weight = weight * self.decay + 1
        self._by_size[n] = [weight, mean + (seconds - mean) / weight]
        self._seen_at[n] = self._count

    def _fresh(self, n: int) -> bool:
        return n in self._seen_at and self._count - self._seen_at[n] <= self.stale_after

    def forget(self, n: int) -> None:
        """Drop size n's own mean: priced by the line until seen twice again."""
        self._by_size.pop(n, None)
        self._seen_at.pop(n, None)

    def trusted(self, n: int) -> bool:
        """Size n seen at least twice lately: priced by its own mean."""
        seen = self._by_size.get(n)
        return seen is not None and seen[0] >= 1.9 and self._fresh(n)

    def predict(self, n: int) -> float:
        if self.trusted(n):
            return max(1e-6, self._by_size[n][1])
        w, wn, wt, wnn, wnt = self._sums
        if w < 1e-9:
            return self.base + self.per_token * n
        mean_n, mean_t = wn / w, wt / w
        var_n = wnn / w - mean_n**2
        slope = (wnt / w - mean_n * mean_t) / var_n if var_n > 0.25 else None
        if slope is None or slope < 0:  # one n seen so far: keep the prior's ratio
            ratio = self.per_token / (self.base + self.per_token * mean_n)
            slope = max(slope or 0.0, ratio * mean_t)
        return max(1e-6, mean_t + slope * (n - mean_n))


def expected_tokens(k: int, acceptance: float) -> float:
    """1 (recovered or bonus) + expected accepted drafts out of k."""
    a = min(max(acceptance, 0.0), 0.999)
    return 1.0 + a * (1 - a**k) / (1 - a)


@dataclass
class SharedAcceptance:
    """Acceptance over all sessions of one drafter: where a new session's estimate starts."""

    decay: float = 0.99  # ~100 recent trials: the drafter's typical rate, not one text's
    successes: float = 0.0
    trials: float = 0.0
    min_trials: float = 10.0  # before this much evidence, sessions keep the fixed prior

    def observe(self, accepted: int, rejected: int) -> None:
        self.successes = self.successes * self.decay + accepted
        self.trials = self.trials * self.decay + accepted + rejected

    @property
    def known(self) -> bool:
        """Enough evidence to say something about a new session."""
        return self.trials >= self.min_trials

    def prior(self, default: float) -> float:
        return self.successes / self.trials if self.known else default


@dataclass
class SpeculationCosts:
    """Per verifier/drafter pair, shared by all sessions of a coordinator."""

    verify: LinearCost = field(default_factory=lambda: LinearCost(0.06, 0.006))
    draft: LinearCost = field(default_factory=lambda: LinearCost(0.001, 0.0))
    acceptance: SharedAcceptance = field(default_factory=SharedAcceptance)
    # the drafter's calls in a row that gave nothing kept, where the last request left them: a
    # request starts its bursts and backoff there (`DrafterLink.fruitless_calls`), so a drafter
    # that finds nothing in request after request is not asked beside short bursts anew each time
    fruitless_calls: int = 0


@dataclass
class TreeLimits:
    """The largest tree a session may draft (the request's or the drafter's default shape)
    and how to ask the drafter for one (`make(total_tokens=, depth=, top_k=)`)."""

    total_tokens: int
    depth: int  # 0: no limit but k
    top_k: int
    make: Callable[..., Any]

    @classmethod
    def of(cls, shape, default_top_k: int = 0) -> TreeLimits | None:
        """Limits from a tree shape (a TreeShape message or dataclass); None for chains."""
        if shape is None or shape.total_tokens <= 0:
            return None
        top_k = shape.top_k or default_top_k or 4
        return cls(shape.total_tokens, shape.depth, top_k, make=type(shape))


@dataclass
class RankAcceptance:
    """p[r]: how often the target's token is a node's r-th best drafted child (r = 0: the
    best, a chain's acceptance), over nodes that had an r-th child; decayed per round."""

    hits: list[float]
    trials: list[float]
    decay: float = 0.9

    @classmethod
    def with_prior(cls, first: float, width: int, trials: float = 2.0) -> RankAcceptance:
        # later ranks start at a fraction of the first: the EAGLE-3 head's top-2..4 add
        # about a third, a tenth, a twentieth of its top-1 hits (docs/adaptive.md)
        shares = [1.0, 0.3, 0.12, 0.08] + [0.05] * max(0, width - 4)
        return cls([first * shares[r] * trials for r in range(width)], [trials] * width)

    @property
    def p(self) -> list[float]:
        return [h / t for h, t in zip(self.hits, self.trials, strict=True)]

    def observe_path(self, ids, parents, committed) -> None:
        """One tree round: along the path the target kept, which child (best first) was its
        token at each depth, until none was."""
        self.hits = [h * self.decay for h in self.hits]
        self.trials = [t * self.decay for t in self.trials]
        node = -1
        for token in committed:
            children = [i for i, parent in enumerate(parents) if parent == node]
            if not children:
                return
            for r in range(min(len(children), len(self.trials))):
                self.trials[r] += 1
            rank = next((r for r, i in enumerate(children) if ids[i] == token), None)
            if rank is None:
                return
            if rank < len(self.hits):
                self.hits[rank] += 1
            node = children[rank]


def best_trees(p: list[float], budget: int, max_depth: int) -> list[tuple[float, int, int]]:
    """For n = 1..budget: (expected accepted drafts, depth, widest fan-out) of the best tree of
    n nodes when a node's r-th child holds the target's token with probability p[r]. A child
    is never worth more than its parent, so taking nodes by value keeps the tree closed."""
    frontier = [(-p[r], 1, r) for r in range(len(p))]
    heapq.heapify(frontier)
    out: list[tuple[float, int, int]] = []
    total, depth, width = 0.0, 0, 0
    while frontier and len(out) < budget:
        value, d, r = heapq.heappop(frontier)
        total, depth, width = total - value, max(depth, d), max(width, r + 1)
        out.append((total, depth, width))
        if d < max_depth:
            for child in range(len(p)):
                heapq.heappush(frontier, (value * p[child], d + 1, child))
    return out


def priced_cut(
    scores: list[float], price: Callable[[int], float], paid: float = 0.0, least: int = 0
) -> list[int]:
    """The nodes of a drafted tree worth verifying at the verifier's prices: its n likeliest
    by the drafter's path log-probabilities `scores` (a child never outscores its parent, so
    they hold their ancestors; ties go to the earlier, parents being listed first), n >=
    `least` maximizing the round's rate, (1 + their summed probabilities) / (paid + price(n + 1)),
    where price(t) is a verify of t tokens and `paid` what the round has cost already (its
    draft): a node pays when its probability beats its price at the round's rate.
    Returns the kept nodes' indices in their order."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    best, best_rate, expected = 0, -1.0, 1.0
    for n in range(len(order) + 1):
        if n:
            expected += math.exp(scores[order[n - 1]])
        rate = expected / (paid + price(n + 1))
        if n >= least and rate > best_rate:
            best, best_rate = n, rate
    return sorted(order[:best])


@dataclass
class AdaptiveK:
    """Per session: acceptance estimate and the choice of k."""

    costs: SpeculationCosts
    k_max: int
    probe_every: int = 8  # rounds at k = 0 before drafting is tried again
    probe_every_max: int = 64  # the wait after many rejected probes in a row
    # a rejected probe doubles the wait only while the acceptance estimate is below this
    # share of the break-even acceptance: a chain drafter near break-even (the EAGLE-3 head on
    # this CPU, right about half the time against ~0.42) keeps probing every probe_every
    # rounds, so a dip of its noisy estimate does not keep it from drafting for 64 rounds at
    # a time; one far below (the same head on an H200, where break-even is ~0.75) backs off.
    # Below the same share a kept chain probe leaves the wait as it is, and a chain session
    # whose drafter's recent acceptance is there starts with the longest wait
    hopeless_below: float = 0.8
    # drafts in such a probe: one, since on a CPU a verify of 3 tokens costs ~2.2x a decode
    # step and of 2 tokens ~1.2x (docs/history, 2026-12-01)
    probe_tokens: int = 1
    # after this many drafting rounds in a row, one round decodes without drafts, so the
    # price of a plain step stays measured (LinearCost.stale_after) and a spell that made
    # plain steps look dear cannot keep a session drafting at a loss
    cost_probe_every: int = 32
    rounds_with_drafts: int = 0
    cost_probing: bool = False  # plain rounds until a plain step's price is trusted again
    decay: float = 0.9  # acceptance follows the text: recent rounds count most
    successes: float = 1.0  # prior: acceptance 0.5 over two pseudo-trials
    trials: float = 2.0
    rounds_without_drafts: int = 0
    probe_wait: int = 0  # rounds at k = 0 before the next probe; 0 until set from probe_every
    probing: bool = False  # the round just chosen is a probe
    tree: TreeLimits | None = None  # None: chains
    ranks: RankAcceptance | None = None  # trees: set from the prior in for_session
    tree_shape: Any = None  # the tree asked for by the round just chosen (trees only)

    @classmethod
    def for_session(
        cls, costs: SpeculationCosts, k_max: int, text_driven: bool = False, **options
    ) -> AdaptiveK:
        """A new session's chooser, its acceptance prior (two pseudo-trials) taken from the
        drafter's recent sessions once there are enough of them. text_driven: the drafter's
        drafts follow the request's own text (n-gram), so its recent sessions say little about
        this one's."""
        prior_trials = cls.trials
        start = costs.acceptance.prior(cls.successes / prior_trials)
        chooser = cls(costs, k_max, successes=start * prior_trials, trials=prior_trials, **options)
        if chooser.tree is not None and chooser.ranks is None:
            chooser.ranks = RankAcceptance.with_prior(start, max(1, chooser.tree.top_k))
        known = costs.acceptance.known
        if chooser.tree is None and not text_driven and known and chooser._hopeless():
            # the drafter's recent sessions say its drafts are far from paying: start with the
            # wait their rejected probes reach, not a probe every probe_every rounds anew
            chooser.probe_wait = chooser.probe_every_max
        return chooser

    @property
    def acceptance(self) -> float:
        return self.successes / self.trials

    def choose(self, limit: int) -> int:
        """k for the next round, at most `limit` (tokens still wanted - 1); for trees the depth,
        with the whole shape in `tree_shape`."""
        k_max = min(self.k_max, limit)
        self.probing = False
        self.tree_shape = None
        if k_max <= 0:
            return 0
        if self.rounds_with_drafts >= self.cost_probe_every:
            self.costs.verify.forget(1)  # measured afresh by the plain rounds that follow
            self.cost_probing = True
        if self.cost_probing:
            if not self.costs.verify.trusted(1):
                return 0
            self.cost_probing = False
        probe = self.rounds_without_drafts >= (self.probe_wait or self.probe_every)
        self.probing = probe
        if self.tree is not None:
            return self._choose_tree(k_max, probe)
        if probe:
            return min(k_max, self.probe_tokens)
        best_k, best_rate = 0, 1.0 / self.costs.verify.predict(1)
        for k in range(1, k_max + 1):
            seconds = self.costs.draft.predict(k) + self.costs.verify.predict(k + 1)
            rate = expected_tokens(k, self.acceptance) / seconds
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def _choose_tree(self, k_max: int, probe: bool) -> int:
        """The tree size (and so depth and fan-out) of the best expected rate; a probe asks
        for the best tree of `probe_tokens` nodes, whatever it costs."""
        tree = self.tree
        depth_limit = min(k_max, tree.depth) if tree.depth else k_max
        options = best_trees(self.ranks.p, tree.total_tokens, depth_limit)
        if not options:
            return 0
        if probe:
            chosen = min(self.probe_tokens, len(options))
        else:
            chosen, best_rate = 0, 1.0 / self.costs.verify.predict(1)
            for n, (accepted, depth, _) in enumerate(options, start=1):
                seconds = self.costs.draft.predict(depth) + self.costs.verify.predict(n + 1)
                if (1 + accepted) / seconds > best_rate:
                    chosen, best_rate = n, (1 + accepted) / seconds
            if chosen == 0:
                return 0
        _, depth, width = options[chosen - 1]
        self.tree_shape = tree.make(total_tokens=chosen, depth=depth, top_k=width)
        return depth

    def plain_rounds_ahead(self) -> int:
        """After `choose` gave 0 and no probe: rounds left before the next probe. Acceptance
        moves only when drafts are tried, so until then k stays 0 (the caller may decode
        these tokens in one verifier call)."""
        return max(1, (self.probe_wait or self.probe_every) - self.rounds_without_drafts)

    def observe_plain(self, rounds: int) -> None:
        """`rounds` tokens decoded in one call, none drafted."""
        self.rounds_without_drafts += rounds
        self.rounds_with_drafts = 0

    def observe_tree(self, ids, parents, committed) -> None:
        """After a round of a tree session: which children held the target's tokens. A
        one-child-per-node tree comes back as a chain (parents None)."""
        if self.ranks is None or not ids:
            return
        parents = parents or list(range(-1, len(ids) - 1))
        self.ranks.observe_path(ids, parents, committed)

    def observe(self, asked: int, drafted: int, accepted: int) -> None:
        """After a round: `asked` k, `drafted` tokens the drafter gave, `accepted` of them."""
        self.rounds_without_drafts = self.rounds_without_drafts + 1 if asked == 0 else 0
        self.rounds_with_drafts = self.rounds_with_drafts + 1 if asked else 0
        if drafted == 0:
            return  # nothing proposed (e.g. no n-gram match) says nothing about acceptance
        rejected = 1 if accepted < drafted else 0
        # judged before this round moves the estimate: from a two-trial prior one kept probe
        # lifts it past the cut-off whatever the drafter's history says
        hopeless_probe = self.probing and self._hopeless()
        self.successes = self.successes * self.decay + accepted
        self.trials = self.trials * self.decay + accepted + rejected
        self.costs.acceptance.observe(accepted, rejected)
        if accepted:
            # a probe of one draft is kept as often as the drafter's first draft is right: for a
            # chain drafter far below break-even (the EAGLE-3 head on an H200, right about half
            # the time) that is no sign drafting pays, and probing every probe_every rounds
            # would cut its plain bursts short for good
            if self.tree is not None or not hopeless_probe:
                self.probe_wait = self.probe_every
        elif self.probing and self._hopeless():
            self.probe_wait = min(2 * (self.probe_wait or self.probe_every), self.probe_every_max)

    def _hopeless(self) -> bool:
        """Whether drafting is far from paying, so a wholly rejected probe lengthens the wait
        (always for trees; for chains while acceptance is well below break-even), a kept chain
        probe does not shorten it, and a chain session starts with the longest."""
        if self.tree is not None:
            return True
        return self.acceptance < self.hopeless_below * self.break_even()

    def break_even(self) -> float:
        """The least acceptance at which drafting some k (1..k_max) beats plain decoding at
        the current prices; 1.0 where none would."""

        def pays(acceptance: float) -> bool:
            plain = 1.0 / self.costs.verify.predict(1)
            for k in range(1, self.k_max + 1):
                seconds = self.costs.draft.predict(k) + self.costs.verify.predict(k + 1)
                if expected_tokens(k, acceptance) / seconds > plain:
                    return True
            return False

        low, high = 0.0, 0.999
        if not pays(high):
            return 1.0
        for _ in range(20):
            middle = (low + high) / 2
            low, high = (low, middle) if pays(middle) else (middle, high)
        return high
