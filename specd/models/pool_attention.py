"""Attention of a pooled batch's rows in one kernel on MLX's CUDA backend, each row reading its
own session's keys where the KV pool keeps them (verifier_svc.kv_pool).

The pool's masked attention places the rows in a [sessions, rows] grid, gathers every
session's keys and values out of the pool, attends through a mask over the longest session's
length and takes the rows back: several launches a layer and copies of every session's KV.
Here one launch a layer takes every row: a block a (head, row) reads the row's slot in the
pool in place, with the arithmetic of specd.models.row_attention (MLX's one-row vector kernel:
32 warps, warp w taking keys w, w + 32, ..., the same online softmax and merge). A row is told
by four numbers (`row_info`): its slot, the session's cached tokens before this step, the
keys to scan, and a bit mask of which of the session's new rows it sees (a chain's row t the
first t + 1, a draft tree's row its ancestors and itself). A chain's row over at most
TWO_PASS_KEYS keys therefore sums what a decode step of that session alone sums, in the same
order. At first use rows are compared with MLX's one-row attention; where they differ or the
kernel does not build, the verifier logs why and keeps the masked attention.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np

from specd.models import few_rows
from specd.models.row_attention import HEAD_DIMS, TWO_PASS_KEYS, OneRowKernel, one_row_source

log = logging.getLogger(__name__)

MAX_NEW_ROWS = 32  # a session's new rows in one step: the bits of its mask

# q [R, H, D] (any strides), keys/values the pool's grid [slots, KVH, capacity, D],
# row_info [R, 4] int32 (slot, cached, keys to scan, sees), scale [1]; out [R, H * D].
_SOURCE = one_row_source(
    setup="""\
    const int head = blockIdx.x;
    const int row = blockIdx.y;
    const int heads = q_shape[1];
    const int kv_head = head / (heads / keys_shape[1]);
    const int slot = row_info[4 * row];
    const int cached = row_info[4 * row + 1];
    const int key_count = row_info[4 * row + 2];
    const unsigned int sees = static_cast<unsigned int>(row_info[4 * row + 3]);
""",
    query="q + row * q_strides[0] + head * q_strides[1]",
    bounds="",
    keys="keys + slot * keys_strides[0] + kv_head * keys_strides[1]",
    values="values + slot * values_strides[0] + kv_head * values_strides[1]",
    # every cached key, then the session's new rows the mask lets this row see
    visible="i < cached || ((sees >> (i - cached)) & 1u)",
)

_kernel = OneRowKernel("specd_pool_attention", ["q", "keys", "values", "row_info"], _SOURCE)
_works: dict[int, bool] = {}  # head size -> the first use's check on this device


def row_info(
    slots: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    trees: list | None = None,
    spare: int = 0,
) -> np.ndarray | None:
    """[N + spare, 4] int32, a row per real row in session order, then `spare` copies of the
    first (a padding row's output is never read): slot, cached tokens, keys to scan, and the
    bits of the session's new rows it sees. trees: per session None (a chain: row t sees new
    rows 0..t) or a draft tree's (positions, sees [T, T]). None where a session brings more
    than MAX_NEW_ROWS rows or a row would scan more than TWO_PASS_KEYS keys (there a decode
    step's kernel splits its keys another way)."""
    lengths = np.asarray(lengths)
    ends = np.asarray(offsets) + lengths
    if int(lengths.max()) > MAX_NEW_ROWS or int(ends.max()) > TWO_PASS_KEYS:
        return None
    # built for all rows at once: this runs on the host every pooled step
    session = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.cumsum(lengths) - lengths
    place = np.arange(len(session)) - starts[session]
    bits = (np.uint64(2) << place.astype(np.uint64)) - np.uint64(1)  # a chain's row t: 0..t
    for b, tree in enumerate(trees or ()):
        if tree is not None:
            sees = np.asarray(tree[1], bool).astype(np.uint64)
            n = len(sees)
            bits[starts[b] : starts[b] + n] = (sees << np.arange(n, dtype=np.uint64)).sum(axis=1)
    info = np.stack([np.asarray(slots)[session], np.asarray(offsets)[session], ends[session],
                     bits.astype(np.uint32).view(np.int32)], axis=1)  # fmt: skip
    info = np.concatenate([info, np.repeat(info[:1], spare, axis=0)])
    return info.astype(np.int32)


def runs_here(head_dim: int) -> bool:
    """Whether the kernel runs here for heads of `head_dim`: the default device is a CUDA GPU
    and the kernel built and matched one-row attention bit for bit at its first use at that
    size."""
    if not few_rows.on_cuda() or head_dim not in HEAD_DIMS:
        return False
    if head_dim not in _works:
        _works[head_dim] = _first_use_check(head_dim)
    return _works[head_dim]


def attend(q: mx.array, keys: mx.array, values: mx.array, info: mx.array, scale: float) -> mx.array:
    """q [R, H, D] float32; keys/values the pool's grid [slots, KVH, capacity, D] with every
    row's keys written; info `row_info`'s [R, 4] as a device array. Returns [R, H * D]."""
    if info.shape != (q.shape[0], 4):  # the kernel would read past row_info
        raise ValueError(f"row_info {info.shape} does not describe {q.shape[0]} query rows")
    rows, heads, head_dim = q.shape
    return _kernel([q, keys, values, info], scale, rows, heads, head_dim)


def _first_use_check(head_dim: int) -> bool:
    """Chains of several sessions in a pool against one-row attention over each session's
    keys (bit for bit), and a draft tree's rows against attention over the keys each sees
    (within float32 rounding); any difference keeps the masked attention."""
    try:
        heads, kv_heads, capacity, slots = 9, 3, 1280, 6
        grid_k = mx.random.normal((slots, kv_heads, capacity, head_dim), key=mx.random.key(5))
        grid_v = mx.random.normal((slots, kv_heads, capacity, head_dim), key=mx.random.key(6))
        tree_sees = np.tril(np.ones((4, 4), bool))
        tree_sees[2, 1] = tree_sees[3, 1] = tree_sees[3, 2] = False  # rows 1 and 2 siblings
        # the widest session the kernel takes (32 rows, up to 1,024 keys) among them
        sessions = [(4, 37, 1, None), (0, 300, 7, None), (5, 0, 16, None),
                    (2, 1000, 16, None), (1, 64, 4, (None, tree_sees)),
                    (3, 992, 32, None)]  # fmt: skip
        slots_, offsets, lengths = (np.array([s[i] for s in sessions]) for i in range(3))
        trees = [s[3] for s in sessions]
        info = row_info(slots_, offsets, lengths, trees, spare=2)
        rows = int(lengths.sum()) + 2
        # queries strided as serving's are: a column slice of the joined q/k/v product
        q = mx.random.normal((rows, heads + 2 * kv_heads, head_dim), key=mx.random.key(7))
        q = q[:, :heads]
        got = attend(q, grid_k, grid_v, mx.array(info), head_dim**-0.5)
        got = got.reshape(rows, heads, 1, head_dim)
        sdpa = mx.fast.scaled_dot_product_attention
        row = 0
        for slot, cached, n, tree in sessions:
            for t in range(n):
                query = q[row][None, :, None]
                if tree is None:
                    seen = cached + t + 1
                    k, v = grid_k[slot : slot + 1, :, :seen], grid_v[slot : slot + 1, :, :seen]
                    exact = True
                else:
                    visible = [
                        *range(cached),
                        *(cached + int(j) for j in np.flatnonzero(tree[1][t])),
                    ]
                    index = mx.array(visible)
                    k, v = grid_k[slot : slot + 1, :, index], grid_v[slot : slot + 1, :, index]
                    exact = False
                want = sdpa(query, k, v, scale=head_dim**-0.5)[0]
                same = (
                    mx.array_equal(got[row], want)
                    if exact
                    else mx.allclose(got[row], want, rtol=1e-5, atol=1e-6)
                )
                if not same.item():
                    log.warning("pool attention disagrees with MLX's attention; keeping masks")
                    return False
                row += 1
        return True
    except Exception as error:  # a kernel that does not build must not stop the verifier
        log.warning("pool attention unavailable here (%s); keeping masks", error)
        return False
