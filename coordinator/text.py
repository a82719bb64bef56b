"""Committed ids -> streamed text, with stop strings held back until they cannot match."""

from __future__ import annotations


class TextStream:
    def __init__(self, detokenizer, stop: list[str]):
        self.detokenizer = detokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def add(self, token_id: int) -> bool:
        """Feed one token; True when a stop string has just completed (text is cut before it)."""
        self.detokenizer.add_token(token_id)
        return self._append(self.detokenizer.last_segment)

    def _append(self, segment: str) -> bool:
        if self.stopped or not segment:
            return self.stopped
        search_from = max(0, len(self.text) - self.hold)
        self.text += segment
        hits = [i for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        return self.stopped

    def take(self) -> str:
        """Text that can no longer become part of a stop string."""
        end = len(self.text) if self.stopped else max(self.emitted, len(self.text) - self.hold)
        out, self.emitted = self.text[self.emitted : end], end
        return out

    def finish(self) -> str:
        """Flush everything, e.g. bytes of an unfinished UTF-8 character."""
        self.detokenizer.finalize()
        self._append(self.detokenizer.last_segment)
        out, self.emitted = self.text[self.emitted :], len(self.text)
        return out
