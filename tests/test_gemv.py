"""Decode-sized weight products through numpy (specd.cpu.gemv) against MLX's own."""

import itertools
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from tiny import make_tiny_model_dir

from specd.cpu import gemv
from specd.cpu.gemv import GemvEmbedding, GemvLinear, check_max_rows, use_gemv
from specd.cpu.llama import DEFAULT_MAX_ROWS as CPU_MAX_ROWS
from specd.cpu.row_products import compiled, pair_rows, pairs_supported, row_products
from specd.models.load import load_target
from specd.platform import limit_numpy_blas_threads
from verifier_svc.engine import Target, prefill

PROMPT = [3, 40, 41, 42, 43, 40, 41, 42, 50, 60, 70]


@pytest.fixture(scope="module")
def products_only_dir(tmp_path_factory):
    """A target whose layers stay in MLX (sliding-window attention is not specd.cpu.llama's), so
    only its weight products go to numpy: the path of every non-Llama architecture."""
    return make_tiny_model_dir(
        tmp_path_factory.mktemp("sliding") / "model",
        config_overrides={
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 8,
        },
    )


@pytest.fixture(scope="module")
def pair(products_only_dir):
    """The same weights twice: all products in MLX, and up to 3 rows through numpy."""
    plain = Target(load_target(str(products_only_dir), dtype="float32"), gemv_rows=0)
    fast = Target(load_target(str(products_only_dir), dtype="float32"), gemv_rows=3)
    assert fast.cpu_layers is None
    return plain, fast


def _logits(target, tokens, cache=None):
    cache = prefill(target, PROMPT).session.cache if cache is None else cache
    logits, rows = target.forward(mx.array(tokens), cache, (0, 1))
    return np.array(logits), np.array(rows)


def test_every_linear_and_the_tied_head_are_switched(pair):
    plain, fast = pair
    kinds = {type(m) for _, m in fast.model.named_modules()}
    assert nn.Linear not in kinds and nn.Embedding not in kinds
    assert {GemvLinear, GemvEmbedding} <= kinds
    assert all(type(m) in (nn.Linear, nn.Embedding) for m in _products(plain.model))
    # the numpy views are neither parameters nor children: the module trees are unchanged
    names = [name for name, _ in tree_flatten(fast.model.parameters())]
    assert names == [name for name, _ in tree_flatten(plain.model.parameters())]
    assert [sorted(m) for m in _products(fast.model)] == [sorted(m) for m in _products(plain.model)]


def _products(model):
    return [m for _, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]


@pytest.mark.parametrize("tokens", [[7], [7, 8], [7, 8, 9]])
def test_few_row_forwards_match_mlx(pair, tokens):
    plain, fast = pair
    want_logits, want_rows = _logits(plain, tokens)
    got_logits, got_rows = _logits(fast, tokens)
    assert np.allclose(got_logits, want_logits, rtol=1e-5, atol=1e-4)
    assert np.allclose(got_rows, want_rows, rtol=1e-5, atol=1e-4)
    assert (got_logits.argmax(-1) == want_logits.argmax(-1)).all()


def test_larger_forwards_stay_in_mlx_bit_for_bit(pair):
    plain, fast = pair
    tokens = PROMPT[:4]  # on empty caches: prefill's last step is a one-row forward
    got = _logits(fast, tokens, fast.new_cache())[0]
    assert np.array_equal(got, _logits(plain, tokens, plain.new_cache())[0])


def test_numpy_really_does_the_few_row_products(pair, monkeypatch):
    _, fast = pair
    calls = []
    real = gemv.row_products
    monkeypatch.setattr(
        gemv, "row_products", lambda w, x, paired=None: calls.append(len(x)) or real(w, x, paired)
    )
    session = prefill(fast, PROMPT).session
    switched = len(_products(fast.model))
    for tokens in ([7], [7, 8]):
        calls.clear()
        _logits(fast, tokens, session.cache)
        assert calls == [len(tokens)] * switched  # every row of a product in one call
    calls.clear()
    _logits(fast, [7, 8, 9, 10], session.cache)
    assert calls == []


def _holding(layer: nn.Module) -> nn.Module:
    """A model whose one module is `layer` (modules are replaced in their parent)."""
    model = nn.Module()
    model.layer = layer
    return model


def test_a_bias_is_added():
    model = _holding(nn.Linear(8, 5, bias=True))
    want = model.layer(mx.ones((1, 2, 8)))
    assert use_gemv(model, 2) == 1
    assert isinstance(model.layer, GemvLinear)
    got = model.layer(mx.ones((1, 2, 8)))
    assert np.allclose(np.array(got), np.array(want), atol=1e-6)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_row_products_equal_blas(rows):
    rng = np.random.default_rng(rows)
    weight = rng.standard_normal((37, 70), dtype=np.float32)
    x = rng.standard_normal((rows, 70), dtype=np.float32)
    got = row_products(weight, x)
    assert got.shape == (rows, 37)
    assert np.allclose(got, x @ weight.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 12, 17, 20])
@pytest.mark.parametrize("width", [64, 70, 1536])
def test_half_weight_row_products_equal_blas(rows, width):
    """Half weights through every kernel: one and two rows, groups of four, groups of eight
    and a group of four after them, widths with and without a tail past the vectors."""
    rng = np.random.default_rng(rows * width)
    weight = rng.standard_normal((300, width)).astype(np.float16)
    x = rng.standard_normal((rows, width), dtype=np.float32)
    got = row_products(weight, x)
    assert got.shape == (rows, 300)
    assert np.allclose(got, x @ weight.astype(np.float32).T, rtol=1e-4, atol=1e-3)


needs_pairs = pytest.mark.skipif(
    not pairs_supported(), reason="this CPU has no AVX2 and F16C: weights stay unpaired"
)


def _paired_passes() -> list[bool]:
    """Input rows a paired pass takes, as wide: two (AVX2), and four where the CPU has
    AVX-512VL."""
    if not pairs_supported():
        return [False]
    from specd.cpu.row_products import _row_kernels as kernels

    was = kernels.paired_wide(True)
    wide = kernels.paired_wide(was)
    return [False, True] if wide else [False]


@pytest.fixture(params=_paired_passes(), ids=lambda wide: "four rows a pass" if wide else "two")
def paired_pass(request):
    from specd.cpu.row_products import _row_kernels as kernels

    was = kernels.paired_wide(request.param)
    yield request.param
    kernels.paired_wide(was)


@needs_pairs
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 12, 17])
@pytest.mark.parametrize("width", [16, 64, 1536])
def test_paired_products_sum_each_row_as_a_one_row_product(rows, width, paired_pass):
    """At every row count each row of the paired products is its one-row product's number,
    and so is each row of the unpaired ones on the same CPU (groups of four, each row summed
    as one row is)."""
    rng = np.random.default_rng(rows * width)
    weight = rng.standard_normal((300, width)).astype(np.float16)
    x = rng.standard_normal((rows, width), dtype=np.float32)
    paired = pair_rows(weight)
    assert paired is not None and paired.shape == (150, 2 * width)
    got = row_products(weight, x, paired)
    alone = np.concatenate([row_products(weight, x[i : i + 1]) for i in range(rows)])
    assert np.array_equal(got, alone)
    assert np.array_equal(got, row_products(weight, x))


@needs_pairs
def test_a_paired_pass_takes_two_input_rows_or_four_where_the_cpu_has_the_registers(paired_pass):
    from specd.cpu.row_products import _row_kernels as kernels

    assert kernels.paired_rows_a_pass() == (4 if paired_pass else 2)


def test_weights_that_cannot_be_paired_stay_unpaired():
    rng = np.random.default_rng(0)
    assert pair_rows(rng.standard_normal((301, 64)).astype(np.float16)) is None  # odd rows
    assert pair_rows(rng.standard_normal((300, 70)).astype(np.float16)) is None  # 70 % 16
    assert pair_rows(rng.standard_normal((300, 64), dtype=np.float32)) is None  # not half


@needs_pairs
def test_paired_products_refuse_what_they_cannot_multiply():
    from specd.cpu.row_products import _row_kernels as kernels

    paired = pair_rows(np.ones((4, 32), np.float16))
    out = np.empty((3, 4), np.float32)
    with pytest.raises(ValueError, match="multiple of 4"):
        kernels.paired_products(paired, np.ones((3, 32), np.float32), out)
    with pytest.raises(ValueError, match="shapes do not match"):
        kernels.paired_products(paired, np.ones((4, 16), np.float32), np.empty((4, 4), np.float32))
    with pytest.raises(ValueError, match="float16"):
        kernels.paired_products(
            np.ones((2, 64), np.float32), np.ones((1, 32), np.float32), np.empty((1, 4), np.float32)
        )


def test_the_kernels_are_built_where_a_compiler_is(monkeypatch):
    """pip builds specd/cpu/_row_kernels.c with the package; without it numpy does the products."""
    import shutil

    from specd.cpu import row_products as module

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: numpy does the products")
    assert module.compiled()
    weight = np.ones((3, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="shapes do not match"):
        module._row_kernels.products(
            weight, np.ones((4, 7), np.float32), np.ones((4, 3), np.float32)
        )
    with pytest.raises(ValueError, match="multiple of 4"):
        module._row_kernels.products(
            weight, np.ones((3, 8), np.float32), np.ones((3, 3), np.float32)
        )
    with pytest.raises(ValueError, match="float32"):
        module._row_kernels.products(weight, np.ones((4, 8)), np.ones((4, 3), np.float32))
    out = np.ones((4, 3), np.float32)
    module._row_kernels.products(np.ones((3, 0), np.float32), np.ones((4, 0), np.float32), out)
    assert (out == 0).all()  # empty sums, not a division by a zero width
    x = np.random.default_rng(0).standard_normal((3, 8), dtype=np.float32)
    monkeypatch.setattr(module, "_row_kernels", None)
    assert np.allclose(module.row_products(weight, x), x @ weight.T, atol=1e-5)


def test_row_products_keep_nan_and_inf():
    weight = np.ones((3, 8), dtype=np.float32)
    x = np.ones((2, 8), dtype=np.float32)
    x[0, 3], x[1, 5] = np.nan, np.inf
    got = row_products(weight, x)
    assert np.isnan(got[0]).all() and np.isposinf(got[1]).all()


def test_weights_numpy_would_copy_are_left_to_mlx():
    model = _holding(nn.Linear(8, 5, bias=False))
    model.layer.weight = mx.ones((8, 5)).T  # a transposed view: not row-contiguous
    assert use_gemv(model, 3) == 0
    assert type(model.layer) is nn.Linear
    half = _holding(nn.Linear(8, 5))
    half.set_dtype(mx.float16)
    assert use_gemv(half, 3) == 0


def test_settings_that_cannot_apply_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="float32 weights on the CPU"):
        check_max_rows(3, "gpu", "float32")
    with pytest.raises(ValueError, match="--gemv-rows 0"):
        Target(load_target(str(tiny_model_dir), dtype="float16"), gemv_rows=2)
    assert Target(load_target(str(tiny_model_dir), dtype="float16")).gemv_rows == 0
    # a Llama-family target runs whole forwards on numpy (specd.cpu.llama)
    assert Target(load_target(str(tiny_model_dir), dtype="float32")).gemv_rows == CPU_MAX_ROWS


def test_numpy_blas_runs_one_thread_beside_the_kernels(tiny_model_dir):
    """The kernels' threads and a spinning BLAS pool on two cores halve their speed."""
    from threadpoolctl import threadpool_info

    if limit_numpy_blas_threads(2) == 0:
        pytest.skip("numpy's BLAS has no thread pool here")
    Target(load_target(str(tiny_model_dir), dtype="float32"), gemv_rows=3)
    numpy_pools = [p for p in threadpool_info() if "numpy" in p["filepath"]]
    assert numpy_pools and all(p["num_threads"] == 1 for p in numpy_pools)


def _task_count() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not compiled(), reason="needs the compiled products")
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads in /proc")
def test_the_kernels_keep_one_pool_whichever_thread_calls():
    """OpenMP kept a pool per calling thread, and with two on two cores every forward of the
    verifier (short rounds on the event loop, the rest on its MLX thread) ran ~8 % slower."""
    import threading

    rng = np.random.default_rng(5)
    weight = rng.standard_normal((300, 96), dtype=np.float32)
    rows = rng.standard_normal((4, 96), dtype=np.float32)
    row_products(weight, rows)  # the pool starts here, if not already
    before = _task_count()
    called, done = threading.Barrier(4), threading.Event()

    def call_and_stay():  # alive while counted: a per-thread pool lives as long as its thread
        row_products(weight, rows)
        called.wait()
        done.wait(30)

    callers = [threading.Thread(target=call_and_stay) for _ in range(3)]
    for caller in callers:
        caller.start()
    called.wait(30)
    try:
        assert _task_count() == before + len(callers)
    finally:
        done.set()
        for caller in callers:
            caller.join()


@pytest.mark.skipif(not compiled(), reason="needs the compiled products")
def test_the_kernels_are_right_from_threads_calling_at_once():
    """A caller that finds the pool busy works alone; every product stays right."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(6)
    weight = rng.standard_normal((1000, 128), dtype=np.float32)
    inputs = [rng.standard_normal((n, 128), dtype=np.float32) for n in (1, 4, 8, 3) * 8]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda x: row_products(weight, x), inputs))
    for x, out in zip(inputs, got, strict=True):
        np.testing.assert_allclose(out, x @ weight.T, rtol=1e-4, atol=1e-4)


def _product_in_child(queue) -> None:
    rng = np.random.default_rng(7)
    weight = rng.standard_normal((5000, 64), dtype=np.float32)  # spans enough to share
    error = 0.0
    for n in (1, 8):
        rows = rng.standard_normal((n, 64), dtype=np.float32)
        error = max(error, float(np.abs(row_products(weight, rows) - rows @ weight.T).max()))
    queue.put(error)


@pytest.mark.skipif(not compiled(), reason="needs the compiled products")
def test_a_forked_child_starts_its_own_workers():
    """A child forked after the pool started has none of its threads; without starting its
    own it would wait for them forever."""
    import multiprocessing

    row_products(np.ones((64, 8), np.float32), np.ones((1, 8), np.float32))
    fork = multiprocessing.get_context("fork")
    queue = fork.Queue()
    child = fork.Process(target=_product_in_child, args=(queue,))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung in the products")
    assert child.exitcode == 0 and queue.get(timeout=5) < 1e-3


@pytest.fixture(scope="module")
def half_exact_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("half") / "model", half_exact=True)


@pytest.mark.parametrize("vectors", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("width", [576, 37, 16, 1])
def test_half_weight_products_sum_in_float32(rows, width, vectors):
    from specd.cpu import row_products as module

    rng = np.random.default_rng(rows * 1000 + width)
    weight = rng.standard_normal((45, width)).astype(np.float16)
    x = rng.standard_normal((rows, width), dtype=np.float32)
    was = module._row_kernels.vector_half(vectors)
    try:
        got = row_products(weight, x)
    finally:
        module._row_kernels.vector_half(was)
    want = x.astype(np.float64) @ weight.astype(np.float64).T
    assert got.dtype == np.float32 and got.shape == (rows, 45)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("vectors", [True, False])
def test_every_half_value_converts_exactly(vectors):
    """All 65536 float16 bit patterns (subnormals, infinities, NaNs) read as numpy reads them:
    one-hot rows pick each weight out of a product."""
    from specd.cpu import row_products as module

    weight = np.arange(1 << 16, dtype=np.uint16).view(np.float16).reshape(-1, 16)
    was = module._row_kernels.vector_half(vectors)
    try:
        for j in range(16):
            one_hot = np.zeros((1, 16), np.float32)
            one_hot[0, j] = 1.0
            got = row_products(weight, one_hot)[0]
            want = weight[:, j].astype(np.float32)
            finite = np.isfinite(want)
            # 0 * inf is NaN in every other column, so only the finite weights compare alone
            assert np.array_equal(got[finite], want[finite])
    finally:
        module._row_kernels.vector_half(was)
    picked = row_products(weight[:, :1].copy(), np.ones((1, 1), np.float32))[0]
    want = weight[:, 0].astype(np.float32)
    assert np.array_equal(picked, want, equal_nan=True)


def test_weights_float16_holds_exactly_are_stored_half(half_exact_dir, tiny_model_dir):
    half = Target(load_target(str(half_exact_dir), dtype="float32", half_weights=True))
    full = Target(load_target(str(half_exact_dir), dtype="float32"))
    inexact = Target(load_target(str(tiny_model_dir), dtype="float32", half_weights=True))
    products = len(_products(half.model))
    assert half.half_weights == products > 0 and "stored float16" in half.numpy_part
    assert full.half_weights == 0 and inexact.half_weights == 0
    assert all(m.weight.dtype == mx.float16 for m in _products(half.model))
    # MLX's own forwards (beyond the numpy rows, e.g. prefill) are the float32 ones, bit for bit
    tokens = list(range(3, 3 + CPU_MAX_ROWS + 4))
    got = half.forward(mx.array(tokens), half.new_cache(), (0, 1))
    want = full.forward(mx.array(tokens), full.new_cache(), (0, 1))
    assert np.array_equal(np.array(got[0]), np.array(want[0]))
    assert np.array_equal(np.array(got[1]), np.array(want[1]))
    # the numpy forwards sum in another order only
    for tokens in ([7], [7, 8], [7, 8, 9, 10, 11]):
        got_logits, got_rows = _logits(half, tokens)
        want_logits, want_rows = _logits(full, tokens)
        assert np.allclose(got_logits, want_logits, rtol=1e-5, atol=1e-4)
        assert np.allclose(got_rows, want_rows, rtol=1e-5, atol=1e-4)
        assert (got_logits.argmax(-1) == want_logits.argmax(-1)).all()


def _kernels():
    from specd.cpu.row_products import layer_kernels

    kernels = layer_kernels()
    assert kernels is not None, "the compiled kernels were not built"
    return kernels


def _attention_reference(q, nk, nv, k, v, past, sees):
    heads, tokens, dim = q.shape
    group = heads // nk.shape[0]
    out = np.empty((tokens, heads * dim))
    for h in range(heads):
        g = h // group
        for t in range(tokens):
            scores = np.concatenate([k[g, :past] @ q[h, t], nk[g] @ q[h, t]]).astype(np.float64)
            scores[past:][~sees[t]] = -np.inf
            p = np.exp(scores - scores.max())
            p /= p.sum()
            out[t, h * dim : (h + 1) * dim] = p[:past] @ v[g, :past] + p[past:] @ nv[g]
    return out


@pytest.mark.parametrize("past", [0, 1, 7, 300])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_compiled_attention_equals_softmax_attention(past, tokens):
    rng = np.random.default_rng(past * 10 + tokens)
    heads, groups, dim, capacity = 6, 2, 16, 320
    q = rng.standard_normal((heads, tokens, dim), dtype=np.float32)
    nk, nv = (rng.standard_normal((groups, tokens, dim), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal((groups, capacity, dim), dtype=np.float32) for _ in range(2))
    sees = np.tri(tokens, dtype=bool)
    sees[-1, 0] = tokens < 3  # a tree's mask: not always all earlier tokens
    out = np.empty((tokens, heads * dim), np.float32)
    _kernels().attention(q, nk, nv, k, v, past, sees, out)
    want = _attention_reference(q, nk, nv, k, v, past, sees)
    assert np.allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, groups, dim", [(6, 2, 16), (9, 3, 64), (4, 4, 8)])
def test_attention_of_several_sequences_equals_each_alone(heads, groups, dim):
    """attention_many: every sequence's rows bit for bit as `attention` gives them alone (its
    query heads of one KV head taken together, keys and values read once for them), its new
    keys and values written after its past in its own cache, nothing else touched."""
    rng = np.random.default_rng(5)
    pasts, tokens, capacities = [0, 7, 300, 40], [1, 3, 8, 1], [8, 16, 320, 256]
    bounds = np.cumsum([0, *tokens]).tolist()
    n = bounds[-1]
    q = rng.standard_normal((heads, n, dim), dtype=np.float32)
    nk, nv = (rng.standard_normal((groups, n, dim), dtype=np.float32) for _ in range(2))
    caches = [
        [rng.standard_normal((groups, c, dim), dtype=np.float32) for _ in range(2)]
        for c in capacities
    ]
    before = [[a.copy() for a in pair] for pair in caches]
    sees = [np.tri(t, dtype=bool) for t in tokens]
    sees[2][5, 1] = False  # a tree's mask
    scale = 0.25
    out = np.empty((n, heads * dim), np.float32)
    _kernels().attention_many(
        q, nk, nv, [k for k, _ in caches], [v for _, v in caches], pasts, bounds, sees, scale,
        out,
    )  # fmt: skip
    for s, (a, b) in enumerate(itertools.pairwise(bounds)):
        (k, v), (k0, v0), past = caches[s], before[s], pasts[s]
        alone = np.empty((b - a, heads * dim), np.float32)
        _kernels().attention(
            np.ascontiguousarray(q[:, a:b] * np.float32(scale)), np.ascontiguousarray(nk[:, a:b]),
            np.ascontiguousarray(nv[:, a:b]), k0, v0, past, sees[s], alone,
        )  # fmt: skip
        np.testing.assert_array_equal(out[a:b], alone)
        for cache, old, new in ((k, k0, nk), (v, v0, nv)):
            np.testing.assert_array_equal(cache[:, past : past + b - a], new[:, a:b])
            np.testing.assert_array_equal(cache[:, :past], old[:, :past])
            np.testing.assert_array_equal(cache[:, past + b - a :], old[:, past + b - a :])


def test_attention_of_several_sequences_refuses_what_does_not_fit():
    kernels = _kernels()
    f32 = np.float32
    q, kv = np.ones((4, 2, 8), f32), np.ones((2, 2, 8), f32)
    cache = np.ones((2, 5, 8), f32)
    sees = [np.ones((1, 1), bool)] * 2
    out = np.ones((2, 32), f32)
    with pytest.raises(ValueError, match="without room"):
        kernels.attention_many(q, kv, kv, [cache] * 2, [cache] * 2, [3, 5], [0, 1, 2], sees, 1.0,
                               out)  # fmt: skip
    with pytest.raises(ValueError, match="shapes do not match"):
        kernels.attention_many(q, kv, kv, [cache] * 2, [cache] * 2, [3, 3], [0, 2, 2], sees, 1.0,
                               out)  # fmt: skip
    with pytest.raises(ValueError, match="keys"):
        kernels.attention_many(q, kv, kv, [cache], [cache] * 2, [3, 3], [0, 1, 2], sees, 1.0, out)
    with pytest.raises(ValueError, match="read-only"):
        frozen = cache.copy()
        frozen.flags.writeable = False
        kernels.attention_many(q, kv, kv, [cache, frozen], [cache] * 2, [0, 0], [0, 1, 2], sees,
                               1.0, out)  # fmt: skip


def test_compiled_layer_parts_refuse_bad_shapes():
    kernels = _kernels()
    f32 = np.float32
    q, kv = np.ones((4, 1, 12), f32), np.ones((2, 1, 12), f32)
    cache = np.ones((2, 5, 12), f32)
    with pytest.raises(ValueError, match="multiple of 8"):
        kernels.attention(q, kv, kv, cache, cache, 3, np.ones((1, 1), bool), np.ones((1, 48), f32))
    q, kv, cache = np.ones((4, 1, 8), f32), np.ones((2, 1, 8), f32), np.ones((2, 5, 8), f32)
    with pytest.raises(ValueError, match="shapes do not match"):
        kernels.attention(q, kv, kv, cache, cache, 6, np.ones((1, 1), bool), np.ones((1, 32), f32))
    with pytest.raises(ValueError, match="bool"):
        kernels.attention(q, kv, kv, cache, cache, 3, np.ones((1, 1), f32), np.ones((1, 32), f32))
    with pytest.raises(ValueError, match="shapes do not match"):
        kernels.rms_norm(np.ones((2, 8), f32), np.ones(7, f32), 1e-5, np.ones((2, 8), f32))
    with pytest.raises(ValueError, match="float32"):
        kernels.rms_norm(np.ones((2, 8)), np.ones(8, f32), 1e-5, np.ones((2, 8), f32))
    with pytest.raises(ValueError, match="shapes do not match"):
        kernels.swiglu(np.ones((2, 8), f32), np.ones((2, 7), f32))
    with pytest.raises(ValueError, match="shapes do not match"):
        kernels.rope(
            np.ones((2, 16), f32),
            np.ones((2, 5), f32),
            np.ones((2, 5), f32),
            False,
            np.ones((2, 2, 8), f32),
        )


@pytest.mark.parametrize("traditional", [False, True])
def test_compiled_rope_turns_feature_pairs(traditional):
    rng = np.random.default_rng(int(traditional))
    tokens, heads, dim, dims = 3, 2, 8, 6  # the last two features are not turned
    x = rng.standard_normal((tokens, heads * dim), dtype=np.float32)
    angles = rng.uniform(0, 6, (tokens, dims // 2)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    out = np.empty((heads, tokens, dim), np.float32)
    _kernels().rope(x, cos, sin, traditional, out)
    want = x.reshape(tokens, heads, dim).transpose(1, 0, 2).copy()
    first = np.arange(0, dims, 2) if traditional else np.arange(dims // 2)
    second = first + (1 if traditional else dims // 2)
    a, b = want[..., first].copy(), want[..., second].copy()
    want[..., first], want[..., second] = a * cos - b * sin, a * sin + b * cos
    assert np.allclose(out, want, atol=1e-6)


def test_compiled_norm_and_swiglu():
    kernels = _kernels()
    rng = np.random.default_rng(5)
    h = rng.standard_normal((3, 40), dtype=np.float32)
    weight = rng.standard_normal(40, dtype=np.float32)
    out = np.empty_like(h)
    kernels.rms_norm(h, weight, 1e-5, out)
    want = h / np.sqrt(np.mean(h.astype(np.float64) ** 2, -1, keepdims=True) + 1e-5) * weight
    assert np.allclose(out, want, rtol=1e-5, atol=1e-6)
    gate = np.array([[-200.0, -90.0, -20.0, -1.0, 0.0, 0.5, 3.0, 30.0, 100.0]], np.float32)
    up = np.full_like(gate, 2.0)
    want = gate.astype(np.float64) / (1 + np.exp(-gate.astype(np.float64))) * 2.0
    kernels.swiglu(gate, up)
    assert np.isfinite(gate).all()
    assert np.allclose(gate, want, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("rows", [2, 3, 4])
@pytest.mark.parametrize("width", [64, 200, 1536])
def test_a_few_rows_on_half_weights_are_each_the_one_row_product(rows, width):
    """A verify of up to three drafts on half weights (AVX2 + F16C): each row's product bit for
    bit the one-row loop's, as a decode step computes it, tails past the vectors included."""
    from specd.cpu.row_products import layer_kernels

    rng = np.random.default_rng(rows + width)
    weight = (rng.standard_normal((300, width)) * 0.05).astype(np.float16)
    x = rng.standard_normal((rows, width), dtype=np.float32)
    kernels = layer_kernels()
    assert kernels is not None, "the compiled kernels were not built"
    kernels.vector_half(True)
    got = row_products(weight, x)
    alone = np.concatenate([row_products(weight, x[i : i + 1]) for i in range(rows)])
    if kernels.vector_half(True):  # the F16C loops; elsewhere the compiler orders the sums
        assert np.array_equal(got, alone)
    assert np.allclose(got, x @ weight.astype(np.float32).T, rtol=1e-4, atol=1e-3)
