"""Row-by-row forwards (specd.models.rowwise) on a tiny random target: the same logits and rows
as the model's own forward, the same greedy output through rounds and trees."""

from __future__ import annotations

import random

import mlx.core as mx
import mlx.nn as nn
import pytest
from test_engine import PROMPT, plain_greedy
from test_half import quantized_dir  # noqa: F401  (fixture)
from test_tree_verify import leaves, path_to, random_tree

from specd.models import rowwise
from specd.models.load import load_target
from verifier_svc.engine import Target, decode, prefill, verify, verify_tree


@pytest.fixture(scope="module")
def targets(tiny_model_dir):
    """(the model's own forwards, row-by-row forwards), both in MLX."""
    own = Target(load_target(str(tiny_model_dir), dtype="float32"), gemv_rows=0)
    rows = Target(load_target(str(tiny_model_dir), dtype="float32"), gemv_rows=0, row_forwards=True)
    assert rows.row_forwards and not own.row_forwards
    return own, rows


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7, 16, 17])
def test_row_forwards_equal_the_models_own(targets, n):
    layers = (0, 1)
    block = mx.array([(7 * i + 5) % 90 + 3 for i in range(n)])
    results = []
    for target in targets:
        cache = target.new_cache()
        target.forward(mx.array(PROMPT), cache, layers)
        logits, rows = target.forward(block, cache, layers)
        assert cache[0].offset == len(PROMPT) + n
        results.append((logits, rows))
    (own_logits, own_rows), (got_logits, got_rows) = results
    # float32 rounding only (sums in another order, with another BLAS): the same choices
    assert mx.allclose(got_logits, own_logits, rtol=1e-5, atol=1e-4).item()
    assert mx.allclose(got_rows, own_rows, rtol=1e-5, atol=1e-4).item()
    assert mx.array_equal(mx.argmax(got_logits, -1), mx.argmax(own_logits, -1)).item()


def test_rounds_with_row_forwards_equal_plain_greedy(targets):
    out, reference, _ = mixed_rounds(targets[1], seed=3, longest_chain=12)
    assert out[: len(reference)] == reference[: len(out)]


def mixed_rounds(target, seed: int, longest_chain: int, n: int = 60):
    """Rounds of random kinds on `target` after PROMPT: chains of the target's own greedy
    tokens (half of them with one token changed), trees holding its path, decode bursts.
    Returns (committed tokens, plain greedy's, the kinds run)."""
    reference = plain_greedy(target, PROMPT, n)
    rng = random.Random(seed)
    vocab = target.identity.vocab_size
    session = prefill(target, PROMPT).session
    out = [session.last_token]
    kinds = []
    while len(out) < n and not session.finished:
        done = len(out)
        kind = rng.choice(["chain", "tree", "burst"])
        kinds.append(kind)
        if kind == "chain":
            drafts = reference[done : done + rng.randint(1, longest_chain)]
            if drafts and rng.random() < 0.5:
                drafts[rng.randrange(len(drafts))] = rng.randrange(vocab)
            r = verify(target, session, drafts)
        elif kind == "tree":
            ids, parents = random_tree(rng, rng.randint(4, 12), vocab)
            for depth, node in enumerate(path_to(parents, rng.choice(leaves(parents)))):
                if done + depth < len(reference):
                    ids[node] = reference[done + depth]
            r = verify_tree(target, session, ids, parents)
        else:
            r = decode(target, session, rng.randint(2, 6), look_ahead=True)
        out.extend(r.committed)
    return out, reference, kinds


def test_quantized_targets_keep_their_own_forward(quantized_dir):  # noqa: F811
    target = Target(load_target(str(quantized_dir), dtype="native"), gemv_rows=0, row_forwards=True)
    assert not target.row_forwards
    assert not any(isinstance(m, rowwise.RowLinear) for _, m in target.model.named_modules())


def test_install_is_idempotent(tiny_model_dir):
    model = load_target(str(tiny_model_dir), dtype="float32").model
    assert rowwise.install(model) and rowwise.install(model)
    linears = [m for _, m in model.named_modules() if isinstance(m, rowwise.RowLinear)]
    assert len(linears) == 7 * len(model.layers)
    assert all(type(m.inner) is nn.Linear for m in linears)


def test_a_prefill_longer_than_max_rows_takes_the_models_own_attention(targets, monkeypatch):
    """Row by row is for verifies of a few tokens; a prompt of hundreds split into chunks of
    three query rows cost 3-9x mlx-lm's prefill on the H200. Past max_rows each layer makes
    one attention call, as the model's own forward does."""
    target = targets[1]
    calls = []
    fused = mx.fast.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape[2])  # query rows
        return fused(*args, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", counting)
    layers = len(target.model.layers)
    for n, per_layer in ((rowwise.DEFAULT_MAX_ROWS, -(-rowwise.DEFAULT_MAX_ROWS // 3)),
                         (rowwise.DEFAULT_MAX_ROWS + 1, 1), (120, 1)):  # fmt: skip
        calls.clear()
        cache = target.new_cache()
        target.forward(mx.array([(5 * i + 3) % 90 + 3 for i in range(n)]), cache)
        assert len(calls) == per_layer * layers, n
    assert calls == [120] * layers


def test_decode_steps_run_the_models_own_modules_and_wrappers_come_back(targets):
    """A one-token forward runs unwrapped (no wrapper's Python call on a launch-bound GPU) but
    for the capture of the layers it keeps; the next forward of several tokens has every
    wrapper back."""
    from specd.models.capture import Bypass

    own, served = targets
    served.supports_trees(served.new_cache())  # tree RoPE wrappers installed too

    def wrappers() -> int:
        return sum(isinstance(m, Bypass.WRAPPERS) for _, m in served.model.named_modules())

    installed = wrappers()
    layers = len(served.model.layers)
    assert installed >= 10 * layers  # capture, attention, 7 products, RoPE per layer
    caches = [t.new_cache() for t in (own, served)]
    for t, cache in zip((own, served), caches, strict=True):
        t.forward(mx.array(PROMPT), cache)
    step = mx.array([17])
    want, _ = own.forward(step, caches[0])
    got, rows = served.forward(step, caches[1])
    assert wrappers() == 0 and rows is None
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-4).item()
    want, want_rows = own.forward(step, caches[0], (0, 1))
    got, rows = served.forward(step, caches[1], (0, 1))  # the two layers' capture only
    assert wrappers() == 2
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-4).item()
    assert mx.allclose(rows, want_rows, rtol=1e-5, atol=1e-4).item()
    want, want_rows = own.forward(mx.array([17, 23]), caches[0], (0, 1))
    got, rows = served.forward(mx.array([17, 23]), caches[1], (0, 1))
    assert wrappers() == installed
    assert mx.allclose(rows, want_rows, rtol=1e-5, atol=1e-4).item()
