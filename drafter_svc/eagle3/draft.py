"""EAGLE-3 drafting: a per-session KV cache of committed context, chain and tree proposals.

An entry at position p is built from the target's hidden row at p and the token at p+1; its
output predicts the token at p+2. Entries exist only for committed positions; drafted entries
live for one proposal and are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from drafter_svc.eagle3.model import Eagle3Head
from drafter_svc.kv import EntryBuffers
from drafter_svc.proposal import Proposal, TreeShape, line_first, log_floor

if TYPE_CHECKING:  # its imports (mlx-lm) cost an n-gram drafter ~34 MiB
    from drafter_svc.eagle3.cpu_head import CpuHead


@dataclass
class Eagle3State:
    kv_shape: tuple[int, int]  # (kv heads, head dim) of the head's cache
    tokens: list[int] = field(default_factory=list)
    kv: EntryBuffers = field(default_factory=EntryBuffers)  # one layer, numpy [n_kv, cap, D]
    # target rows of positions without an entry yet: numpy float32 with a head on the host
    pending_rows: mx.array | np.ndarray | None = None
    last_hidden: np.ndarray | None = None  # output of the newest entry [H]

    @property
    def entries(self) -> int:
        return self.kv.entries

    @property
    def key_buffer(self) -> np.ndarray | None:
        return None if self.kv.layers is None else self.kv.layers[0][0]

    @property
    def value_buffer(self) -> np.ndarray | None:
        return None if self.kv.layers is None else self.kv.layers[0][1]

    @property
    def keys(self) -> np.ndarray:
        return self.kv.committed()[0][0]

    @property
    def values(self) -> np.ndarray:
        return self.kv.committed()[0][1]

    def reserve(self, more: int) -> None:
        """Room for `more` entries past the committed ones."""
        empty = np.empty((self.kv_shape[0], 0, self.kv_shape[1]), np.float32)
        self.kv.reserve(more, [(empty, empty)])

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """Entries [kv, T, D] after the committed ones."""
        self.kv.append([(k, v)])


class Eagle3Drafter:
    def __init__(self, head: Eagle3Head, embedding: mx.array, cpu_head: CpuHead | None = None):
        """cpu_head: the head's forwards of a few rows on numpy (CPU); None: all in MLX."""
        self.head = head
        self.embedding = embedding  # the target's [V, H]
        self.cpu_head = cpu_head
        self.cfg = head.config
        attn = head.midlayer.self_attn
        self.kv_shape = (attn.n_kv, attn.head_dim)
        self.d2t = np.asarray(head.d2t).astype(np.int64)
        self._steps = None  # a chain step's compiled halves, made at the first chain in MLX
        self.t2d = np.full(self.cfg.vocab_size, -1, dtype=np.int64)
        self.t2d[head.target_ids()] = np.arange(len(self.d2t))
        self.row_width = len(self.cfg.capture_layers) * self.cfg.feature_size

    # ------------------------------------------------------------ committed context
    def open(self, context_ids: list[int], rows) -> Eagle3State:
        state = Eagle3State(self.kv_shape)
        self.extend(state, context_ids, rows)
        return state

    def extend(self, state: Eagle3State, new_ids: list[int], rows) -> None:
        """Append committed tokens and the target rows of positions verified since last time;
        build entries for every position that has both its row and its next token."""
        state.tokens.extend(new_ids)
        if rows is not None and len(rows):
            rows = self._rows_here(rows)
            if rows.shape[-1] != self.row_width:
                raise ValueError(
                    f"hidden rows are {rows.shape[-1]} wide; this head needs {self.row_width} "
                    f"(layers {list(self.cfg.capture_layers)} x {self.cfg.feature_size})"
                )
            if state.pending_rows is None:
                state.pending_rows = rows
            elif isinstance(rows, np.ndarray):
                state.pending_rows = np.concatenate([state.pending_rows, rows])
            else:
                state.pending_rows = mx.concatenate([state.pending_rows, rows])
        have = 0 if state.pending_rows is None else state.pending_rows.shape[0]
        room = len(state.tokens) - 1 - state.entries  # positions whose next token is known
        if have > room:
            state.pending_rows = state.pending_rows[: max(0, room)] if room > 0 else None
            state.tokens = state.tokens[: len(state.tokens) - len(new_ids)]
            raise ValueError(
                f"{have} hidden rows for {room} positions: send one row per verified "
                "position (the prompt, then the last token and the accepted drafts)"
            )
        count = min(have, room)
        if count <= 0:
            return
        start = state.entries
        rows_now = state.pending_rows[:count]
        state.pending_rows = state.pending_rows[count:] if have > count else None
        next_ids = state.tokens[start + 1 : start + 1 + count]
        state.reserve(count)
        if self.cpu_head is not None and count <= self.cpu_head.max_rows:
            hidden, k, v = self.cpu_head.step(
                self.cpu_head.embed(next_ids),
                self.cpu_head.features(rows_now),
                np.arange(start, start + count),
                state.key_buffer,
                state.value_buffer,
                start,
                np.tri(count, dtype=bool),
            )
        else:  # a prompt: MLX's sgemm
            emb = self.embedding[mx.array(next_ids)][None]
            feature = self.head.fc(mx.array(rows_now).astype(mx.float32))[None]
            out, (k, v) = self.head.step(
                emb, feature, start, _mlx_past(state), _causal(count, start)
            )
            hidden, k, v = np.array(out[0]), np.array(k[0]), np.array(v[0])
        state.append(k, v)
        state.last_hidden = hidden[-1]

    def _rows_here(self, rows):
        """Target rows where this head runs: float32 numpy for a head on the host, so a round
        there runs no MLX op (on a GPU such an op would queue behind the verifier's forwards);
        an mx.array for a head in MLX."""
        if self.cpu_head is None:
            return rows if isinstance(rows, mx.array) else mx.array(rows)
        if isinstance(rows, mx.array):  # in one process: the verifier's own arrays
            rows = np.array(rows.astype(mx.float32))
        return np.asarray(rows, dtype=np.float32)

    def ready(self, state: Eagle3State) -> bool:
        """Drafting needs the entry of the position just before the last committed token."""
        return state.last_hidden is not None and state.entries == len(state.tokens) - 1

    # ------------------------------------------------------------ proposals
    def _to_target(self, draft_ids) -> list[int]:
        d = np.asarray(draft_ids, dtype=np.int64)
        return (d + self.d2t[d]).tolist()

    def chain(
        self, state: Eagle3State, k: int, after: list[int] = (), p_min: float = 0.0
    ) -> Proposal:
        """k drafts past the committed context, or past `after`: speculative tokens not yet
        verified, which have no target rows, so each is fed with the head's own output as
        its feature, as a chain's drafts are. p_min: the chain ends before a draft after the
        first to which the head gives a probability below it (a draft it is unsure of is
        rarely kept, and each costs the verify a row)."""
        if not self.ready(state) or k <= 0:
            return Proposal([])
        if self.cpu_head is None:
            return self._chain_on_device(state, k, after, p_min)
        levels = self._levels(state, len(after) + k)
        position = state.entries  # of the first drafted entry
        hidden = state.last_hidden[None]

        def feed(token: int) -> np.ndarray:
            nonlocal position
            out = levels.forward([token], hidden, position, None)
            position += 1
            return out

        for token in after:
            hidden = feed(token)
        ids: list[int] = []
        while True:
            logits = levels.logits(hidden)[0]
            best = int(np.argmax(logits))
            if ids and p_min > 0 and top_probability(logits, best) < p_min:
                return Proposal(self._to_target(ids))
            ids.append(best)
            if len(ids) == k:
                return Proposal(self._to_target(ids))
            hidden = feed(self._to_target(ids[-1:])[0])

    def _chain_on_device(
        self, state: Eagle3State, k: int, after: list[int], p_min: float
    ) -> Proposal:
        """The chain as one MLX graph: each draft's argmax feeds the next step where it is
        computed, and Python waits once, for all k, instead of after every step (on a GPU a
        wait per step costs more than the step). A step's work before and after its attention
        is one compiled call each (`_compiled_step`), so Python builds a few operations a step
        instead of ~40."""
        step_in, step_out, read = self._compiled_step()
        keys, values = _mlx_past(state)
        position = state.entries
        hidden = mx.array(state.last_hidden[None])  # [1, H]
        scale = self.head.midlayer.self_attn.scale

        def feed(emb: mx.array) -> tuple[mx.array, mx.array, mx.array]:
            nonlocal keys, values, position
            q, k_new, v_new, residual = step_in(emb, hidden, mx.array(position, dtype=mx.int32))
            keys = mx.concatenate([keys, k_new], axis=2)
            values = mx.concatenate([values, v_new], axis=2)
            position += 1
            return step_out(mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale),
                            residual)  # fmt: skip

        if not after:
            hidden, draft, emb, prob = read(hidden)  # the first draft, from the last row
        for token in after:
            hidden, draft, emb, prob = feed(self.embedding[mx.array([token])][None])
        drafts, probs = [draft], [prob]
        while len(drafts) < k:
            hidden, draft, emb, prob = feed(emb)
            drafts.append(draft)
            probs.append(prob)
        ids = mx.concatenate(drafts).tolist()
        if p_min > 0:  # the whole chain is one graph: trimmed once it is read
            unsure = [j for j, p in enumerate(mx.concatenate(probs).tolist()) if j and p < p_min]
            ids = ids[: unsure[0]] if unsure else ids
        return Proposal(self._to_target(ids))

    def _compiled_step(self):
        """(step_in, step_out, read), compiled once: step_in(emb [1,1,H], feature [1,H],
        position) -> (q, k, v, residual); step_out(attention [1,nh,1,D], residual) -> read of
        the step's hidden row; read(hidden [1,H]) -> (hidden, the draft-vocab argmax [1], its
        target embedding [1,1,H], the head's probability for it [1])."""
        if self._steps is None:
            head, d2t = self.head, mx.array(self.d2t)
            mid, attn = head.midlayer, head.midlayer.self_attn

            def step_in(emb, feature, position):
                x, residual = mid.inputs(emb, feature[None])
                return (*attn.project(x, position), residual)

            def read(hidden):
                logits = head.logits(hidden)
                draft = mx.argmax(logits, axis=-1)
                prob = mx.exp(mx.max(logits, axis=-1) - mx.logsumexp(logits, axis=-1))
                return hidden, draft, self.embedding[draft + d2t[draft]][None], prob

            def step_out(out, residual):
                out = attn.o_proj(out.transpose(0, 2, 1, 3).reshape(1, 1, -1))
                return read(mid.finish(out, residual)[0])

            self._steps = tuple(map(mx.compile, (step_in, step_out, read)))
        return self._steps

    def _levels(self, state: Eagle3State, most: int) -> _CpuLevels | _MlxLevels:
        """Where a proposal's drafted entries go: `most` of them at the most."""
        if self.cpu_head is not None:
            return _CpuLevels(self.cpu_head, state, most)
        return _MlxLevels(self, state)

    def tree(self, state: Eagle3State, shape: TreeShape, min_prob: float = 0.0) -> Proposal:
        """Expand the top_k best nodes per depth (by cumulative log-prob), each with its top_k
        children; send the best total_tokens nodes, closed under ancestors, likeliest line first
        (`line_first`).
        min_prob: no node whose path probability is below it, the likeliest first draft aside,
        is sent or expanded (each node costs the verify a row)."""
        if not self.ready(state) or shape.total_tokens <= 0 or shape.depth <= 0:
            return Proposal([], parents=[])
        top_k = max(1, min(shape.top_k, self.cfg.draft_vocab_size))
        floor = log_floor(min_prob)
        # candidate pool: token (draft id), parent (pool index or -1), score, depth
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        depths: list[int] = []
        # expanded entries (drafter-side tree attention): pool index -> column in tree keys
        expanded_col: dict[int, int] = {}

        def add_children(parent: int, logp_row: np.ndarray, base: float, depth: int) -> None:
            best = np.argpartition(-logp_row, top_k - 1)[:top_k]
            for d in best[np.argsort(-logp_row[best], kind="stable")]:
                if base + float(logp_row[d]) < floor and tokens:
                    break  # the rest score lower still
                tokens.append(int(d))
                parents.append(parent)
                scores.append(base + float(logp_row[d]))
                depths.append(depth)

        levels = self._levels(state, top_k * (shape.depth - 1))
        add_children(-1, levels.logp(state.last_hidden[None])[0], 0.0, 1)
        frontier = list(range(len(tokens)))
        parent_hidden = {i: state.last_hidden for i in frontier}  # hidden feeding each node
        for depth in range(1, shape.depth):
            n = len(frontier)
            if not n:
                break
            # each new entry sees the committed context, its expanded ancestors and itself
            cols = levels.columns
            mask = np.zeros((n, state.entries + cols + n), dtype=bool)
            mask[:, : state.entries] = True
            for row, node in enumerate(frontier):
                a = parents[node]
                while a >= 0:
                    mask[row, state.entries + expanded_col[a]] = True
                    a = parents[a]
                mask[row, state.entries + cols + row] = True
            hidden = levels.forward(
                self._to_target([tokens[i] for i in frontier]),
                np.stack([parent_hidden[i] for i in frontier]),
                state.entries + depth - 1,
                mask,
            )
            for row, node in enumerate(frontier):
                expanded_col[node] = cols + row
            logp = levels.logp(hidden)
            first_new = len(tokens)
            for row, node in enumerate(frontier):
                before = len(tokens)
                add_children(node, logp[row], scores[node], depth + 1)
                for child in range(before, len(tokens)):
                    parent_hidden[child] = hidden[row]
            new = list(range(first_new, len(tokens)))
            frontier = sorted(new, key=lambda i: -scores[i])[:top_k]
        chosen = _best_closed(parents, scores, shape.total_tokens)
        chosen.sort(key=lambda i: (depths[i], -scores[i]))  # parents first, likeliest first
        index = {node: j for j, node in enumerate(chosen)}
        order, out_parents = line_first([index[parents[i]] if parents[i] >= 0 else -1
                                         for i in chosen])  # fmt: skip
        chosen = [chosen[j] for j in order]
        return Proposal(self._to_target([tokens[i] for i in chosen]), parents=out_parents,
                        scores=[scores[i] for i in chosen])  # fmt: skip


class _MlxLevels:
    """A proposal's drafted entries (a chain's, or a tree's level by level) in MLX, kept
    beside copies of the committed ones."""

    def __init__(self, drafter: Eagle3Drafter, state: Eagle3State):
        self.drafter = drafter
        self.keys, self.values = _mlx_past(state)
        self.columns = 0  # drafted entries so far

    def forward(self, target_ids, feats: np.ndarray, position: int, mask: np.ndarray | None):
        """mask [n, every entry so far + n]; None: one entry that sees them all (a chain's)."""
        head = self.drafter.head
        emb = self.drafter.embedding[mx.array(target_ids)][None]
        mask = None if mask is None else mx.array(mask)
        out, (k, v) = head.step(
            emb, mx.array(feats)[None], position, (self.keys, self.values), mask
        )
        self.keys = mx.concatenate([self.keys, k], axis=2)
        self.values = mx.concatenate([self.values, v], axis=2)
        self.columns += len(target_ids)
        return np.array(out[0])

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return np.array(self.drafter.head.logits(mx.array(hidden)))

    def logp(self, hidden: np.ndarray) -> np.ndarray:
        logits = self.drafter.head.logits(mx.array(hidden))
        return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


_SEES_ALL_BEFORE = np.ones((1, 1), dtype=bool)  # one new entry, every cached one visible


class _CpuLevels:
    """A proposal's drafted entries on the CPU, in the cache's scratch rows past the
    committed ones, where the next commit overwrites them."""

    def __init__(self, cpu_head: CpuHead, state: Eagle3State, most: int):
        state.reserve(most)
        self.cpu_head, self.state = cpu_head, state
        self.columns = 0

    def forward(self, target_ids, feats: np.ndarray, position: int, mask: np.ndarray | None):
        """mask [n, every entry so far + n]; None: one entry that sees them all (a chain's)."""
        state, n = self.state, len(target_ids)
        past = state.entries + self.columns
        if mask is None:
            mask = _SEES_ALL_BEFORE
        elif mask[:, :past].all():  # every earlier entry seen: the compiled kernel's form
            mask = np.ascontiguousarray(mask[:, past:])
        hidden, k, v = self.cpu_head.step(
            self.cpu_head.embed(target_ids), feats, np.full(n, position), state.key_buffer,
            state.value_buffer, past, mask,
        )  # fmt: skip
        state.key_buffer[:, past : past + n] = k
        state.value_buffer[:, past : past + n] = v
        self.columns += n
        return hidden

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return self.cpu_head.logits(hidden)

    def logp(self, hidden: np.ndarray) -> np.ndarray:
        logits = self.logits(hidden)
        top = logits.max(axis=-1, keepdims=True)
        return logits - (top + np.log(np.exp(logits - top).sum(axis=-1, keepdims=True)))


def top_probability(logits: np.ndarray, best: int) -> float:
    """The softmax probability of logits[best] (its largest entry)."""
    return float(1.0 / np.exp(logits.astype(np.float64) - float(logits[best])).sum())


def _mlx_past(state: Eagle3State) -> tuple[mx.array, mx.array] | None:
    """The committed entries as MLX's step takes them, [1, kv, entries, D]."""
    if not state.entries:
        return None
    return mx.array(state.keys[None]), mx.array(state.values[None])


def _causal(count: int, past: int) -> mx.array | None:
    if count == 1:
        return None
    new = np.tril(np.ones((count, count), dtype=bool))
    return mx.array(np.concatenate([np.ones((count, past), dtype=bool), new], axis=1))


def _best_closed(parents: list[int], scores: list[float], budget: int) -> list[int]:
    """The `budget` best nodes by score whose ancestors are all chosen too."""
    chosen: list[int] = []
    taken: set[int] = set()
    for i in sorted(range(len(parents)), key=lambda i: -scores[i]):
        if len(chosen) >= budget:
            break
        if parents[i] >= 0 and parents[i] not in taken:
            continue  # a child never outscores its parent, but ties must not break closure
        chosen.append(i)
        taken.add(i)
    return chosen
