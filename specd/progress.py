"""A progress line for long commands (train, distill): redrawn in place on a terminal, one line
per interval when the output goes to a log, so a log never gets one endless line."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

TERMINAL_INTERVAL_S = 0.2
LOG_INTERVAL_S = 30.0


class Progress:
    def __init__(
        self,
        stream: TextIO | None = None,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = bool(getattr(self.stream, "isatty", lambda: False)())
        if interval_s is None:
            interval_s = TERMINAL_INTERVAL_S if self.terminal else LOG_INTERVAL_S
        self.interval_s = interval_s
        self.clock = clock
        self._shown_at: float | None = None
        self._pending = ""  # the newest text not written yet

    def update(self, text: str, final: bool = False) -> None:
        """Show `text` if the interval has passed since the last line (or it is the final)."""
        now = self.clock()
        self._pending = text
        if not final and self._shown_at is not None and now - self._shown_at < self.interval_s:
            return
        self._shown_at = now
        self._write(text)

    def close(self) -> None:
        """End the line on a terminal; in a log, write the newest text if it was held back."""
        if self.terminal:
            self.stream.write("\n")
        elif self._pending:
            self._write(self._pending)
        self.stream.flush()

    def _write(self, text: str) -> None:
        if self.terminal:
            self.stream.write("\r" + text + "\x1b[K")  # erase what a longer line left
        else:
            self.stream.write(text + "\n")
        self._pending = ""
        self.stream.flush()
