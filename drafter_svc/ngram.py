"""Prompt-lookup (n-gram) drafting: propose what followed an earlier copy of the context's tail."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from drafter_svc.proposal import Proposal

PICKS = ("earliest", "latest")  # which earlier occurrence of the suffix gives the drafts


def propose_ngram(tokens, k: int, min_n: int, max_n: int, pick: str = "earliest") -> list[int]:
    """Up to k tokens that followed an earlier occurrence (the earliest or the latest, `pick`)
    of the longest suffix n-gram.

    Tries n from max_n down to min_n; an occurrence may overlap the suffix but not be it.
    Returns fewer than k tokens when the match sits near the end of the context, and
    nothing when no suffix n-gram recurs or the context is shorter than min_n.
    """
    if k <= 0 or min_n < 1 or max_n < min_n:
        return []
    context = np.asarray(tokens, dtype=np.int64)  # [n_ctx]
    n_ctx = context.shape[0]
    for n in range(min(max_n, n_ctx - 1), min_n - 1, -1):
        suffix = context[n_ctx - n :]
        # windows start at 0 .. n_ctx - n - 1: every place but the suffix itself
        windows = sliding_window_view(context[: n_ctx - 1], n)  # [n_ctx - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[0] if pick == "earliest" else hits[-1]) + n
            return context[start : start + k].tolist()
    return []


@dataclass
class NgramConfig:
    # Chosen with benchmarks/sweep_ngram.py (docs/history): on CPU fp32 a rejected draft
    # token costs ~6 ms of verify next to a ~57 ms decode step, so precision matters.
    num_draft_tokens: int = 8  # long copies (input-grounded tasks) pay off; 4 and 12 measured
    min_n: int = 2  # 1-token matches were wrong too often: 1.05x vs 1.16x at k=8
    max_n: int = 4  # longer suffixes pick the right earlier copy in repetitive text
    max_draft_tokens: int = 64  # per-request k above this is refused


class NgramProposer:
    """Per-session state is just the committed context; no hidden rows needed."""

    kind = "ngram"
    capture_layers: tuple[int, ...] = ()
    sends_draft_probs = False
    accepts_speculative_ids = True  # needs no hidden rows for assumed tokens
    default_tree = None  # chains only
    text_driven = True  # it drafts only where the text repeats itself

    def __init__(self, config: NgramConfig | None = None):
        self.config = config or NgramConfig()
        self.default_draft_tokens = self.config.num_draft_tokens
        self.max_draft_tokens = self.config.max_draft_tokens

    def open(self, context_ids: list[int], hidden_rows=None) -> list[int]:
        return list(context_ids)

    def extend(self, state: list[int], new_ids: list[int], hidden_rows=None) -> None:
        state.extend(new_ids)

    def propose(self, state: list[int], k: int, sampling=None, speculative=(), tree=None):
        cfg = self.config
        context = [*state, *speculative] if speculative else state
        return Proposal(propose_ngram(context, k, cfg.min_n, cfg.max_n))

    def params(self) -> dict[str, str]:
        cfg = self.config
        return {"min_n": str(cfg.min_n), "max_n": str(cfg.max_n)}
