"""The pooled rows' one-launch attention (specd.models.pool_attention): what each row is told
(`row_info`) says what the pool's mask says, and a row's attention computed from it over the
pool's grid, as the CUDA kernel reads it, is the masked attention's. The kernel itself runs on
CUDA alone, where its first use compares it with MLX's attention before the verifier takes it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_engine import PROMPT

from specd.models import pool_attention
from specd.models.compiled import CompiledForward
from specd.models.load import load_target
from verifier_svc.engine import Target
from verifier_svc.forwards import CompiledMlxForward
from verifier_svc.kv_pool import KVPool, PooledStep, attend_rows, batch_mask
from verifier_svc.tree import ancestor_mask

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
TREE = (np.array([9, 10, 10, 11]), ancestor_mask([-1, -1, 0]))  # a root, two children, a grandchild


def _visible(info_row: np.ndarray) -> list[int]:
    """The keys a row reads, as the kernel decides them."""
    _, cached, count, sees = (int(x) for x in info_row)
    bits = sees & 0xFFFFFFFF
    return [i for i in range(count) if i < cached or (bits >> (i - cached)) & 1]


def test_each_rows_keys_are_what_the_pools_mask_lets_it_see():
    slots, offsets = np.array([2, 0, 5, 1]), np.array([3, 7, 9, 12])
    lengths, trees = np.array([1, 3, 4, 2]), [None, None, TREE, None]
    info = pool_attention.row_info(slots, offsets, lengths, trees, spare=3)
    mask = np.array(batch_mask(offsets, int(lengths.max()), trees))
    assert info.shape == (lengths.sum() + 3, 4) and info.dtype == np.int32
    row = 0
    for b, n in enumerate(lengths):
        for t in range(n):
            assert info[row, 0] == slots[b]
            assert _visible(info[row]) == np.flatnonzero(mask[b, 0, t]).tolist()
            row += 1
    assert (info[row:] == info[0]).all()  # spare rows: copies of the first, never read
    # a chain's row t sees its session's first t + 1 new rows; the grandchild its ancestors
    assert info[1:4, 3].tolist() == [1, 3, 7] and info[7, 3] == 0b1011


def test_rows_the_kernel_does_not_take_are_declined():
    one = np.array([0])
    assert pool_attention.row_info(one, np.array([10]), np.array([33])) is None
    assert pool_attention.row_info(one, np.array([1000]), np.array([25])) is None
    assert pool_attention.row_info(one, np.array([992]), np.array([32])) is not None
    full = np.tril(np.ones((32, 32), bool))
    assert pool_attention.row_info(one, np.array([0]), np.array([32]), [(None, full)])[31, 3] == -1


def _pool_with_sessions(offsets):
    pool = KVPool(1)
    caches = [pool.open()[0] for _ in offsets]
    for cache, offset in zip(caches, offsets, strict=True):
        shape = (1, KV_HEADS, offset, HEAD_DIM)
        cache.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
    return pool, caches


def test_attention_read_from_the_grid_by_row_info_is_the_masked_attention():
    """What the kernel computes, in numpy: each row over its own slot of the pool's grid, the
    keys `row_info` names, kv head = head // (heads / kv_heads); against `attend_rows` with
    the pool's gathers and mask, on a step of chains, a tree and spare rows."""
    mx.random.seed(3)
    offsets = [5, 11, 2, 8]
    pool, caches = _pool_with_sessions(offsets)
    lengths, trees = np.array([1, 3, 4, 2]), [None, None, TREE, None]
    spare, rows = 2, int(lengths.sum()) + 2
    step = PooledStep.of(caches, int(lengths.max()), trees, lengths, spare)
    assert step.row_info is None and step.mask is not None  # the masked path
    queries = mx.random.normal((rows, HEADS, 1, HEAD_DIM))
    keys = mx.random.normal((rows, KV_HEADS, 1, HEAD_DIM))
    values = mx.random.normal((rows, KV_HEADS, 1, HEAD_DIM))
    scale = HEAD_DIM**-0.5
    masked = np.array(attend_rows(scale, pool, step, 0, queries, keys, values))
    grid_k, grid_v = (np.array(pool.grid(a)) for a in pool.arrays(0))
    info = pool_attention.row_info(step.slots, step.offsets, lengths, trees, spare)
    q = np.array(queries)[:, :, 0]
    for r in range(int(lengths.sum())):
        seen = _visible(info[r])
        for head in range(HEADS):
            kv = head // (HEADS // KV_HEADS)
            k, v = grid_k[info[r, 0], kv, seen], grid_v[info[r, 0], kv, seen]
            scores = k @ q[r, head] * scale
            weights = np.exp(scores - scores.max())
            want = weights @ v / weights.sum()
            got = masked[r, head * HEAD_DIM : (head + 1) * HEAD_DIM]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_step_for_the_kernel_carries_row_info_and_no_mask():
    pool, caches = _pool_with_sessions([4, 6])
    lengths = np.array([1, 3])
    step = PooledStep.of(caches, 3, None, lengths, 1, pool_kernel=True)
    assert step.mask is None
    assert step.ragged.padded is None and step.ragged.real is None  # no grid to place rows in
    assert np.array(step.row_info).tolist() == [[0, 4, 5, 1], [1, 6, 9, 1], [1, 6, 9, 3],
                                                 [1, 6, 9, 7], [0, 4, 5, 1]]  # fmt: skip
    # rows past what the kernel takes keep the mask; so does a batch that is not ragged
    long = PooledStep.of(caches, 33, None, np.array([1, 33]), 0, pool_kernel=True)
    assert long.row_info is None and long.mask is not None and long.ragged.padded is not None
    even = PooledStep.of(caches, 1, pool_kernel=True)
    assert even.ragged is None and even.row_info is None and even.mask is not None


def test_off_cuda_the_compiled_forward_keeps_the_masked_attention_and_says_so(
    tiny_model_dir, caplog
):
    model = load_target(str(tiny_model_dir), dtype="float32").model
    assert not pool_attention.runs_here(64)
    assert CompiledForward(model).pool_kernel is False and not caplog.records
    # auto (the verifier's default) keeps the mask quietly; on says why it cannot run
    assert CompiledForward(model, pool_kernel="auto").pool_kernel is False
    assert not caplog.records
    assert CompiledForward(model, pool_kernel="on").pool_kernel is False
    assert "keeps the masked attention" in caplog.text
    with pytest.raises(ValueError, match="one of auto, on, off"):
        CompiledForward(model, pool_kernel="yes")


def _attention_by_row_info(q, keys, values, info, scale):
    """A stand-in for the kernel built from MLX's attention: each row over the keys
    `row_info` names in its slot."""
    out = []
    for r, row in enumerate(np.array(info)):
        index = mx.array(_visible(row))
        k, v = (
            keys[int(row[0]) : int(row[0]) + 1, :, index],
            values[int(row[0]) : int(row[0]) + 1, :, index],
        )
        out.append(mx.fast.scaled_dot_product_attention(q[r][None, :, None], k, v, scale=scale))
    return mx.concatenate(out).reshape(q.shape[0], -1)


def test_the_first_use_check_takes_a_right_kernel_and_refuses_a_wrong_one(monkeypatch):
    monkeypatch.setattr(pool_attention, "attend", _attention_by_row_info)
    assert pool_attention._first_use_check(64)

    def one_key_short(q, keys, values, info, scale):
        info = np.array(info)
        info[:, 2] -= 1
        return _attention_by_row_info(q, keys, values, mx.array(info), scale)

    monkeypatch.setattr(pool_attention, "attend", one_key_short)
    assert not pool_attention._first_use_check(64)


def test_row_info_that_does_not_describe_the_rows_is_refused_before_any_launch():
    q = mx.zeros((5, HEADS, HEAD_DIM))
    grid = mx.zeros((2, KV_HEADS, 16, HEAD_DIM))
    info = mx.array(pool_attention.row_info(np.array([0]), np.array([3]), np.array([4])))
    with pytest.raises(ValueError, match="does not describe 5 query rows"):
        pool_attention.attend(q, grid, grid, info, HEAD_DIM**-0.5)


@pytest.mark.parametrize("parents", [[-1], [-1, -1, 0, 0, 1, 2], [-1, -1, 0, 2, 2, 1]])
def test_a_lone_sessions_tree_through_the_kernel_is_the_masked_trees(
    tiny_model_dir, monkeypatch, parents
):
    """A compiled forward's draft tree on a session's own cache: with the pool kernel (here
    its stand-in) each node attends over the cache as a pool of one slot, and the logits and
    rows are the masked attention's up to float32 rounding (the two take their products in
    other shapes: with OpenBLAS on an AMD EPYC without AVX-512 they part by ~2e-5 at logits of
    ~14); the kernel is called once a layer and no mask is built."""
    calls = []

    def counted(q, keys, values, info, scale):
        calls.append(np.array(info))
        return _attention_by_row_info(q, keys, values, info, scale)

    tokens = mx.array([5, 17, 29, 41, 53, 65, 77][: len(parents) + 1])
    results = []
    for kernel in (False, True):
        target = Target(
            load_target(str(tiny_model_dir), dtype="float32"), gemv_rows=0, compiled_forwards=True
        )
        forward = next(f for f in target.forwards if isinstance(f, CompiledMlxForward))
        forward.compiled.pool_kernel = kernel
        monkeypatch.setattr(pool_attention, "attend", counted)
        cache = target.new_cache()
        target.forward(mx.array(PROMPT), cache, ())
        results.append(target.forward_tree(tokens, parents, cache, (0, 1)))
        assert cache[0].offset == len(PROMPT) + len(parents) + 1
    layers = len(load_target(str(tiny_model_dir), dtype="float32").model.model.layers)
    assert len(calls) == layers
    sees = ancestor_mask(parents)
    bits = (sees.astype(np.int64) << np.arange(len(sees))).sum(axis=1)
    assert calls[0][:, 1].tolist() == [len(PROMPT)] * len(sees)  # the cached keys first
    assert calls[0][:, 3].tolist() == bits.tolist()  # then the node's ancestors and itself
    (masked_logits, masked_rows), (kernel_logits, kernel_rows) = results
    assert mx.allclose(kernel_logits, masked_logits, rtol=1e-4, atol=1e-4).item()
    assert mx.allclose(kernel_rows, masked_rows, rtol=1e-4, atol=1e-4).item()
