"""DFlash drafting: per-session context keys/values of committed positions, one forward per
block. Only accepted context is cached; the block is never cached."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from drafter_svc.dflash.model import DFlashDrafter
from drafter_svc.kv import EntryBuffers
from drafter_svc.proposal import Proposal, TreeShape, line_first, log_floor


@dataclass
class DFlashState:
    tokens: list[int] = field(default_factory=list)
    kv: EntryBuffers = field(default_factory=EntryBuffers)  # per layer, MLX [1, kv, cap, D]

    @property
    def entries(self) -> int:  # context positions with keys (rows received)
        return self.kv.entries

    def context(self) -> list[tuple[mx.array, mx.array]]:
        return self.kv.committed()

    def append(self, kvs: list[tuple[mx.array, mx.array]]) -> None:
        self.kv.append(kvs)


class BlockDrafter:
    def __init__(
        self, model: DFlashDrafter, embedding: mx.array, lm_head: mx.array, readout_ids=None
    ):
        """readout_ids: read out only these target tokens (drafts never leave them). The full
        head is ~113 MB in float32 and reading it dominated a draft on CPU."""
        self.model = model
        self.cfg = model.config
        self.embedding = embedding  # the target's [V, H]
        self.vocab_size = lm_head.shape[0]
        self.readout_ids = None
        if readout_ids is not None:
            self.readout_ids = np.sort(np.asarray(readout_ids, dtype=np.int64))
            lm_head = lm_head[mx.array(self.readout_ids)]
            mx.eval(lm_head)
        self.lm_head = lm_head  # the target's [V, H], or the readout tokens' rows of it
        self.row_width = len(self.cfg.target_layer_ids) * self.cfg.feature_size

    def open(self, context_ids: list[int], rows) -> DFlashState:
        state = DFlashState()
        self.extend(state, context_ids, rows)
        return state

    def extend(self, state: DFlashState, new_ids: list[int], rows) -> None:
        state.tokens.extend(new_ids)
        if rows is None or not len(rows):
            return
        rows = mx.array(rows) if not isinstance(rows, mx.array) else rows
        if rows.shape[-1] != self.row_width:
            state.tokens = state.tokens[: len(state.tokens) - len(new_ids)]
            raise ValueError(
                f"hidden rows are {rows.shape[-1]} wide; this drafter needs {self.row_width} "
                f"(layers {list(self.cfg.target_layer_ids)} x {self.cfg.feature_size})"
            )
        room = len(state.tokens) - 1 - state.entries  # the last token's row comes later
        if rows.shape[0] > room:
            state.tokens = state.tokens[: len(state.tokens) - len(new_ids)]
            raise ValueError(
                f"{rows.shape[0]} hidden rows for {room} positions: send one row per verified "
                "position (the prompt, then the last token and the accepted drafts)"
            )
        kvs = self.model.context_kv(rows.astype(mx.float32)[None], state.entries)
        state.append(kvs)
        mx.eval([b for pair in state.kv.layers for b in pair])

    def ready(self, state: DFlashState) -> bool:
        return state.entries > 0 and state.entries == len(state.tokens) - 1

    def block_logits(self, state: DFlashState, size: int) -> mx.array:
        """Logits [size - 1, V] for the block [last token, MASK x (size - 1)], over the
        readout tokens only when the drafter has them."""
        n = len(state.tokens) - 1  # position of the last committed token
        block = mx.array([state.tokens[-1]] + [self.cfg.mask_token_id] * (size - 1))
        hidden = self.model(self.embedding[block][None], n, state.context())
        return hidden[0, 1:] @ self.lm_head.T

    def propose(self, state: DFlashState, k: int, temperature: float = 0.0, rng=None):
        """k drafts from one block of k + 1: argmax, or sampled with their distributions."""
        if not self.ready(state) or k <= 0:
            return Proposal([])
        logits = self.block_logits(state, k + 1).astype(mx.float32)
        if temperature <= 0:
            return Proposal(self._target_ids(np.array(mx.argmax(logits, axis=-1))))
        # each position is drafted independently of the sampled ones before it, so its own
        # distribution q_j is the proposal the acceptance rule needs
        q = np.array(mx.softmax(logits / temperature, axis=-1))
        rng = rng or np.random.default_rng()
        ids = self._target_ids(np.array([rng.choice(q.shape[1], p=row / row.sum()) for row in q]))
        if self.readout_ids is not None:  # q is 0 on tokens outside the readout
            full = np.zeros((len(q), self.vocab_size), dtype=np.float32)
            full[:, self.readout_ids] = q
            q = full
        return Proposal(ids, probs=q.astype(np.float32))

    def tree(
        self, state: DFlashState, shape: TreeShape, block_drafts: int = 0, min_prob: float = 0.0
    ) -> Proposal:
        """A tree from one block of max(shape.depth, block_drafts) + 1 (a drafter trained on
        blocks of 16 guesses worse in shorter ones): each position's top_k tokens are the
        children of every node at the depth before it, and the total_tokens nodes of highest
        summed log-probability are sent. The block already scores every position, so a tree
        costs no more forwards than a chain; its nodes go to the likelier alternatives near the
        root instead of the unlikely far end of one chain. Drafts are deterministic (no q).
        min_prob: no node whose path probability is below it, the likeliest first draft aside,
        is sent (each node costs the verify a row)."""
        if not self.ready(state) or shape.total_tokens <= 0 or shape.depth <= 0:
            return Proposal([], parents=[])
        size = max(shape.depth, block_drafts) + 1
        logits = self.block_logits(state, size).astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        top_k = max(1, min(shape.top_k, logp.shape[1]))
        # a partition, not a sort of the readout (a whole sort cost ~4x on the CPU)
        best = mx.argpartition(-logp, kth=top_k - 1, axis=-1)[:, :top_k]
        best_logp = np.array(mx.take_along_axis(logp, best, axis=-1))
        order = np.argsort(-best_logp, axis=-1, kind="stable")
        ranked = np.take_along_axis(np.array(best), order, axis=-1)
        ranked_logp = np.take_along_axis(best_logp, order, axis=-1)
        floor = log_floor(min_prob)
        parents, tokens = best_first_tree(ranked_logp[: shape.depth], shape.total_tokens, floor)
        ids = self._target_ids(np.array([ranked[d, r] for d, r in tokens], dtype=np.int64))
        scores: list[float] = []  # path log-probabilities, parents listed first
        for parent, (d, r) in zip(parents, tokens, strict=True):
            scores.append((0.0 if parent < 0 else scores[parent]) + float(ranked_logp[d, r]))
        return Proposal(ids, parents=parents, scores=scores)

    def _target_ids(self, index: np.ndarray) -> list[int]:
        if self.readout_ids is None:
            return [int(i) for i in index]
        return [int(i) for i in self.readout_ids[index]]


def best_first_tree(
    ranked_logp: np.ndarray, budget: int, floor: float = -math.inf
) -> tuple[list[int], list[tuple[int, int]]]:
    """The `budget` best root paths through per-depth candidate lists, each list's log-probs
    [depth, top_k] sorted best first and the same under every parent; after the first, none
    scoring below `floor` (a log-probability). Returns each node's parent
    (-1: the root) and its (depth, rank), likeliest line first (`line_first`). Pops come in
    falling score: a node's next sibling and first child enter the heap only when it is taken,
    and neither can outscore it."""
    depth_count, width = ranked_logp.shape
    parents: list[int] = []
    picks: list[tuple[int, int]] = []
    heap = [(-float(ranked_logp[0, 0]), 0, 0, -1)]  # (-score, depth, rank, parent node)
    while heap and len(picks) < budget:
        if picks and -heap[0][0] < floor:
            break  # pops come in falling score
        neg, depth, rank, parent = heapq.heappop(heap)
        node = len(picks)
        parents.append(parent)
        picks.append((depth, rank))
        if rank + 1 < width:
            sibling = neg + float(ranked_logp[depth, rank] - ranked_logp[depth, rank + 1])
            heapq.heappush(heap, (sibling, depth, rank + 1, parent))
        if depth + 1 < depth_count:
            heapq.heappush(heap, (neg - float(ranked_logp[depth + 1, 0]), depth + 1, 0, node))
    order, out_parents = line_first(parents)  # siblings popped likeliest first
    return out_parents, [picks[n] for n in order]
