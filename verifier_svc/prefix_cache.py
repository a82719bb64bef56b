"""Prompts' KV kept for later sessions that begin with the same tokens.

Chat prompts share their openings: the template's system turn in every request, the whole
conversation so far in each new turn of a chat. A verifier that kept a prompt's keys and values
(and the rows a drafter was sent for it) gives a later prompt with the same first tokens those
rows, and prefills only the rest. Entries are evicted least recently used first, within a byte
budget.

Reuse is exact only where a token's keys and values do not depend on how a prompt was cut
into forwards: the CPU layers whose every row sums as a one-row product does
(`CpuLlama.rows_exact`), so a reused prefix is bit for bit the prefill it replaces. Elsewhere
(MLX's matrix products) a prefix computed as one chunk and continued in another can differ in
the last bits from the prompt's own chunks; the verifier keeps no prefixes there unless told.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

# the default size where reuse is exact: ~5,700 tokens of the embedded model's float32 KV
AUTO_BYTES = 256 << 20
# an entry reuses at least this many tokens, or the prompt is prefilled whole: a shorter match
# saves less than the copies cost
MIN_REUSED_TOKENS = 8


@dataclass(frozen=True)
class Prefix:
    """A stored prompt: its tokens and, per layer, keys and values [kv_heads, T, D]; the rows
    its session sent a drafter ([T, W] of the layers `capture`, in the dtype they were sent;
    None where none)."""

    tokens: np.ndarray
    keys: tuple[np.ndarray, ...]
    values: tuple[np.ndarray, ...]
    rows: Any = None  # an MLX or numpy array
    capture: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        arrays = [self.tokens, *self.keys, *self.values]
        return sum(a.nbytes for a in arrays) + (0 if self.rows is None else self.rows.nbytes)


@dataclass(frozen=True)
class Reuse:
    """The first `length` tokens of a prompt, found stored: their keys, values and rows."""

    length: int
    keys: tuple[np.ndarray, ...]
    values: tuple[np.ndarray, ...]
    rows: Any  # as the entry holds them, or None


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    tokens_reused: int = 0
    evicted: int = 0


class PrefixCache:
    """Stored prompts within `capacity_bytes`, the least recently used evicted first."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"a prefix cache needs a positive size, not {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.stats = PrefixStats()
        self._entries: OrderedDict[int, Prefix] = OrderedDict()  # oldest use first
        self._bytes = 0
        self._next_key = 0
        self._lock = threading.Lock()  # the MLX thread stores; sessions may open elsewhere

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def summary(self) -> str:
        """A log line: reuse so far and what is held."""
        st = self.stats
        return (
            f"prefix cache: {st.hits} of {st.lookups} prompts began with a stored one, "
            f"{st.tokens_reused} tokens reused; {len(self)} held, "
            f"{self.nbytes / 2**20:.1f} of {self.capacity_bytes / 2**20:.0f} MiB, "
            f"{st.evicted} evicted"
        )

    def clear(self) -> None:
        """Forget every entry and the counts (after the warm-up's prompts)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0
            self.stats = PrefixStats()

    def find(
        self, prompt_ids: list[int], capture: tuple[int, ...] = (), rows_dtype=None
    ) -> Reuse | None:
        """The longest stored beginning of `prompt_ids`, leaving its last token to compute
        (the first token's logits come from it); with `capture`, only entries that kept
        those layers' rows in `rows_dtype`. None below MIN_REUSED_TOKENS."""
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        limit = len(prompt) - 1
        with self._lock:
            self.stats.lookups += 1
            best, best_key, length = None, None, 0
            for key, entry in self._entries.items():
                if capture and (entry.capture != capture or entry.rows.dtype != rows_dtype):
                    continue
                shared = _common_length(entry.tokens, prompt, limit)
                if shared > length:
                    best, best_key, length = entry, key, shared
            if best is None or length < MIN_REUSED_TOKENS:
                return None
            self._entries.move_to_end(best_key)
            self.stats.hits += 1
            self.stats.tokens_reused += length
        rows = best.rows[:length] if capture else None
        return Reuse(
            length,
            tuple(k[:, :length] for k in best.keys),
            tuple(v[:, :length] for v in best.values),
            rows,
        )

    def add(self, prefix: Prefix) -> bool:
        """Store `prefix` (its arrays are kept, not copied): entries it extends are dropped,
        and it is not stored where one kept already extends it, nor past the capacity."""
        size = prefix.nbytes
        if len(prefix.tokens) < MIN_REUSED_TOKENS or size > self.capacity_bytes:
            return False
        with self._lock:
            for key, entry in list(self._entries.items()):
                if not _same_kind(entry, prefix):
                    continue
                if _extends(entry.tokens, prefix.tokens):
                    self._entries.move_to_end(key)
                    return False
                if _extends(prefix.tokens, entry.tokens):
                    self._drop(key)
            while self._bytes + size > self.capacity_bytes:
                self._drop(next(iter(self._entries)))
                self.stats.evicted += 1
            self._entries[self._next_key] = prefix
            self._next_key += 1
            self._bytes += size
        return True

    def _drop(self, key: int) -> None:
        self._bytes -= self._entries.pop(key).nbytes


def _same_kind(a: Prefix, b: Prefix) -> bool:
    """Whether one can stand for the other: the same layers' rows in the same dtype, or none."""
    if a.capture != b.capture or (a.rows is None) != (b.rows is None):
        return False
    return a.rows is None or a.rows.dtype == b.rows.dtype


def _common_length(a: np.ndarray, b: np.ndarray, limit: int) -> int:
    """How many first tokens a and b share, at most `limit`."""
    n = min(len(a), len(b), limit)
    if n <= 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _extends(longer: np.ndarray, shorter: np.ndarray) -> bool:
    return len(longer) >= len(shorter) and np.array_equal(longer[: len(shorter)], shorter)
