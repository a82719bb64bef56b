"""Tree verify on a tiny random target: ancestor-only attention, KV compaction, greedy identity,
and the sampling rule over sibling candidates."""

from __future__ import annotations

import random

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from drafter_svc.proposal import line_first
from specd.models.capture import rotate_at
from specd.models.load import load_target
from verifier_svc.engine import Target, prefill, verify, verify_tree
from verifier_svc.tree import accept_tree_sampled, ancestor_mask, check_parents, depths

PROMPT = [3, 40, 41, 42, 43, 40, 41, 42, 50, 60, 70]


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return Target(load_target(str(tiny_model_dir), dtype="float32"))


def plain_greedy(target, prompt, n):
    out = []
    for token, _ in generate_step(mx.array(prompt), target.model, max_tokens=n):
        out.append(token)
        if token in target.eos_ids:
            break
    return out


def random_tree(rng: random.Random, size: int, vocab: int, max_children: int = 3):
    """Breadth-first random tree: parents first, depth non-decreasing."""
    parents, ids, frontier = [], [], [-1]
    while len(ids) < size and frontier:
        nxt = []
        for node in frontier:
            for _ in range(rng.randint(1, max_children)):
                if len(ids) >= size:
                    break
                parents.append(node)
                ids.append(rng.randrange(vocab))
                nxt.append(len(ids) - 1)
        frontier = nxt
    return ids, parents


def leaves(parents):
    has_child = {p for p in parents if p >= 0}
    return [i for i in range(len(parents)) if i not in has_child]


def path_to(parents, node):
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def test_every_path_in_one_tree_forward_equals_a_causal_forward(target):
    rng = random.Random(0)
    vocab = target.identity.vocab_size
    ids, parents = random_tree(rng, 14, vocab)
    result = prefill(target, PROMPT)
    session = result.session
    base = session.position - 1
    tokens = mx.array([session.last_token, *ids])
    tree_logits, _ = target.forward_tree(tokens, parents, session.cache, ())
    tree_logits = np.array(tree_logits)
    for leaf in leaves(parents):
        path = path_to(parents, leaf)
        fresh = prefill(target, PROMPT).session
        seq = mx.array([fresh.last_token, *(ids[i] for i in path)])
        plain, _ = target.forward(seq, fresh.cache, ())
        plain = np.array(plain)
        rows = [0, *(i + 1 for i in path)]
        assert np.allclose(tree_logits[rows], plain, atol=1e-4), leaf
    assert session.cache[0].offset == base + len(ids) + 1


def test_ancestor_mask_and_depths():
    parents = [-1, -1, 0, 0, 1, 2]
    assert depths(parents) == [1, 1, 2, 2, 2, 3]
    m = ancestor_mask(parents)
    assert m[6].nonzero()[0].tolist() == [0, 1, 3, 6]  # root, 0, 2, 5
    assert m[5].nonzero()[0].tolist() == [0, 2, 5]
    with pytest.raises(ValueError, match="earlier draft"):
        check_parents([-1, 1], 2)
    assert check_parents([-1, 0, -1], 3) == [-1, 0, -1]  # depth-first listings are taken
    with pytest.raises(ValueError, match="entries"):
        check_parents([-1], 2)


def test_compacted_cache_continues_like_plain_decoding(target):
    """A tree whose correct path is not its first branch: after the round, the cache holds the
    accepted path only, and plain decode steps from it give the reference continuation."""
    reference = plain_greedy(target, PROMPT, 24)
    result = prefill(target, PROMPT)
    session = result.session
    assert result.first_token == reference[0]
    vocab = target.identity.vocab_size
    wrong = [(t + 1) % vocab for t in reference[1:4]]
    # root children: wrong[0] (with a subtree), reference[1] -> reference[2] -> wrong
    ids = [wrong[0], reference[1], wrong[1], reference[2], wrong[2], wrong[2]]
    parents = [-1, -1, 0, 1, 2, 3]
    r = verify_tree(target, session, ids, parents)
    assert r.num_accepted == 2
    assert r.committed == reference[1:4]
    assert session.cache[0].offset == session.position - 1
    out = [reference[0], *r.committed]
    while len(out) < len(reference):
        out.extend(verify(target, session, []).committed)
    assert out == reference


@pytest.mark.parametrize("positions", [[7, 8, 8, 8, 9, 9], [7, 8, 9, 10, 9, 8], [7, 8, 9, 8, 9, 8]])
def test_a_tree_rotates_each_token_as_decoding_does_at_its_position(positions):
    """Tree positions in runs (breadth-first) or not (depth-first): each token turned at its
    position as one decode step turns it there, bit for bit."""
    rope = nn.RoPE(16, base=10000.0)
    x = mx.random.normal((1, 2, len(positions), 16), key=mx.random.key(0))
    out = np.array(rotate_at(rope, x, positions))
    for t, p in enumerate(positions):
        alone = np.array(rope(x[:, :, t : t + 1, :], offset=p))
        assert np.array_equal(out[:, :, t : t + 1], alone), (t, p)


def test_line_first_lists_a_tree_depth_first_with_each_first_child_first():
    # root children 0 (children 2, 3) and 1 (child 4); 2 has child 5
    order, parents = line_first([-1, -1, 0, 0, 1, 2])
    assert order == [0, 2, 5, 3, 1, 4]
    assert parents == [-1, 0, 1, 0, -1, 4]
    assert line_first([-1, 0, 1]) == ([0, 1, 2], [-1, 0, 1])  # a chain stays as it is


def test_a_depth_first_tree_keeping_its_first_line_moves_no_rows(target, monkeypatch):
    """The drafters list a tree's likeliest line first (`line_first`): when the target keeps
    that line its KV rows are in place, and the round commits what the breadth-first listing
    of the same tree commits, with a cache that continues as plain decoding does."""
    from verifier_svc import engine

    reference = plain_greedy(target, PROMPT, 8)
    vocab = target.identity.vocab_size
    wrong = [(t + 1) % vocab for t in reference]
    # root children: reference[1] -> (reference[2] -> reference[3], wrong), and wrong[1]
    ids = [reference[1], wrong[1], reference[2], wrong[2], reference[3]]
    parents = [-1, -1, 0, 0, 2]
    order, line_parents = line_first(parents)
    assert line_parents == [-1, 0, 1, 0, -1]
    moves, real_compact = [], engine._compact
    monkeypatch.setattr(engine, "_compact", lambda cache, base, keep: moves.append(keep)
                        or real_compact(cache, base, keep))  # fmt: skip
    wide = prefill(target, PROMPT).session
    deep = prefill(target, PROMPT).session
    by_depth = verify_tree(target, wide, ids, parents)
    by_line = verify_tree(target, deep, [ids[i] for i in order], line_parents)
    assert by_line.committed == by_depth.committed == reference[1:5]
    assert moves == [[0, 1, 3, 5], [0, 1, 2, 3]]  # the breadth-first listing moves its rows
    for _ in range(3):
        assert verify(target, deep, []).committed == verify(target, wide, []).committed


@pytest.mark.parametrize("listing", ["breadth-first", "depth-first"])
def test_tree_rounds_equal_plain_greedy(target, listing):
    n = 40
    reference = plain_greedy(target, PROMPT, n)
    rng = random.Random(1)
    vocab = target.identity.vocab_size
    result = prefill(target, PROMPT)
    session, out = result.session, [result.first_token]
    rounds = accepted = 0
    while len(out) < n and not session.finished:
        ids, parents = random_tree(rng, rng.randint(1, 12), vocab)
        done = len(out)
        # plant the right continuation along a random root-to-leaf path, sometimes cut short
        path = path_to(parents, rng.choice(leaves(parents)))
        for depth, node in enumerate(path[: rng.randint(0, len(path))]):
            if done + depth < len(reference):
                ids[node] = reference[done + depth]
        if listing == "depth-first":
            order, parents = line_first(parents)
            ids = [ids[i] for i in order]
        r = verify_tree(target, session, ids, parents)
        out.extend(r.committed)
        rounds += 1
        accepted += r.num_accepted
        assert session.cache[0].offset == session.position - 1
    assert out[: len(reference)] == reference[: len(out)]
    assert accepted > rounds // 2  # planted paths were found


def test_tree_rows_are_those_of_the_committed_positions(target):
    layers = (0, 1)
    reference = plain_greedy(target, PROMPT, 6)
    result = prefill(target, PROMPT, layers, mx.float32)
    session = result.session
    vocab = target.identity.vocab_size
    ids = [(reference[1] + 1) % vocab, reference[1], reference[2]]
    parents = [-1, -1, 1]
    r = verify_tree(target, session, ids, parents)
    assert r.committed[:2] == reference[1:3]
    # rows of [last, reference[1], reference[2]] from a plain causal forward
    full = prefill(target, PROMPT + reference[:3], layers, mx.float32)
    assert np.allclose(np.array(r.rows), np.array(full.rows[len(PROMPT) :]), atol=1e-4)


def test_sibling_sampling_rule_preserves_the_distribution():
    """Exact check over all outcomes: with two one-hot siblings the first emitted token has
    the target's distribution (computed by enumeration with a stub RNG is hard, so sample)."""
    p = np.array([0.5, 0.3, 0.15, 0.05])
    ids, parents = [1, 0, 3], [-1, -1, -1]
    rng = np.random.default_rng(0)
    counts = np.zeros(4)
    n = 40000
    for _ in range(n):
        acc, _ = accept_tree_sampled(ids, parents, lambda i: p, rng, eos_ids=())
        counts[acc.committed[0]] += 1
    expected = p * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3  # df 3, alpha 1e-3


def test_a_kept_path_moves_within_the_host_buffers_as_mlx_would_move_it(target, monkeypatch):
    """On the CPU device a tree's kept path is moved inside each layer's own KV buffers (no
    copy of the buffer), leaving the same cache as MLX's move leaves."""
    from verifier_svc import engine

    reference = plain_greedy(target, PROMPT, 4)
    vocab = target.identity.vocab_size
    # the planted path is the second root and its child: forward indices 2 and 3 move to 1, 2
    ids, parents = [(reference[1] + 1) % vocab, reference[1], reference[2]], [-1, -1, 1]
    moved = []
    real = engine._moved_on_host
    monkeypatch.setattr(engine, "_moved_on_host", lambda *a: moved.append(real(*a)) or moved[-1])
    host = prefill(target, PROMPT).session
    buffers = [id(c.keys) for c in host.cache]
    on_host = verify_tree(target, host, ids, parents)
    assert moved and all(moved)
    assert [id(c.keys) for c in host.cache] == buffers  # the same buffers, written in place
    monkeypatch.setattr(engine, "_moved_on_host", lambda *a: False)
    by_mlx = prefill(target, PROMPT).session
    assert verify_tree(target, by_mlx, ids, parents).committed == on_host.committed
    assert on_host.committed[:2] == reference[1:3]
    end = host.position - 1
    assert end == by_mlx.position - 1 == host.cache[0].offset
    for a, b in zip(host.cache, by_mlx.cache, strict=True):
        assert np.array_equal(np.array(a.keys[..., :end, :]), np.array(b.keys[..., :end, :]))
        assert np.array_equal(np.array(a.values[..., :end, :]), np.array(b.values[..., :end, :]))
    # and the next forward reads the moved rows: the same continuation either way
    assert verify(target, host, []).committed == verify(target, by_mlx, []).committed


def test_a_kept_path_moved_by_mlx_in_one_compiled_call_equals_slice_assignments():
    """Off the CPU device a kept path's rows move through one compiled call over every layer:
    the same rows as a gather and slice assignment per layer leave, for paths of several
    lengths and bases."""
    from verifier_svc import engine

    rng = np.random.default_rng(3)
    for base, keep in [(5, [0, 2, 3]), (9, [0, 1, 4]), (0, [0, 3]), (7, [0, 2, 5, 6])]:
        arrays = [mx.array(rng.standard_normal((1, 3, 24, 8)).astype(np.float32)) for _ in range(4)]
        rows = [base + i for i in keep]
        order = np.arange(24, dtype=np.int32)
        order[base : base + len(rows)] = rows
        moved = engine._moved_rows(arrays, mx.array(order))
        for a, got in zip(arrays, moved, strict=True):
            want = np.array(a)
            want[..., base : base + len(rows), :] = np.array(a)[..., rows, :]
            end = base + len(rows)
            assert got.shape == a.shape
            assert np.array_equal(np.array(got)[..., :end, :], want[..., :end, :])


def test_a_kept_path_moves_through_mlx_where_the_host_cannot_move_it(target, monkeypatch):
    """With the host's in-place move unavailable (another device), the compiled move leaves a
    cache that continues as plain decoding does."""
    from verifier_svc import engine

    reference = plain_greedy(target, PROMPT, 5)
    vocab = target.identity.vocab_size
    ids, parents = [(reference[1] + 1) % vocab, reference[1], reference[2]], [-1, -1, 1]
    calls = []
    real = engine._moved_rows
    monkeypatch.setattr(engine, "_moved_on_host", lambda *a: False)
    monkeypatch.setattr(engine, "_moved_rows", lambda *a: calls.append(1) or real(*a))
    session = prefill(target, PROMPT).session
    assert verify_tree(target, session, ids, parents).committed == reference[1:4]
    assert calls == [1]  # every layer in one call
    assert verify(target, session, []).committed == reference[4:5]
