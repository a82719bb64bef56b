"""float32 targets whose weights float16 holds exactly, kept as float16 (specd.cpu.half)."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_load
from test_cpu_llama import decode_in_bursts
from tiny import make_tiny_model_dir

from specd.cpu.half import HalfEmbedding, HalfLinear, stored_half, stored_half_module
from specd.models.load import load_target
from verifier_svc.engine import Target, half_weights_pay, prefill

PROMPT = [3, 40, 41, 42, 43, 40, 41, 42, 50, 60, 70]


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory):
    """A 4-bit tiny target, as the embedded model is: every dequantized weight is a float16."""
    path = make_tiny_model_dir(tmp_path_factory.mktemp("q4") / "model")
    model, _ = mlx_load(str(path))
    model.set_dtype(mx.float16)  # half scales and biases, as GGUF's
    nn.quantize(model, group_size=32, bits=4)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = json.loads((path / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    return path


def _weight_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def test_a_dequantized_target_keeps_its_weights_half(quantized_dir):
    half = load_target(str(quantized_dir), "float32", half_weights=True)
    full = load_target(str(quantized_dir), "float32")
    products = [
        m for _, m in half.model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))
    ]
    assert products and all(type(m) in (HalfLinear, HalfEmbedding) for m in products)
    assert stored_half(half.model) == len(products) and stored_half(full.model) == 0
    assert all(m.weight.dtype == mx.float16 for m in products)
    norms = [v for k, v in tree_flatten(half.model.parameters()) if "norm" in k]
    assert norms and all(v.dtype == mx.float32 for v in norms)
    assert _weight_bytes(half.model) < 0.6 * _weight_bytes(full.model)
    # MLX's forward with them is the float32 one, bit for bit
    ids = mx.array([PROMPT])
    assert np.array_equal(np.array(half.model(ids)), np.array(full.model(ids)))


def test_weights_float16_cannot_hold_stay_float32(tiny_model_dir):
    loaded = load_target(str(tiny_model_dir), "float32", half_weights=True)
    assert stored_half(loaded.model) == 0
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(loaded.model.parameters()))


def test_half_weights_only_for_float32_targets(quantized_dir):
    loaded = load_target(str(quantized_dir), "float16", half_weights=True)
    assert stored_half(loaded.model) == 0  # a float16 model is not a float32 one kept half
    assert half_weights_pay("float32", None) and half_weights_pay("auto", 16)
    assert not half_weights_pay("float32", 0) and not half_weights_pay("float16", None)


def test_a_half_weight_target_decodes_as_float32_mlx_does(quantized_dir):
    half = Target(load_target(str(quantized_dir), "float32", half_weights=True))
    plain = Target(load_target(str(quantized_dir), "float32"), gemv_rows=0)
    assert half.half_weights and half.cpu_layers is not None and "stored float16" in half.numpy_part
    want = decode_in_bursts(plain, PROMPT)
    assert len(want) > 40 and decode_in_bursts(half, PROMPT) == want


def test_joined_products_hold_no_second_copy_of_the_weights(quantized_dir):
    """The CPU layers' q/k/v and gate/up products read one buffer each: every module's half
    weight is a slice of it; no float32 copies are made at load, the CPU layers taking every
    forward of up to their rows, prompts' chunks too."""
    target = Target(load_target(str(quantized_dir), "float32", half_weights=True))
    layers = target.cpu_layers.layers
    block = target.model.model.layers[0]
    block = getattr(block, "inner", block)
    attn, mlp = block.self_attn, block.mlp
    for module, joined in ((attn.q_proj, layers[0].qkv), (attn.v_proj, layers[0].qkv),
                           (mlp.up_proj, layers[0].gate_up)):  # fmt: skip
        assert module.weight.dtype == mx.float16
        assert np.shares_memory(np.asarray(module.weight), joined.weight)
        assert np.shares_memory(module._gemv.weight, joined.weight)
        assert "_float32_copy" not in module.__dict__


def test_a_moved_weight_keeps_its_float32_copy_paired():
    """A float32 copy kept beside a weight moved into another buffer stays paired with the
    weight it now has (a stale pair would hold the old buffer and be remade)."""
    from specd.cpu.half import half_copy, keep_float32_copies, move_weight

    full = nn.Linear(16, 8)
    full.weight = full.weight.astype(mx.float16).astype(mx.float32)
    half = half_copy(full)
    assert keep_float32_copies(nn.Sequential(half))
    copy = half.__dict__["_float32_copy"][1]
    moved = mx.concatenate([half.weight, half.weight])[:8]
    move_weight(half, moved)
    assert half.__dict__["_float32_copy"][0] is moved
    assert half.__dict__["_float32_copy"][1] is copy


@pytest.mark.parametrize("float32_weights", [False, True])
def test_the_verifier_service_says_what_it_holds_and_decodes_the_same(
    quantized_dir, tmp_path, float32_weights
):
    """Through real services: greedy output equals plain MLX decoding either way; the
    verifier reports the weight bytes it holds (half of them with float16 weights)."""
    import grpc

    from coordinator.bench import plain_decode
    from specd.client import CoordinatorClient, make_request
    from specd.launch import Stack
    from specd.v1 import common_pb2, verifier_pb2_grpc

    plain = load_target(str(quantized_dir), "float32")
    prompt = [5, 40, 41, 42, 43, 40, 41, 42]
    want = plain_decode(plain.model, prompt, 48, set(plain.identity.eos_token_ids)).token_ids
    with Stack(
        target=str(quantized_dir),
        drafter="ngram",
        float32_weights=float32_weights,
        startup_timeout_s=120,
        log_dir=tmp_path,
    ) as stack:
        with grpc.insecure_channel(stack.services["verifier"].address) as channel:
            info = verifier_pb2_grpc.VerifierStub(channel).GetInfo(common_pb2.InfoRequest())
        client = CoordinatorClient(stack.coordinator)
        got = client.generate(make_request(prompt_ids=prompt, max_tokens=48)).token_ids
        client.close()
    full = _weight_bytes(plain.model)
    # kept half, plus the paired copies the few-row forwards read (where the CPU runs them);
    # no float32 copies for MLX's products, prompts running on the CPU layers too
    kept = full - _half_saving(plain.model) + _paired_bytes(plain.model)
    assert info.weight_bytes == (full if float32_weights else kept)
    assert got == want
    log = (tmp_path / "verifier.log").read_text()
    assert ("stored float16" in log) != float32_weights


def _half_saving(model) -> int:
    """Bytes float16 saves on the Linear and Embedding weights of a float32 model."""
    return sum(
        m.weight.nbytes // 2
        for _, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Embedding))
    )


def _paired_bytes(model) -> int:
    """Bytes of the float16 paired copies of a float32 Llama model's products and output
    head: those of an even number of rows, each a multiple of 16 long."""
    from specd.cpu.row_products import pairs_supported

    if not pairs_supported():
        return 0
    head = "embed_tokens" if model.args.tie_word_embeddings else "lm_head"
    return sum(
        m.weight.nbytes // 2
        for name, m in model.named_modules()
        if (isinstance(m, nn.Linear) or name.endswith(head))
        and m.weight.shape[0] % 2 == 0
        and m.weight.shape[1] % 16 == 0
    )


def test_a_small_model_keeps_float32_copies_of_its_half_weights():
    """MLX's products read a float32 copy made with the model (a prefill then converts no
    weight per call), equal to the float32 Linear's bit for bit; a new weight is not answered
    from the copy of the old one; a model whose copies would pass the limit makes none."""
    from specd.cpu.half import half_copy, keep_float32_copies

    full = nn.Linear(16, 8)
    full.weight = full.weight.astype(mx.float16).astype(mx.float32)
    half = half_copy(full)
    assert isinstance(half, HalfLinear) and half.weight.dtype == mx.float16
    holder = nn.Sequential(half)
    one, many = mx.random.normal((1, 16)), mx.random.normal((1, 5, 16))
    assert not keep_float32_copies(holder, limit=500)  # 8 x 16 float32 = 512 bytes of copies
    assert mx.array_equal(half(many), full(many))
    assert "_float32_copy" not in half.__dict__  # past the limit: converted at each product
    assert keep_float32_copies(holder)
    assert half.__dict__["_float32_copy"][1].dtype == mx.float32  # made now, not on first use
    assert mx.array_equal(half(one), full(one)) and mx.array_equal(half(many), full(many))
    assert half.weight.dtype == mx.float16
    assert "_float32_copy" not in dict(tree_flatten(half.parameters()))  # not a parameter
    half.weight = (2 * full.weight).astype(mx.float16)
    assert mx.array_equal(half(many), many @ (2 * full.weight).T + full.bias)


def test_a_served_target_runs_a_long_prompt_on_its_cpu_layers(quantized_dir, monkeypatch):
    """A prompt past the CPU layers' rows runs on them in chunks and gives plain MLX's first
    token; the float32 copies MLX's products would read are not made. A target the CPU layers
    cannot run (products alone) keeps them for its prompts."""

    served = Target(load_target(str(quantized_dir), "float32", half_weights=True))
    plain = Target(load_target(str(quantized_dir), "float32"))
    prompt = PROMPT * 6  # 66 tokens: three chunks of the CPU layers' 32 rows
    assert served.cpu_layers is not None and served.prefill_chunk < len(prompt)
    assert prefill(served, prompt).first_token == prefill(plain, prompt).first_token
    modules = [m for _, m in served.model.named_modules() if stored_half_module(m)]
    assert modules and not any("_float32_copy" in m.__dict__ for m in modules)
    from specd.cpu.llama import CpuLlama

    monkeypatch.setattr(CpuLlama, "supports", staticmethod(lambda model: False))
    products_alone = Target(load_target(str(quantized_dir), "float32", half_weights=True))
    assert products_alone.cpu_layers is None and products_alone.gemv_rows > 0
    modules = [m for _, m in products_alone.model.named_modules() if stored_half_module(m)]
    assert modules and all("_float32_copy" in m.__dict__ for m in modules)


def test_a_prompts_chunks_skip_the_output_head(quantized_dir, monkeypatch):
    """The chunks before a prompt's last token compute no logits on the CPU layers (the head
    is a fifth of the embedded model's products): the head runs once, for the last token,
    and the first token, captured rows and cache are those of chunks that computed it."""
    served = Target(load_target(str(quantized_dir), "float32", half_weights=True))
    head = served.cpu_layers.head
    prompt, capture = PROMPT * 6, (0, 1)
    want = prefill(served, prompt, capture)
    head_rows = []

    class CountedHead:
        def of_rows(self, x):
            head_rows.append(len(x))
            return head.of_rows(x)

    monkeypatch.setattr(served.cpu_layers, "head", CountedHead())
    got = prefill(served, prompt, capture)
    assert head_rows == [1]
    assert got.first_token == want.first_token
    assert mx.array_equal(got.rows, want.rows) and got.rows.shape[0] == len(prompt)
    for a, b in zip(got.session.cache, want.session.cache, strict=True):
        assert a.offset == b.offset == len(prompt)
        assert mx.array_equal(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :])


@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 8, 9])
def test_paired_weights_give_the_same_logits(quantized_dir, tokens):
    """The few-row forwards read paired copies of the half weights where the CPU allows
    (specd.cpu.row_products.pair_rows): the same logits bit for bit as unpaired (past four
    rows only where the CPU pairs weights: elsewhere the portable loops sum in the order the
    compiler chose)."""
    from specd.cpu.llama import CpuLlama
    from specd.cpu.row_products import pairs_supported

    fast = Target(load_target(str(quantized_dir), "float32", half_weights=True))
    unpaired = CpuLlama.attach(fast.model, paired_bytes=0)
    assert unpaired.paired_bytes() == 0
    assert (fast.cpu_layers.paired_bytes() > 0) == pairs_supported()
    logits = []
    for layers in (fast.cpu_layers, unpaired):
        cache = prefill(fast, PROMPT).session.cache
        logits.append(layers.forward(np.arange(7, 7 + tokens), cache, frozenset())[0])
    if tokens <= 4 or pairs_supported():
        assert np.array_equal(logits[0], logits[1])
    else:
        assert np.allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def _forward_rows(target, layers, ids, positions=None, sees=None):
    cache = prefill(target, PROMPT).session.cache
    return layers.forward(np.asarray(ids), cache, frozenset(), positions, sees)[0]


@pytest.mark.parametrize("tokens", [2, 3, 5, 8, 9, 16])
def test_a_verifys_rows_are_its_decode_steps_bit_for_bit(quantized_dir, tokens):
    """The compiled kernels (paired weights where the CPU allows) give each row of a forward
    of several tokens the logits of the decode step at its place: so with drafts the greedy
    output is the verifier's own plain greedy decode, whatever the drafts."""
    from specd.cpu.llama import layer_kernels
    from specd.cpu.row_products import pairs_supported

    if layer_kernels() is None:
        pytest.fail("the compiled kernels were not built")
    if tokens > 4 and not pairs_supported():
        pytest.skip("past four rows the unpaired loop sums in another order")
    fast = Target(load_target(str(quantized_dir), "float32", half_weights=True))
    ids = np.arange(7, 7 + tokens)
    together = _forward_rows(fast, fast.cpu_layers, ids)
    cache = prefill(fast, PROMPT).session.cache
    steps = [fast.cpu_layers.forward(ids[i : i + 1], cache, frozenset())[0] for i in ids - 7]
    assert np.array_equal(together, np.concatenate(steps))


def test_a_trees_rows_are_the_decode_steps_along_their_paths(quantized_dir):
    """A draft tree's node sees its ancestors alone: its row is the decode step after the
    path to it, bit for bit, a sibling branch taking no part in any sum."""
    from specd.cpu.row_products import pairs_supported

    if not pairs_supported():
        pytest.skip("a tree of seven rows: past four the unpaired loop sums in another order")
    fast = Target(load_target(str(quantized_dir), "float32", half_weights=True))
    parents = [-1, 0, 0, 1, 2, 2, 3]
    ids = np.array([11, 12, 13, 14, 15, 16, 17])
    paths = []
    for node, parent in enumerate(parents):
        paths.append((paths[parent] if parent >= 0 else []) + [node])
    sees = np.zeros((len(ids), len(ids)), dtype=bool)
    for node, path in enumerate(paths):
        sees[node, path] = True
    offset = len(PROMPT)
    positions = np.array([offset + len(p) - 1 for p in paths])
    rows = _forward_rows(fast, fast.cpu_layers, ids, positions, sees)
    for node, path in enumerate(paths):
        cache = prefill(fast, PROMPT).session.cache
        for i in path:
            step = fast.cpu_layers.forward(ids[i : i + 1], cache, frozenset())[0]
        assert np.array_equal(rows[node], step[0]), node
