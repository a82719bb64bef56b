"""Every session's KV in one array per layer and kind, so one forward can serve many sessions.

A session owns a slot; its keys for layer i are rows of `KVPool`'s array [slots, kv_heads,
capacity, head_dim] (stored flat, [slots * kv_heads * capacity, head_dim], so a write of any
sessions' new rows is one scatter). `PooledCache` is a session's view of one layer, with the
interface mlx-lm's `KVCache` offers the model (update_and_fetch, offset, trim, state), so a
session alone runs the model's own forward as before. `batched_attention` is the point of it:
the new rows of many sessions, ragged offsets and all, written, gathered and attended with a
constant number of operations per layer, where per-session caches need several per session
(on a GPU each is a kernel launch; at 16 or 64 sessions the launches are the step).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from specd.models import pool_attention

CAPACITY_STEP = 256  # tokens a slot grows by, as mlx-lm's KVCache


class KVPool:
    """Slots of KV for `layers` decoder layers; arrays made at the first write (their heads,
    width and dtype are the keys') and grown, for every slot at once, as slots or lengths
    need."""

    def __init__(self, layers: int):
        self.layers = layers
        self.slots = 0
        self.capacity = 0
        self._free: list[int] = []
        self._used: set[int] = set()
        self._keys: list[mx.array | None] = [None] * layers
        self._values: list[mx.array | None] = [None] * layers
        self._shape: list[tuple[int, int] | None] = [None] * layers  # (slots, capacity) made
        self._indices: dict[tuple, mx.array] = {}  # a step's index, made once for all layers
        # a session's slot is released on whichever thread drops its last reference
        self._slots_lock = threading.Lock()

    # slots
    def open(self) -> list[PooledCache]:
        """A new session's caches, one per layer, sharing a slot freed when they are."""
        with self._slots_lock:
            if not self._free:
                grown = max(4, 2 * self.slots)
                self._free = list(range(grown - 1, self.slots - 1, -1))
                self.slots = grown
            slot = _Slot(self._free.pop())
            self._used.add(slot.index)
        weakref.finalize(slot, self._release, slot.index)
        return [PooledCache(self, layer, slot) for layer in range(self.layers)]

    def _release(self, index: int) -> None:
        with self._slots_lock:
            self._used.discard(index)
            self._free.append(index)
            self._free.sort(reverse=True)  # the lowest slot next: the used ones stay packed
            if not self._used:  # nothing open, so no forward uses the arrays: free them
                self._keys = [None] * self.layers
                self._values = [None] * self.layers
                self._shape = [None] * self.layers
                self.capacity = 0

    @property
    def open_slots(self) -> int:
        return len(self._used)

    def reserve(self, length: int) -> None:
        """Room for `length` tokens in every slot."""
        if length > self.capacity:
            self.capacity = -(-length // CAPACITY_STEP) * CAPACITY_STEP

    # arrays
    def arrays(self, layer: int, like: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """The layer's flat keys and values at the pool's current slots and capacity; `like`
        ([.., kv_heads, T, head_dim] keys) makes them the first time."""
        keys, values = self._keys[layer], self._values[layer]
        if keys is None:
            if like is None:
                raise RuntimeError("no KV written to this pool layer yet")
            heads, width = like.shape[-3], like.shape[-1]
            size = (self.slots * heads * self.capacity, width)
            keys, values = mx.zeros(size, like.dtype), mx.zeros(size, like.dtype)
        elif self._shape[layer] != (self.slots, self.capacity):
            keys, values = (self._grown(layer, a) for a in (keys, values))
        self._keys[layer], self._values[layer] = keys, values
        self._shape[layer] = (self.slots, self.capacity)
        return keys, values

    def _grown(self, layer: int, flat: mx.array) -> mx.array:
        slots, capacity = self._shape[layer]
        width = flat.shape[-1]
        heads = flat.shape[0] // (slots * capacity)
        grid = flat.reshape(slots, heads, capacity, width)
        grid = mx.pad(grid, [(0, self.slots - slots), (0, 0), (0, self.capacity - capacity),
                             (0, 0)])  # fmt: skip
        return grid.reshape(-1, width)

    def heads(self, layer: int) -> int:
        keys = self._keys[layer]
        return keys.shape[0] // (self.slots * self.capacity)

    def grid(self, flat: mx.array) -> mx.array:
        """[slots, kv_heads, capacity, head_dim] of a layer's flat array (no copy)."""
        return flat.reshape(self.slots, -1, self.capacity, flat.shape[-1])

    def write(self, layer: int, index: mx.array, keys: mx.array, values: mx.array) -> None:
        """Scatter rows [N, head_dim] of keys and values to flat rows `index` [N]."""
        flat_keys, flat_values = self.arrays(layer, keys)
        flat_keys[index] = keys.reshape(-1, keys.shape[-1]).astype(flat_keys.dtype)
        flat_values[index] = values.reshape(-1, values.shape[-1]).astype(flat_values.dtype)

    def write_slot(
        self, layer: int, slot: int, offset: int, keys: mx.array, values: mx.array
    ) -> None:
        """One session's new rows [kv_heads, T, head_dim] at its offset, as a slice update: a
        session alone makes no index and runs no scatter (cheaper on a GPU, where its decode
        step is a few launches per layer)."""
        for arrays, new in ((self._keys, keys), (self._values, values)):
            flat = self.arrays(layer, keys)[arrays is self._values]
            grid = self.grid(flat)
            grid[slot, :, offset : offset + new.shape[1]] = new.astype(flat.dtype)
            arrays[layer] = grid.reshape(flat.shape)

    def rows_index(self, slots: np.ndarray, offsets: np.ndarray, heads: int, tokens: int):
        """Flat rows of `tokens` new positions per head after each slot's offset: [B, H, T]."""
        head = np.arange(heads)[None, :, None]
        step = np.arange(tokens)[None, None, :]
        base = (slots[:, None, None] * heads + head) * self.capacity
        return base + offsets[:, None, None] + step

    def new_rows(self, slots: np.ndarray, offsets: np.ndarray, heads: int, tokens: int):
        """`rows_index` flat, as a device array made once per step (every layer's is the same)."""
        key = (slots.tobytes(), offsets.tobytes(), heads, tokens)
        return self._index(key, lambda: self.rows_index(slots, offsets, heads, tokens))

    def ragged_rows(self, slots: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
                    heads: int, spare: int = 0) -> mx.array:  # fmt: skip
        """The flat rows of a ragged step's real rows, [N * heads] in the order (row, head):
        session b's `lengths[b]` new positions after its offset, per head; then `spare`
        padding rows', all at the first session's position after its new rows, which nothing
        reads before the session writes it (the caller reserves room for it)."""

        def rows() -> np.ndarray:
            session = np.repeat(np.arange(len(lengths)), lengths)  # each row's
            place = np.arange(len(session)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            place = np.concatenate([offsets[session] + place,
                                    np.full(spare, spare_position(offsets, lengths))])  # fmt: skip
            session = np.concatenate([session, np.zeros(spare, dtype=session.dtype)])
            base = (slots[session, None] * heads + np.arange(heads)[None, :]) * self.capacity
            return base + place[:, None]

        key = ("ragged", slots.tobytes(), offsets.tobytes(), lengths.tobytes(), heads, spare)
        return self._index(key, rows)

    def _index(self, key: tuple, rows) -> mx.array:
        """The device array of `rows()` flattened, made once per step and pool capacity."""
        key = (*key, self.capacity)
        index = self._indices.get(key)
        if index is None:
            if len(self._indices) > 8:
                self._indices.clear()
            index = self._indices[key] = mx.array(rows().reshape(-1).astype(np.int32))
        return index

    def made(self, layer: int) -> bool:
        """Whether the layer's arrays exist (a write made them since the pool was last empty)."""
        return self._keys[layer] is not None

    def bytes_at(self, length: int, slots: int | None = None, token_bytes: int = 0) -> int:
        """What the arrays would hold with room for `length` tokens (and `slots` slots; default
        the pool's): the pool grows every slot at once, so one long session costs its length
        for all of them. token_bytes: a token's keys and values over all layers, for a pool
        whose arrays are not made yet."""
        capacity = max(self.capacity, -(-length // CAPACITY_STEP) * CAPACITY_STEP)
        slots = self.slots if slots is None else slots
        if all(keys is None for keys in self._keys):
            return token_bytes * slots * capacity
        total = 0
        for layer in range(self.layers):
            if self._keys[layer] is not None:
                made_slots, made = self._shape[layer]
                total += self.layer_bytes(layer) // (made_slots * made) * slots * capacity
        return total

    @property
    def slots_with_one_more(self) -> int:
        """The slots the pool would have once one more session is opened in it."""
        with self._slots_lock:
            return self.slots if self._free else max(4, 2 * self.slots)

    def layer_bytes(self, layer: int) -> int:
        keys, values = self._keys[layer], self._values[layer]
        return 0 if keys is None else keys.nbytes + values.nbytes

    @property
    def nbytes(self) -> int:
        return sum(self.layer_bytes(layer) for layer in range(self.layers))


class _Slot:
    """A session's slot; released when the session's caches are all gone."""

    __slots__ = ("index", "__weakref__")

    def __init__(self, index: int):
        self.index = index


class PooledCache(KVCache):
    """One session's KV for one layer, in a `KVPool` slot: what mlx-lm's KVCache gives a model,
    trimming included, and `move_rows` for a draft tree's accepted path."""

    def __init__(self, pool: KVPool, layer: int, slot: _Slot):
        super().__init__()
        self.pool, self.layer, self._slot = pool, layer, slot

    @property
    def slot(self) -> int:
        return self._slot.index

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        tokens = keys.shape[2]
        self.pool.reserve(self.offset + tokens)
        self.pool.write_slot(self.layer, self.slot, self.offset, keys[0], values[0])
        self.offset += tokens
        return self.fetch()

    def fetch(self) -> tuple[mx.array, mx.array]:
        """[1, kv_heads, offset, head_dim] keys and values."""
        flat_keys, flat_values = self.pool.arrays(self.layer)
        s = self.slot
        return (
            self.pool.grid(flat_keys)[s : s + 1, :, : self.offset],
            self.pool.grid(flat_values)[s : s + 1, :, : self.offset],
        )

    def move_rows(self, source: list[int], base: int) -> None:
        """Rows at positions `source` (ascending, each >= its destination) to base, base+1..."""
        flat_keys, flat_values = self.pool.arrays(self.layer)
        heads = self.pool.heads(self.layer)
        slot = np.array([self.slot])
        start = self.pool.rows_index(slot, np.array([0]), heads, 1)[0, :, 0]  # [H]
        taken = mx.array((start[:, None] + np.array(source)[None, :]).reshape(-1))
        moved_keys, moved_values = flat_keys[taken], flat_values[taken]
        put = (start[:, None] + base + np.arange(len(source))[None, :]).reshape(-1)
        self.pool.write(self.layer, mx.array(put.astype(np.int32)), moved_keys, moved_values)

    @property
    def keys(self):  # read-only views; writes go through update_and_fetch or move_rows
        return None if self.offset == 0 else self.fetch()[0]

    @keys.setter
    def keys(self, value) -> None:  # KVCache.__init__ sets None; the pool holds the data
        pass

    @property
    def values(self):
        return None if self.offset == 0 else self.fetch()[1]

    @values.setter
    def values(self, value) -> None:
        pass

    @property
    def state(self):
        """The pool's arrays for this layer (an evaluation of them runs every pending write)."""
        return self.pool.arrays(self.layer) if self.pool.made(self.layer) else ()

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        """This slot's share of the layer's arrays."""
        return self.pool.layer_bytes(self.layer) // max(1, self.pool.slots)


Tree = tuple[np.ndarray, np.ndarray]  # a draft tree's rows: positions [T], which each sees [T, T]


@dataclass(frozen=True)
class RaggedRows:
    """A batch whose sessions bring different numbers of new rows (a verify beside plain
    steps): its products run over the real rows alone, [1, N, hidden], and only attention
    places them in the padded [B, T] grid, so a verify of 16 beside 63 plain steps computes 79
    rows of products, not 64 x 16."""

    lengths: np.ndarray  # [B] real rows per session
    positions: mx.array  # [N + spare] int32: each row's RoPE position
    padded: mx.array | None  # [B * T] int32: the real row each grid slot reads (padding: its
    # last); None where the rows attend without the grid (pool_attention)
    real: mx.array | None  # [N + spare] int32: each row's grid slot (spare rows: the first's)
    spare: int = 0  # padding rows after the real ones (a compiled forward's traced count)

    @classmethod
    def of(
        cls,
        offsets: np.ndarray,
        lengths: np.ndarray,
        tokens: int,
        trees,
        spare: int = 0,
        grid: bool = True,
    ) -> RaggedRows:
        """grid: build the indices that place rows in the [B, T] grid and take them back (the
        mask path); the pool kernel's steps need none."""
        positions = [
            offsets[b] + np.arange(n) if tree is None else np.asarray(tree[0])
            for b, (n, tree) in enumerate(zip(lengths, trees, strict=True))
        ]
        positions.append(np.full(spare, spare_position(offsets, lengths)))
        positions = _int32(np.concatenate(positions))
        if not grid:
            return cls(lengths, positions, None, None, spare)
        starts = np.cumsum(lengths) - lengths
        t = np.arange(tokens)[None, :]
        padded = starts[:, None] + np.minimum(t, lengths[:, None] - 1)
        real = [b * tokens + np.arange(n) for b, n in enumerate(lengths)]
        real.append(np.zeros(spare, dtype=int))
        return cls(lengths, positions, _int32(padded.reshape(-1)),
                   _int32(np.concatenate(real)), spare)  # fmt: skip


def spare_position(offsets: np.ndarray, lengths: np.ndarray) -> int:
    """Where a ragged step's spare rows go: one past the first session's new rows, which
    nothing reads before that session writes it (the caller reserves room for it)."""
    return int(offsets[0] + lengths[0])


def _int32(values: np.ndarray) -> mx.array:
    return mx.array(np.asarray(values).astype(np.int32))


@dataclass(frozen=True)
class PooledStep:
    """What every layer of one batched forward shares, made once: the sessions' slots and
    cache offsets, both as device arrays too (the gather's index, RoPE's offsets), and the
    attention mask. With sessions of different lengths or a draft tree in the batch, the rows
    are ragged (`RaggedRows`: the real rows alone, each rotated at its own position)."""

    slots: np.ndarray  # [B]
    offsets: np.ndarray  # [B]
    slot_index: mx.array  # [B] int32
    positions: mx.array  # [B] int32: each session's rows at offset, offset + 1, ...
    mask: mx.array | None  # [B, 1, T, L] bool; None where `row_info` replaces it
    ragged: RaggedRows | None = None
    row_info: mx.array | None = None  # [N + spare, 4] int32: pool_attention's rows

    @classmethod
    def of(
        cls,
        caches: list[PooledCache],
        tokens: int,
        trees: list[Tree | None] | None = None,
        lengths: np.ndarray | None = None,
        spare: int | None = None,
        pool_kernel: bool = False,
    ) -> PooledStep:
        """trees: per session None (rows in a causal line) or a draft tree's (positions [T_b],
        sees [T_b, T_b]: which of its rows each one attends). lengths: each session's real
        rows; None: `tokens` each. Different lengths or a tree make the batch ragged; so does
        `spare` (padding rows after the real ones, `attend_rows`). pool_kernel: a ragged
        step's rows attend in specd.models.pool_attention's one launch where they fit it (no
        mask is made then)."""
        slots = np.array([c.slot for c in caches])
        offsets = np.array([c.offset for c in caches])
        trees = trees if trees is not None else [None] * len(caches)
        lengths = np.full(len(caches), tokens) if lengths is None else np.asarray(lengths)
        uneven = int(lengths.min()) != int(lengths.max())
        is_ragged = spare is not None or uneven or any(tree is not None for tree in trees)
        info = None
        if pool_kernel and is_ragged:
            info = pool_attention.row_info(slots, offsets, lengths, trees, spare or 0)
        ragged = None
        if is_ragged:
            ragged = RaggedRows.of(offsets, lengths, tokens, trees, spare or 0, info is None)
        mask = batch_mask(offsets, tokens, trees) if info is None else None
        info = None if info is None else mx.array(info)
        return cls(slots, offsets, _int32(slots), _int32(offsets), mask, ragged, info)


def batched_attention(attn, x: mx.array, pool: KVPool, layer: int, step: PooledStep) -> mx.array:
    """mlx-lm Llama attention for B sessions at once: x [B, T, hidden] holds each session's
    new rows at its cache offset, or for a ragged step x [1, N, hidden] the real rows alone (a
    draft tree's at their depths). Writes the rows' keys and values to the pool and attends
    each query to its own session's keys through the step's mask. The caller reserves the
    room and advances the caches' offsets, once."""
    if step.ragged is not None:
        return _ragged_attention(attn, x, pool, layer, step)
    batch, tokens, _ = x.shape
    queries = attn.q_proj(x).reshape(batch, tokens, attn.n_heads, -1).transpose(0, 2, 1, 3)
    keys = attn.k_proj(x).reshape(batch, tokens, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    values = attn.v_proj(x).reshape(batch, tokens, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    queries = attn.rope(queries, offset=step.positions)
    keys = attn.rope(keys, offset=step.positions)
    rows = pool.new_rows(step.slots, step.offsets, attn.n_kv_heads, tokens)
    pool.write(layer, rows, keys, values)
    out = _attend(attn.scale, queries, pool, layer, step)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, tokens, -1))


def _attend(scale: float, queries: mx.array, pool: KVPool, layer: int, step: PooledStep):
    """queries [B, heads, T, D] over each session's keys in the pool, through the step's mask."""
    flat_keys, flat_values = pool.arrays(layer)
    seen = step.mask.shape[-1]
    all_keys = mx.take(pool.grid(flat_keys)[:, :, :seen], step.slot_index, axis=0)
    all_values = mx.take(pool.grid(flat_values)[:, :, :seen], step.slot_index, axis=0)
    return mx.fast.scaled_dot_product_attention(
        queries, all_keys, all_values, scale=scale, mask=step.mask
    )


def _ragged_attention(attn, x: mx.array, pool: KVPool, layer: int, step: PooledStep) -> mx.array:
    """`batched_attention` of a ragged step: x [1, N, hidden], each real row rotated at its own
    position, then `attend_rows`."""
    ragged = step.ragged
    rows = x.shape[1]
    queries = attn.q_proj(x).reshape(rows, attn.n_heads, 1, -1)
    keys = attn.k_proj(x).reshape(rows, attn.n_kv_heads, 1, -1)
    values = attn.v_proj(x).reshape(rows, attn.n_kv_heads, 1, -1)
    queries = attn.rope(queries, offset=ragged.positions)
    keys = attn.rope(keys, offset=ragged.positions)
    return attn.o_proj(attend_rows(attn.scale, pool, step, layer, queries, keys, values)[None])


def attend_rows(scale: float, pool: KVPool, step: PooledStep, layer: int, queries: mx.array,
                keys: mx.array, values: mx.array) -> mx.array:  # fmt: skip
    """A ragged step's attention: rows rotated at their positions, queries [R, heads, 1, D],
    keys and values [R, kv_heads, 1, D] (the real rows, then the step's spare ones): the keys
    and values written to the pool, the queries placed in the [B, T] grid for one masked
    attention, each row's output taken back, [R, heads * D] (a spare row's is a real one's);
    with the step's `row_info`, every row in one launch of specd.models.pool_attention (a
    spare row's output is its own, over the first session's keys). No caller reads a spare
    row's output."""
    ragged = step.ragged
    rows, heads = queries.shape[0], queries.shape[1]
    index = pool.ragged_rows(step.slots, step.offsets, ragged.lengths, keys.shape[1],
                             ragged.spare)  # fmt: skip
    pool.write(layer, index, keys, values)  # rows in `index`'s order
    if step.row_info is not None:  # each row reads its own slot in place
        flat_keys, flat_values = pool.arrays(layer)
        return pool_attention.attend(queries.reshape(rows, heads, -1), pool.grid(flat_keys),
                                     pool.grid(flat_values), step.row_info, scale)  # fmt: skip
    batch, tokens = len(step.slots), step.mask.shape[-2]
    grid = mx.take(queries.reshape(rows, heads, -1), ragged.padded, axis=0)
    grid = grid.reshape(batch, tokens, heads, -1).transpose(0, 2, 1, 3)
    out = _attend(scale, grid, pool, layer, step).transpose(0, 2, 1, 3)
    return mx.take(out.reshape(batch * tokens, -1), ragged.real, axis=0)


def batch_mask(
    offsets: np.ndarray, tokens: int, trees: list[Tree | None] | None = None
) -> mx.array:
    """[B, 1, T, L] bool: query t of session b sees keys 0..offsets[b]+t (L = the furthest);
    a draft tree's rows (`PooledStep.of`) see the cache and, of the tree, what its mask says."""
    seen = int(offsets.max()) + tokens
    limit = offsets[:, None] + np.arange(tokens)[None, :]  # [B, T]
    sees = np.arange(seen)[None, None, :] <= limit[:, :, None]
    for b, tree in enumerate(trees or []):
        if tree is not None:
            n, start = len(tree[1]), int(offsets[b])
            sees[b, :n, start : start + n] = tree[1]
    return mx.array(sees[:, None])
