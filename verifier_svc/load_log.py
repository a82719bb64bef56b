"""The verifier's load, logged every few seconds (`--log-stats`): how many calls and tokens it
served, and how many sessions its shared forwards held. Under many clients the last figure
says whether the sessions run in step (one forward for all) or fall apart into small ones."""

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
        return text + f"; {open_sessions} sessions open, KV {kv_bytes / 2**20:.1f} MiB"


class LoadStats:
    """Counted where the work happens (the MLX thread's forwards, the event loop's answers),
    taken and reset by the periodic report."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._since = clock()
        self._calls = self._tokens = self._forwards = self._sessions = self._widest = 0

    def stepped(self, sessions: int) -> None:
        with self._lock:
            self._forwards += 1
            self._sessions += sessions
            self._widest = max(self._widest, sessions)

    def answered(self, tokens: int) -> None:
        with self._lock:
            self._calls += 1
            self._tokens += tokens

    def take(self) -> Interval:
        with self._lock:
            now = self._clock()
            interval = Interval(now - self._since, self._calls, self._tokens, self._forwards,
                                self._sessions, self._widest)  # fmt: skip
            self._since = now
            self._calls = self._tokens = self._forwards = self._sessions = self._widest = 0
        return interval
