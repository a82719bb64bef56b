"""The packaged SmolLM2 GGUF, materialized and run through the standard mlx-lm tools."""

from __future__ import annotations

import json
import time

import pytest

from specd.models.resolve import ModelNotFoundError, find_embedded_gguf, resolve_model

pytestmark = pytest.mark.slow

PROMPT = "Write a Python function that returns the n-th Fibonacci number."
ROUND_TRIP = [
    "Hello, world!",
    "  two leading spaces, trailing space ",
    "numbers: 0 7 42 2024 3.14159 -1e10 1,000,000",
    "naïve café, Grüße, 日本語, emoji 🙂👍🏽",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "\n\nblank lines\n\n\n\tand\ttabs\r\n",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    try:
        find_embedded_gguf()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    cache = tmp_path_factory.mktemp("cache")
    start = time.perf_counter()
    out = resolve_model(None, cache)
    print(f"materialized in {time.perf_counter() - start:.2f}s")
    assert out == cache / "models" / "SmolLM2-135M-Instruct-Q4_1"
    assert resolve_model("embedded", cache) == out  # reused
    return out


@pytest.fixture(scope="module")
def loaded(model_dir):
    from mlx_lm import load

    return load(str(model_dir))


def test_config_and_size(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"]
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["model.embed_tokens"]["bits"] == 8
    # kept quantized: about the GGUF's size, not a dequantized copy
    assert (model_dir / "model.safetensors").stat().st_size < 120e6


def test_fibonacci_answer(loaded):
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = loaded
    messages = [{"role": "user", "content": PROMPT}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    text = generate(model, tokenizer, prompt, max_tokens=60, sampler=make_sampler(temp=0.0))
    print(text)
    assert "def " in text and "fib" in text.lower()


def test_tokenizer_matches_original(loaded, model_dir):
    from transformers import AutoTokenizer

    _, wrapper = loaded
    for tok in (wrapper, AutoTokenizer.from_pretrained(str(model_dir))):
        for text in ROUND_TRIP:
            assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
        # SmolLM2 splits numbers into single digits (HF Digits pre-tokenizer)
        pieces = tok.convert_ids_to_tokens(tok.encode("in 2024", add_special_tokens=False))
        assert pieces == ["in", "Ġ", "2", "0", "2", "4"]
        assert tok.encode("<|im_start|>", add_special_tokens=False) == [1]
        assert tok.encode("<|im_end|>", add_special_tokens=False) == [2]
        assert tok.encode("Hello world", add_special_tokens=False) == [19556, 905]
    assert wrapper.eos_token_ids == {2}
