"""The verifier's load, logged every few seconds (`--log-stats`): how many calls and tokens it
served, and how many sessions its shared forwards held. Under many clients the last figure
says whether the sessions run in step (one forward for all) or fall apart into small ones;
where a session spends the time between them says why: away (from an answer to the session's
next call: the coordinator, the drafter, the network) or held here (from a call's arrival to
its answer: waiting for the forwards, then in them). Prefills take the MLX thread from the
rounds: their jobs' time says how much."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass
class Interval:
    """What the verifier did between two reports."""

    seconds: float
    calls: int  # verify calls answered
    tokens: int  # tokens they committed
    forwards: int  # forwards shared among rounds (or run for one round)
    sessions: int  # their sessions, summed
    widest: int  # the most sessions in one of them
    away: float = 0.0  # seconds from answers to their sessions' next calls, summed
    returns: int = 0  # calls that came back after an answer (those `away` sums)
    longest_away: float = 0.0
    timed: int = 0  # calls whose arrival was seen (those `held` sums)
    held: float = 0.0  # seconds from calls' arrival to their answers, summed
    computing: float = 0.0  # of `held`, the forwards' wall time the calls took part in
    prefill_jobs: int = 0  # MLX jobs that prefilled prompts (a batch of them, or a slice)
    prefill_prompts: int = 0  # prompts whose prefill ended
    prefill_seconds: float = 0.0  # those jobs' wall time: no round ran meanwhile
    prompts_in_steps: int = 0  # prompts prefilled as rows of the rounds' steps, in no job

    def line(self, open_sessions: int, kv_bytes: int) -> str:
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        text = (
            f"last {self.seconds:.1f} s: {self.calls} verify calls, {self.tokens} tokens "
            f"committed ({rate:.1f} tok/s)"
        )
        if self.forwards:
            text += (
                f", round forwards {self.forwards} ({self.sessions / self.forwards:.1f} "
                f"sessions each, widest {self.widest})"
            )
        if self.timed:
            held, computing = 1000 * self.held / self.timed, 1000 * self.computing / self.timed
            text += f"; a call held {held:.1f} ms ({held - computing:.1f} waiting)"
        if self.returns:
            away = 1000 * self.away / self.returns
            text += f", away {away:.1f} ms between calls (longest {1000 * self.longest_away:.0f})"
        if self.prefill_jobs:
            text += (
                f"; prefills {self.prefill_prompts} in {self.prefill_jobs} jobs, "
                f"{1000 * self.prefill_seconds:.0f} ms"
            )
        if self.prompts_in_steps:
            text += f"; {self.prompts_in_steps} prompts prefilled in the steps"
        return text + f"; {open_sessions} sessions open, KV {kv_bytes / 2**20:.1f} MiB"


class LoadStats:
    """Counted where the work happens (the MLX thread's forwards, the event loop's answers),
    taken and reset by the periodic report."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._since = clock()
        self._interval = self._empty()

    @staticmethod
    def _empty() -> Interval:
        return Interval(0.0, 0, 0, 0, 0, 0)

    def stepped(self, sessions: int) -> None:
        with self._lock:
            now = self._interval
            now.forwards += 1
            now.sessions += sessions
            now.widest = max(now.widest, sessions)

    def prefilled(self, prompts: int, seconds: float) -> None:
        """A prefill job ran for `seconds`, ending the prefills of `prompts` prompts."""
        with self._lock:
            now = self._interval
            now.prefill_jobs += 1
            now.prefill_prompts += prompts
            now.prefill_seconds += seconds

    def opened_in_steps(self) -> None:
        """A prompt's prefill ended as rows of the rounds' steps."""
        with self._lock:
            self._interval.prompts_in_steps += 1

    def arrived(self, last_answer: float | None) -> float:
        """A verify call came for a session last answered at `last_answer` (None: never):
        counts the time it was away; returns the arrival time for `answered`."""
        with self._lock:
            at = self._clock()
            if last_answer is not None:
                now = self._interval
                now.returns += 1
                now.away += at - last_answer
                now.longest_away = max(now.longest_away, at - last_answer)
            return at

    def answered(self, tokens: int, arrived: float | None = None, computing: float = 0.0) -> float:
        """A verify call answered with `tokens` committed; with its `arrived` time, how long it
        was held here and how much of that its forwards took. Returns the answer's time (the
        session's next `arrived` takes it)."""
        with self._lock:
            now = self._interval
            now.calls += 1
            now.tokens += tokens
            at = self._clock()
            if arrived is not None:
                now.timed += 1
                now.held += at - arrived
                now.computing += min(computing, at - arrived)
            return at

    def take(self) -> Interval:
        with self._lock:
            now = self._clock()
            interval, self._interval = self._interval, self._empty()
            interval.seconds = now - self._since
            self._since = now
        return interval
