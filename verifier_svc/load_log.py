"""The verifier's load, logged every few seconds (`--log-stats`): how many calls and tokens it
served, and how many sessions its shared forwards held. Under many clients the last figure
says whether the sessions run in step (one forward for all) or fall apart into small ones;
where a session spends the time between them says why: away (from an answer to the session's
next call: the coordinator, the drafter, the network) or held here (from a call's arrival to
its answer: waiting for the forwards, then in them)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

FORGET_AFTER_S = 3600.0  # a session's last answer this old is not waited for any more
PRUNE_FROM = 1024  # sessions remembered before the stale ones are dropped


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
        return text + f"; {open_sessions} sessions open, KV {kv_bytes / 2**20:.1f} MiB"


class LoadStats:
    """Counted where the work happens (the MLX thread's forwards, the event loop's answers),
    taken and reset by the periodic report."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._since = clock()
        self._interval = self._empty(0.0)
        self._answered_at: dict[str, float] = {}  # per session: its last answer
        self._prune_at = PRUNE_FROM

    @staticmethod
    def _empty(seconds: float) -> Interval:
        return Interval(seconds, 0, 0, 0, 0, 0)

    def stepped(self, sessions: int) -> None:
        with self._lock:
            now = self._interval
            now.forwards += 1
            now.sessions += sessions
            now.widest = max(now.widest, sessions)

    def arrived(self, session_id: str) -> float:
        """A verify call came: counts the time since the session's last answer; returns the
        arrival time for `answered`."""
        with self._lock:
            at = self._clock()
            last = self._answered_at.pop(session_id, None)
            if last is not None:
                now = self._interval
                now.returns += 1
                now.away += at - last
                now.longest_away = max(now.longest_away, at - last)
            return at

    def answered(
        self, tokens: int, session_id: str | None = None, arrived: float | None = None,
        computing: float = 0.0,
    ) -> None:  # fmt: skip
        """A verify call answered with `tokens` committed; with the session and its `arrived`
        time, how long it was held here and how much of that its forwards took."""
        with self._lock:
            now = self._interval
            now.calls += 1
            now.tokens += tokens
            if session_id is not None and arrived is not None:
                at = self._clock()
                now.timed += 1
                now.held += at - arrived
                now.computing += min(computing, at - arrived)
                self._answered_at[session_id] = at
                if len(self._answered_at) > self._prune_at:  # sessions dropped unclosed
                    stale = at - FORGET_AFTER_S
                    self._answered_at = {k: t for k, t in self._answered_at.items() if t > stale}
                    self._prune_at = max(PRUNE_FROM, 2 * len(self._answered_at))

    def closed(self, session_id: str) -> None:
        with self._lock:
            self._answered_at.pop(session_id, None)

    def take(self) -> Interval:
        with self._lock:
            now = self._clock()
            interval, self._interval = self._interval, self._empty(0.0)
            interval.seconds = now - self._since
            self._since = now
        return interval
