"""Compiled forwards (specd.models.compiled) on a tiny random target: the model's own logits and
captured rows, the backend the verifier picks, and rounds that commit plain greedy's tokens."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from test_engine import PROMPT
from test_half import quantized_dir  # noqa: F401  (fixture)
from test_rowwise import mixed_rounds

from specd.models import compiled, row_attention
from specd.models.load import load_target
from verifier_svc.engine import Target
from verifier_svc.forwards import CompiledMlxForward, MlxForward


@pytest.fixture(scope="module")
def targets(tiny_model_dir):
    """(the model's own forwards, compiled forwards), both in MLX."""
    own = Target(load_target(str(tiny_model_dir), dtype="float32"), gemv_rows=0)
    fast = Target(
        load_target(str(tiny_model_dir), dtype="float32"), gemv_rows=0, compiled_forwards=True
    )
    assert fast.compiled_forwards and not own.compiled_forwards
    return own, fast


def _block(n: int) -> mx.array:
    return mx.array([(7 * i + 5) % 90 + 3 for i in range(n)])


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 16])
def test_compiled_forwards_equal_the_models_own(targets, n):
    _both_alike(targets, n, lambda target, cache, layers: target.forward(_block(n), cache, layers))


def _both_alike(targets, tokens: int, step) -> None:
    """`step(target, cache, layers)` after the prompt gives both targets' logits and captured
    rows alike, and advances the cache by `tokens`."""
    layers = (0, 1)
    results = []
    for target in targets:
        cache = target.new_cache()
        target.forward(mx.array(PROMPT), cache, layers)
        results.append(step(target, cache, layers))
        assert cache[0].offset == len(PROMPT) + tokens
    (own_logits, own_rows), (got_logits, got_rows) = results
    _same(got_logits, own_logits)
    assert mx.allclose(got_rows, own_rows, rtol=1e-5, atol=1e-4).item()


# breadth-first trees of 1, 6 and 15 drafts: a chain, two branches, a bushy root
TREES = [[-1], [-1, -1, 0, 0, 1, 2], [-1, -1, -1, 0, 0, 1, 2, 3, 3, 4, 5, 6, 7, 9, 10]]


@pytest.mark.parametrize("parents", TREES, ids=["chain-of-1", "two-branches", "bushy"])
def test_compiled_tree_forwards_equal_the_models_own(targets, parents):
    nodes = len(parents) + 1
    assert isinstance(targets[1]._backend(nodes, targets[1].new_cache()), CompiledMlxForward)
    _both_alike(
        targets,
        nodes,
        lambda target, cache, layers: target.forward_tree(_block(nodes), parents, cache, layers),
    )


def test_a_tree_node_sees_its_ancestors_alone(targets):
    """A node's logits depend on its own path only: the same path under other siblings gives
    the same logits, and a node at depth 2 equals the chain of its path."""
    fast = targets[1]
    path = _block(3)  # root, a, b: b is a's child
    cache = fast.new_cache()
    fast.forward(mx.array(PROMPT), cache, ())
    chain, _ = fast.forward(path, cache, ())
    cache = fast.new_cache()
    fast.forward(mx.array(PROMPT), cache, ())
    # root; drafts: a, x (siblings at depth 1), y (x's child), b (a's child)
    tokens = mx.array([path[0].item(), path[1].item(), 77, 41, path[2].item()])
    tree, _ = fast.forward_tree(tokens, [-1, -1, 1, 0], cache, ())
    for node, row in ((0, 0), (1, 1), (4, 2)):
        _same(tree[node : node + 1], chain[row : row + 1])
    assert not mx.allclose(tree[3], chain[2], atol=1e-3).item()


def _same(got: mx.array, want: mx.array) -> None:
    """The model's own logits and choices up to float32 rounding: on a CPU, BLAS may sum a
    joined q/k/v product with another kernel than three separate ones (on a GPU MLX's
    matrix-vector kernel sums each output alike; benchmarks/gpu_forwards.py checks bit for
    bit)."""
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-4).item()
    assert mx.array_equal(mx.argmax(got, -1), mx.argmax(want, -1)).item()


def test_chunks_around_two_pass_keys_equal_the_models_own(tiny_model_dir):
    """Verifies whose rows straddle the 1,024 keys where attention changes kernels."""
    loaded = load_target(str(tiny_model_dir), dtype="float32")
    model = loaded.model
    fast = compiled.CompiledForward(model)
    cache = make_prompt_cache(model)
    model(mx.array([[(5 * i) % 90 + 3 for i in range(1020)]]), cache=cache)
    mx.eval([c.state for c in cache])
    for n in (3, 7):
        want = model(_block(n)[None], cache=cache)
        trim_prompt_cache(cache, n)
        got = fast(_block(n)[None], cache=cache)
        trim_prompt_cache(cache, n)
        _same(got, want)


def test_backends_by_size(targets):
    target = targets[1]
    cache = target.new_cache()
    assert isinstance(target._backend(1, cache), CompiledMlxForward)
    assert isinstance(target._backend(16, cache), CompiledMlxForward)
    assert isinstance(target._backend(17, cache), MlxForward)  # a prefill: the model's own
    # a prefill's short last chunk is not run a layer at a time: its kernels are the compiled
    # forward's, as an unsliced prefill's would be
    assert target.forwards_queue and not target.on_mlx(4, cache) and target.on_mlx(17, cache)


def test_rounds_with_compiled_forwards_equal_plain_greedy(targets):
    """Chains, bursts and trees through the compiled forwards."""
    out, reference, kinds = mixed_rounds(targets[1], seed=5, longest_chain=15)
    assert {"chain", "tree", "burst"} <= set(kinds)
    assert out[: len(reference)] == reference[: len(out)]


def test_quantized_targets_keep_their_own_forward(quantized_dir):  # noqa: F811
    loaded = load_target(str(quantized_dir), dtype="native")
    assert not compiled.supports(loaded.model)
    target = Target(loaded, gemv_rows=0, compiled_forwards=True)
    assert not target.compiled_forwards
    assert not any(isinstance(f, CompiledMlxForward) for f in target.forwards)


def test_the_joined_weights_hold_the_models_products_in_order(tiny_model_dir):
    """q, k, v and gate, up joined as the compiled forward reads them, row forwards on or off
    (with them on, on CUDA, the joins are the row forwards' own)."""
    for rows in (False, True):
        target = Target(
            load_target(str(tiny_model_dir), dtype="float32"),
            gemv_rows=0,
            row_forwards=rows,
            compiled_forwards=True,
        )
        backend = target.forwards[0]
        assert isinstance(backend, CompiledMlxForward)
        for index, layer in enumerate(target.model.model.layers):
            weights = backend.compiled.weights[index]
            attn, mlp = compiled._bare(layer.self_attn), compiled._bare(layer.mlp)
            qkv = [compiled._bare(getattr(attn, f"{n}_proj")).weight for n in "qkv"]
            gate_up = [compiled._bare(getattr(mlp, f"{n}_proj")).weight for n in ("gate", "up")]
            assert mx.array_equal(weights["qkv"], mx.concatenate(qkv)).item()
            assert mx.array_equal(weights["gate_up"], mx.concatenate(gate_up)).item()
            assert weights["o"] is compiled._bare(attn.o_proj).weight


def test_row_attention_takes_only_rows_its_kernel_sums_as_decode_steps():
    """One launch for 2..16 float32 rows whose decode steps all run MLX's one-pass kernel;
    anything else stays in chunks. The kernel itself is CUDA's: here it never runs."""

    def q(rows, dtype=mx.float32, head_dim=64):
        return mx.zeros((1, 9, rows, head_dim), dtype=dtype)

    keys = mx.zeros((1, 3, 8, 64))
    assert row_attention.fits(q(2), keys, base=0)
    assert row_attention.fits(q(16), keys, base=1008)  # the last row sees 1,024 keys
    assert not row_attention.fits(q(16), keys, base=1009)  # it would see 1,025: two passes
    assert not row_attention.fits(q(1), keys, base=10)  # a decode step: MLX's own
    assert not row_attention.fits(q(17), keys, base=10)
    assert not row_attention.fits(q(4, mx.float16), keys.astype(mx.float16), base=10)
    assert not row_attention.fits(q(4, head_dim=32), keys, base=10)
    cuda = getattr(mx, "cuda", None)
    if cuda is None or not cuda.is_available():
        assert not row_attention.runs_here(64)
