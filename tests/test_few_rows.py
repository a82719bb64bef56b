"""The few-row products (specd.models.few_rows) and where rowwise forwards send them.

The kernel itself runs only on MLX's CUDA backend (benchmarks/gpu_ops.py checks its rows bit
for bit against one-row products there); here: which products reach it, its launch shape, and
the attention chunks that keep each row on the kernel its decode step uses."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from test_engine import PROMPT
from test_rowwise import targets  # noqa: F401  (fixture)

from specd.models import few_rows, rowwise
from specd.models.load import load_target


@pytest.fixture
def kernel_calls(monkeypatch) -> list[tuple[int, tuple[int, ...]]]:
    """The kernel made to run here, stood in for by the product it computes: (rows, weight
    shape) of each call."""
    calls = []

    def standing_in(x, weight):
        calls.append((x.size // x.shape[-1], tuple(weight.shape)))
        return x @ weight.T

    monkeypatch.setattr(few_rows, "runs_here", lambda: True)
    monkeypatch.setattr(few_rows, "product", standing_in)
    return calls


def _verify_logits(pair, block: mx.array, calls: list) -> list[mx.array]:
    """Each target's logits for `block` after the prompt; `calls` holds the last one's."""
    results = []
    for target in pair:
        cache = target.new_cache()
        target.forward(mx.array(PROMPT), cache)
        calls.clear()
        results.append(target.forward(block, cache)[0])
        mx.eval(results[-1])
    return results


@pytest.mark.parametrize("base", [0, 5, 1000, 1013, 1020, 1021, 1022, 1023, 1024, 1025, 3000])
@pytest.mark.parametrize("rows", range(2, rowwise.DEFAULT_MAX_ROWS + 1))
def test_attention_chunks_never_mix_the_one_and_two_pass_kernels(base, rows):
    bounds = rowwise.chunk_bounds(base, rows)
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    for (_, stop), (start, _) in zip(bounds, bounds[1:], strict=False):
        assert stop == start
    for start, stop in bounds:
        assert 0 < stop - start <= rowwise.FUSED_QUERY_ROWS
        # query r sees base + r + 1 keys; the chunk's call sees base + stop
        first_side = base + start + 1 <= rowwise.TWO_PASS_KEYS
        assert first_side == (base + stop <= rowwise.TWO_PASS_KEYS), (start, stop)


def test_lanes_read_columns_as_mlx_matrix_vector_kernel_does():
    assert [few_rows.per_lane(c) for c in (576, 1536, 192, 100, 64, 128)] == [2, 4, 2, 1, 2, 4]


def test_fits_only_a_few_rows_of_float_weights():
    w = mx.zeros((8, 64))
    assert few_rows.fits(2, mx.zeros((2, 64)), w)
    assert few_rows.fits(few_rows.MAX_ROWS, mx.zeros((few_rows.MAX_ROWS, 64)), w)
    assert not few_rows.fits(1, mx.zeros((1, 64)), w)
    assert not few_rows.fits(few_rows.MAX_ROWS + 1, mx.zeros((few_rows.MAX_ROWS + 1, 64)), w)
    assert not few_rows.fits(2, mx.zeros((2, 64), dtype=mx.float16), w)
    assert not few_rows.fits(2, mx.zeros((2, 64), dtype=mx.int32), mx.zeros((8, 64), mx.int32))


def test_not_on_a_cpu():
    assert not few_rows.runs_here()


def test_a_verify_sends_every_product_and_its_logits_to_the_kernel_where_it_runs(
    targets,  # noqa: F811
    kernel_calls,
):
    """With the kernel there (stood in for by the product it computes), a forward of n tokens
    sends each layer's seven products and the logits projection through it, one call each,
    and a decode step none."""
    own, served = targets
    calls = kernel_calls
    layers = len(served.model.layers)
    vocab = served.model.model.embed_tokens.weight.shape[0]
    block = mx.array([(7 * i + 5) % 90 + 3 for i in range(5)])
    results = _verify_logits((own, served), block, calls)
    assert len(calls) == 7 * layers + 1
    assert all(rows == 5 for rows, _ in calls)
    assert calls[-1][1][0] == vocab  # the tied embedding's logits
    assert mx.allclose(results[0], results[1], rtol=1e-5, atol=1e-4).item()
    calls.clear()
    cache = served.new_cache()
    served.forward(mx.array(PROMPT), cache)
    calls.clear()
    served.forward(mx.array([17]), cache)
    assert calls == []


def test_install_wraps_a_tied_embeddings_logits_or_a_plain_head(tiny_model_dir):
    model = load_target(str(tiny_model_dir), dtype="float32").model
    embedding = model.model.embed_tokens
    assert rowwise.install(model)
    if model.args.tie_word_embeddings:
        wrapped = model.model.embed_tokens
        assert isinstance(wrapped, rowwise.RowEmbedding) and wrapped.weight is embedding.weight
        x = mx.random.normal((1, 4, embedding.weight.shape[1]))
        # no CUDA here: the model's own projection
        assert mx.array_equal(wrapped.as_linear(x), embedding.as_linear(x)).item()
        ids = mx.array([[1, 2, 3]])
        assert mx.array_equal(wrapped(ids), embedding(ids)).item()
    else:
        assert isinstance(model.lm_head, rowwise.RowLinear)
    head = nn.Linear(8, 16, bias=False)
    wrapped_head = rowwise.RowLinear(head, 16, cuda_only=True)
    x = mx.random.normal((3, 8))
    assert mx.array_equal(wrapped_head(x), head(x)).item()


def test_where_the_kernel_runs_q_k_v_and_gate_up_are_one_product_each(
    tiny_model_dir,
    targets,  # noqa: F811
    kernel_calls,
):
    """Installed where the kernel runs, each layer's q, k and v weights (and gate and up) are
    views of one joined weight: the same numbers, no memory added, and a verify makes four
    kernel calls a layer (q/k/v, o, gate/up, down) where it made seven."""
    from mlx.utils import tree_flatten

    from verifier_svc.engine import Target

    own = targets[0]
    calls = kernel_calls
    loaded = load_target(str(tiny_model_dir), dtype="float32")
    before = {k: mx.array(v) for k, v in tree_flatten(loaded.model.parameters())}
    joined = Target(loaded, gemv_rows=0, row_forwards=True)
    after = dict(tree_flatten(joined.model.parameters()))
    assert sum(v.nbytes for v in after.values()) == sum(v.nbytes for v in before.values())
    renamed = {k.replace(".inner", ""): v for k, v in after.items()}
    assert set(renamed) == set(before)
    assert all(mx.array_equal(renamed[k], before[k]).item() for k in before)

    layers = len(joined.model.layers)
    block = mx.array([(7 * i + 5) % 90 + 3 for i in range(6)])
    results = _verify_logits((own, joined), block, calls)
    assert len(calls) == 4 * layers + 1
    attn = joined.model.layers[0].inner.self_attn.inner
    mlp = joined.model.layers[0].inner.mlp.inner
    qkv = sum(_weight(m).shape[0] for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    gate_up = _weight(mlp.gate_proj).shape[0] + _weight(mlp.up_proj).shape[0]
    assert calls[0][1][0] == qkv and calls[2][1][0] == gate_up
    assert mx.allclose(results[0], results[1], rtol=1e-5, atol=1e-4).item()


def _weight(module: nn.Module) -> mx.array:
    return getattr(module, "inner", module).weight


def test_joined_products_fall_back_where_the_kernel_does_not_fit(tiny_model_dir, kernel_calls):
    """Rows of another dtype than the joined weight (or one row) take the separate products."""
    calls = kernel_calls
    model = load_target(str(tiny_model_dir), dtype="float32").model
    assert rowwise.install(model)
    mlp = model.layers[0].mlp
    gate, up = mlp.inner.gate_proj.inner.weight, mlp.inner.up_proj.inner.weight
    joined = gate.shape[0] + up.shape[0]
    x = mx.random.normal((1, 3, gate.shape[1]))
    mx.eval(mlp(x))
    assert calls[0][1][0] == joined  # gate and up as one product
    calls.clear()
    mx.eval(mlp(x.astype(mx.float16)))
    assert joined not in [shape[0] for _, shape in calls]  # float16 rows: the model's own
    calls.clear()
    mx.eval(mlp(x[:, :1]))
    assert calls == []  # one row: a decode step's own products


@pytest.mark.parametrize(
    ("layout", "rows", "outputs", "grid", "tile_args"),
    [
        ("whole", 5, 100, (32, 104, 1), []),
        ("t4", 5, 100, (32, 104, 2), [("ROW_TILE", 4), ("COLUMNS", 1)]),
        ("t4", 16, 960, (32, 960, 4), [("ROW_TILE", 4), ("COLUMNS", 1)]),
        ("t4c2", 3, 100, (32, 56, 1), [("ROW_TILE", 4), ("COLUMNS", 2)]),
        ("t2c2", 7, 49152, (32, 24576, 4), [("ROW_TILE", 2), ("COLUMNS", 2)]),
    ],
)
def test_a_layout_launches_a_warp_per_tile_of_rows_and_columns(
    monkeypatch, layout, rows, outputs, grid, tile_args
):
    """The launch each layout asks of MLX (the kernel stood in for by the product it
    computes): a warp for each tile of rows (grid z) and each `columns` outputs (grid y, whole
    blocks of 8 warps)."""
    launches = []

    def kernel_maker(**made):
        def kernel(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            launches.append((made["name"], template, grid, threadgroup))
            x, w = inputs
            return [x @ w.T]

        return kernel

    monkeypatch.setattr(mx.fast, "cuda_kernel", kernel_maker, raising=False)
    monkeypatch.setattr(few_rows, "_kernels", {})
    x, w = mx.random.normal((rows, 64)), mx.random.normal((outputs, 64))
    out = few_rows.product(x, w, few_rows.LAYOUTS[layout])
    assert mx.allclose(out, x @ w.T).item()
    name, template, launched, threadgroup = launches[0]
    assert template == [("T", mx.float32), ("PER_LANE", 2), *tile_args]
    assert launched == grid and threadgroup == (32, 8, 1)
    assert name == ("specd_few_rows" if layout == "whole" else "specd_few_row_tiles")


def test_a_layout_is_chosen_by_name():
    shipped = few_rows.layout_name()
    try:
        few_rows.use("whole")
        assert few_rows.layout_name() == "whole"
        with pytest.raises(ValueError, match="few-row layout is auto or one of"):
            few_rows.use("t3")
        few_rows.use("auto")
        assert few_rows.layout_name() == "auto"
    finally:
        few_rows.use(shipped)


def test_auto_tiles_a_weight_that_stays_in_l2_and_reads_a_larger_one_whole():
    assert few_rows.layout_name() == "auto"
    small = mx.zeros((3072, 576))  # gate/up joined, 7 MB in float32
    logits = mx.zeros((few_rows.TILED_WEIGHT_BYTES // (4 * 576) + 1, 576))
    assert few_rows.layout_for(small) == few_rows.LAYOUTS["t2"]
    assert few_rows.layout_for(logits) == few_rows.LAYOUTS["whole"]
