"""What every drafter is to its servicer (Proposer), and what it returns: a chain of drafts, or
a tree of them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np


@dataclass
class Proposal:
    ids: list[int]
    probs: np.ndarray | None = None  # [len(ids), vocab] draft distributions, when sampled
    # tree drafts: parent index of each draft in `ids` (-1: the last committed token); listed
    # parents-first (the drafters: `line_first`). None: a chain (each draft follows the
    # previous one).
    parents: list[int] | None = None
    # tree drafts: each draft's path log-probability under the drafter, where it scores them
    # (sent as DraftResponse.draft_scores: the coordinator cuts a tree at the verify's prices)
    scores: list[float] | None = None


@dataclass
class TreeShape:
    # drafts sent for verification; 15 make a verify of 16 tokens, where a 17th pads the CPU
    # kernels' products to 20 rows (it cost 15 % more there, docs/results.md)
    total_tokens: int = 15
    depth: int = 5  # longest root-to-leaf path
    top_k: int = 4  # children per expanded node, and nodes expanded per depth

    def describe(self) -> str:
        """As a drafter's params list it: "chain" when it drafts none."""
        if self.total_tokens <= 0:
            return "chain"
        return f"total={self.total_tokens} depth={self.depth} top_k={self.top_k}"


def line_first(parents: list[int]) -> tuple[list[int], list[int]]:
    """A tree listed parents-first, each node's children likeliest first, put in depth-first
    order: its likeliest line takes the first places, so when the target keeps that line its
    KV rows are already where they stay (a kept path elsewhere is moved down). Returns the
    nodes' old indices in the new order and their parents in it."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    order: list[int] = []
    stack = list(reversed(children.get(-1, [])))
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children.get(node, [])))
    place = {node: i for i, node in enumerate(order)}
    return order, [place[parents[node]] if parents[node] >= 0 else -1 for node in order]


def log_floor(min_prob: float) -> float:
    """A tree's --tree-min-prob as the log-probability its node scores are compared with."""
    return math.log(min_prob) if min_prob > 0 else -math.inf


class Proposer(Protocol):
    """A drafting method (n-gram, EAGLE-3, DFlash): per-session state from the committed
    context, and drafts from it."""

    kind: str
    capture_layers: tuple[int, ...]  # target layers whose hidden rows it reads; () none
    sends_draft_probs: bool  # proposals carry q rows when sampling
    accepts_speculative_ids: bool  # can draft past tokens not verified yet
    default_draft_tokens: int
    max_draft_tokens: int
    default_tree: TreeShape | None  # None: it drafts chains only
    text_driven: bool  # drafts by matching the text (no model): its acceptance follows the text

    def open(self, context_ids: list[int], hidden_rows=None) -> Any: ...
    def extend(self, state: Any, new_ids: list[int], hidden_rows=None) -> None: ...
    def propose(
        self, state: Any, k: int, sampling=None, speculative=(), tree: TreeShape | None = None
    ) -> Proposal: ...
    def params(self) -> dict[str, str]: ...


def joined_rows(rows):
    """Hidden rows as a proposer takes them: one array, or None. In one process the round loop
    hands over a list of arrays (some empty); over gRPC they arrive joined."""
    if rows is None:
        return None
    if isinstance(rows, list):  # in-process: the round loop hands over a list of arrays
        rows = [r for r in rows if r is not None and len(r)]
        return mx.concatenate(rows) if rows else None
    return rows
