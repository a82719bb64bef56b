"""Adaptive draft length: pick k each round to maximize expected tokens per second.

Model (documented in docs/adaptive.md):
- acceptance is geometric: each draft is accepted with probability a given the previous ones
  were, so a round with k drafts commits 1 + a (1 - a^k) / (1 - a) tokens on average;
- a verify of n tokens costs v0 + v1 (n - 1) seconds and a draft of k tokens d0 + d1 k,
  both fitted online by least squares with forgetting; a size seen twice or more is priced
  by its own recent mean instead;
- k = argmax over 0..k_max of expected tokens / (draft cost + verify cost), where k = 0 costs
  no draft call. For draft trees k is the depth: acceptance is per depth (the path the target
  keeps), and the verify costs the tree's size.
- A session's acceptance estimate starts from the drafter's recent acceptance over all sessions
  (two pseudo-trials), or 1/2 until there are ten trials of evidence.
- After `probe_every` rounds at k = 0 one round drafts `probe_tokens` (a cheap look: with a weak
  drafter a full-length probe costs a long verify every few rounds; a tree probes one level
  deep), so a session notices when drafts start matching; acceptance then raises k by itself.
  Each probe that is wholly rejected doubles the wait before the next (up to
  `probe_every_max`); an accepted draft resets it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class LinearCost:
    """seconds ~ base + per_token * n, fitted with exponential forgetting; a size seen at
    least twice is predicted by its own recent mean instead, since real costs are not a line
    (a CPU verify is concave in n, and a line through 4- and 16-token trees under-predicts
    the 4-token one)."""

    base: float  # prior until observations say otherwise
    per_token: float
    decay: float = 0.97  # ~30 recent observations dominate: costs drift with context length
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # w, wn, wt, wnn, wnt
    _by_size: dict[int, list[float]] = field(default_factory=dict)  # n -> [weight, mean]

    def observe(self, n: int, seconds: float) -> None:
        w, wn, wt, wnn, wnt = (s * self.decay for s in self._sums)
        self._sums = [w + 1, wn + n, wt + seconds, wnn + n * n, wnt + n * seconds]
        weight, mean = self._by_size.get(n, (0.0, 0.0))
        weight = weight * self.decay + 1
        self._by_size[n] = [weight, mean + (seconds - mean) / weight]

    def predict(self, n: int) -> float:
        seen = self._by_size.get(n)
        if seen is not None and seen[0] >= 2:
            return max(1e-6, seen[1])
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

    def prior(self, default: float) -> float:
        return self.successes / self.trials if self.trials >= self.min_trials else default


@dataclass
class SpeculationCosts:
    """Per verifier/drafter pair, shared by all sessions of a coordinator."""

    verify: LinearCost = field(default_factory=lambda: LinearCost(0.06, 0.006))
    draft: LinearCost = field(default_factory=lambda: LinearCost(0.001, 0.0))
    acceptance: SharedAcceptance = field(default_factory=SharedAcceptance)


@dataclass
class AdaptiveK:
    """Per session: acceptance estimate and the choice of k."""

    costs: SpeculationCosts
    k_max: int
    probe_every: int = 8  # rounds at k = 0 before drafting is tried again
    probe_every_max: int = 64  # the wait after many rejected probes in a row
    probe_tokens: int = 2  # drafts in such a probe
    decay: float = 0.9  # acceptance follows the text: recent rounds count most
    successes: float = 1.0  # prior: acceptance 0.5 over two pseudo-trials
    trials: float = 2.0
    rounds_without_drafts: int = 0
    probe_wait: int = 0  # rounds at k = 0 before the next probe; 0 until set from probe_every
    probing: bool = False  # the round just chosen is a probe
    # tokens a verify checks when k is asked: k for chains, the tree's size for trees
    verified_tokens: Callable[[int], int] | None = None

    @classmethod
    def for_session(cls, costs: SpeculationCosts, k_max: int, **options) -> AdaptiveK:
        """A new session's chooser, its acceptance prior (two pseudo-trials) taken from the
        drafter's recent sessions once there are enough of them."""
        prior_trials = cls.trials
        start = costs.acceptance.prior(cls.successes / prior_trials)
        return cls(costs, k_max, successes=start * prior_trials, trials=prior_trials, **options)

    @property
    def acceptance(self) -> float:
        return self.successes / self.trials

    def choose(self, limit: int) -> int:
        """k for the next round, at most `limit` (tokens still wanted - 1)."""
        k_max = min(self.k_max, limit)
        self.probing = False
        if k_max <= 0:
            return 0
        if self.rounds_without_drafts >= (self.probe_wait or self.probe_every):
            self.probing = True
            return self._probe_depth(k_max)
        best_k, best_rate = 0, 1.0 / self.costs.verify.predict(1)
        for k in range(1, k_max + 1):
            n = self.verified_tokens(k) if self.verified_tokens else k
            seconds = self.costs.draft.predict(k) + self.costs.verify.predict(n + 1)
            rate = expected_tokens(k, self.acceptance) / seconds
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def _probe_depth(self, k_max: int) -> int:
        """The deepest k whose verify checks at most `probe_tokens` drafts, and at least 1: a
        chain probes `probe_tokens` deep, a tree one level (its second level is the dearest
        verify there is)."""
        size = self.verified_tokens or (lambda k: k)
        k = min(k_max, self.probe_tokens)
        while k > 1 and size(k) > self.probe_tokens:
            k -= 1
        return k

    def plain_rounds_ahead(self) -> int:
        """After `choose` gave 0 and no probe: rounds left before the next probe. Acceptance
        moves only when drafts are tried, so until then k stays 0 (the caller may decode
        these tokens in one verifier call)."""
        return max(1, (self.probe_wait or self.probe_every) - self.rounds_without_drafts)

    def observe_plain(self, rounds: int) -> None:
        """`rounds` tokens decoded in one call, none drafted."""
        self.rounds_without_drafts += rounds

    def observe(self, asked: int, drafted: int, accepted: int) -> None:
        """After a round: `asked` k, `drafted` tokens the drafter gave, `accepted` of them."""
        self.rounds_without_drafts = self.rounds_without_drafts + 1 if asked == 0 else 0
        if drafted == 0:
            return  # nothing proposed (e.g. no n-gram match) says nothing about acceptance
        if accepted:
            self.probe_wait = self.probe_every
        elif self.probing:
            self.probe_wait = min(2 * (self.probe_wait or self.probe_every), self.probe_every_max)
        rejected = 1 if accepted < drafted else 0
        self.successes = self.successes * self.decay + accepted
        self.trials = self.trials * self.decay + accepted + rejected
        self.costs.acceptance.observe(accepted, rejected)
