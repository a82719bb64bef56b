"""Load a target for computing: resolve it, pick the dtype, describe it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from specd.cpu.half import (
    HalfEmbedding,
    HalfLinear,
    half_copy,
    keep_float32_copies,
    store_half,
    stored_half_module,
)
from specd.cpu.llama import CpuLlama

DTYPES = ("auto", "native", "float32", "float16", "bfloat16")
_FLOAT = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# Files a coordinator needs to tokenize and detokenize without the weights.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "tokenizer.model",
)


@dataclass(frozen=True)
class Identity:
    name: str
    fingerprint: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    eos_token_ids: tuple[int, ...]


@dataclass
class LoadedTarget:
    model: nn.Module
    tokenizer: object  # mlx_lm TokenizerWrapper
    path: Path
    dtype: str  # what the weights are computed in: "float32", ..., or "native"
    identity: Identity
    max_context: int
    # what `auto` measured on a GPU: ms of a decode step + a verify of 8 tokens per candidate
    dtype_timings: dict[str, float] = field(default_factory=dict)


def device_kind() -> str:
    return "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"


WARMUP_MODES = ("auto", "full", "minimal")


def warmup_mode(requested: str) -> str:
    """`auto`: full on a GPU, which compiles kernels per class of shapes at first use; minimal
    on a CPU, which does not."""
    if requested not in WARMUP_MODES:
        choices = ", ".join(WARMUP_MODES)
        raise ValueError(f"unknown warm-up {requested!r}; choose one of {choices}")
    if requested != "auto":
        return requested
    return "full" if device_kind() == "gpu" else "minimal"


def resolve_dtype(requested: str) -> str:
    """`auto`: float32 on CPU (quantized and half matmuls are slow there); on a GPU `auto`
    stays until `load_target` measures (`fastest_exact_dtype`)."""
    if requested not in DTYPES:
        raise ValueError(f"unknown dtype {requested!r}; choose one of {', '.join(DTYPES)}")
    if requested != "auto":
        return requested
    return "float32" if device_kind() == "cpu" else "auto"


# What `auto` may choose on a GPU: the model as stored, and float32. Half precision is left
# out: a verify of k tokens and k one-token steps round differently there, and greedy output
# then flips where the top two logits tie to within half precision's rounding. A model stored
# in half precision is therefore computed in float32 when that fits.
GPU_CANDIDATES = ("native", "float32")
# A round's two typical forwards after this context: a decode step, timed in a run of steps
# each queued before the last one's token is read (as the verifier and mlx-lm decode, so the
# graph building hides behind the device's work), and a verify of 8 tokens.
_PROBE_CONTEXT, _PROBE_STEPS, _PROBE_VERIFY, _PROBE_REPEATS = 256, 16, 8, 5


def _forward_ms(model) -> float:
    """ms of a decode step (a pipelined run's time per step) plus a verify of 8 tokens, at the
    end of a cache: the best of several timings each (a shared device only ever adds time),
    after one untimed pass that compiles their kernels."""
    import time

    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.arange(100, 100 + _PROBE_CONTEXT)[None], cache=cache)
    mx.eval([c.state for c in cache])

    def step(token: mx.array) -> mx.array:
        return mx.argmax(model(token.reshape(1, 1), cache=cache)[0, -1])

    decode, verify = [], []
    block = mx.arange(500, 500 + _PROBE_VERIFY)[None]
    for i in range(_PROBE_REPEATS + 1):
        start = time.perf_counter()
        token = step(mx.array(7))
        mx.async_eval(token)
        for _ in range(_PROBE_STEPS - 1):
            following = step(token)
            mx.async_eval(following)
            token.item()
            token = following
        token.item()
        elapsed = time.perf_counter() - start
        trim_prompt_cache(cache, _PROBE_STEPS)
        start = time.perf_counter()
        mx.eval(mx.argmax(model(block, cache=cache)[0], axis=-1))
        if i:  # the first compiles
            decode.append(elapsed / _PROBE_STEPS)
            verify.append(time.perf_counter() - start)
        trim_prompt_cache(cache, _PROBE_VERIFY)
    return 1000 * (min(decode) + min(verify))


def stored_in_half(model) -> bool:
    """Whether the model as stored computes in float16 or bfloat16: unquantized half weights.
    (A quantized model's products accumulate in float32; as stored it is a candidate.)"""
    for _, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            return False
        if isinstance(module, nn.Linear):
            return module.weight.dtype in (mx.float16, mx.bfloat16)
    return False


def _fits_float32(model) -> bool:
    """Whether a float32 copy fits in half the device's memory (when MLX says how much)."""
    params = sum(
        m.weight.size * (32 // m.bits if hasattr(m, "bits") else 1)
        for _, m in model.named_modules()
        if hasattr(m, "weight") and isinstance(m.weight, mx.array)
    )
    try:
        memory = int(mx.device_info().get("memory_size", 0))
    except (AttributeError, RuntimeError):
        memory = 0
    return not memory or 4 * params <= memory // 2


def fastest_exact_dtype(path: Path) -> tuple[str, dict[str, float]]:
    """The dtype `auto` computes in on a GPU, and every timed candidate's ms (a decode step in
    a pipelined run plus a verify of 8 tokens). Small models are launch-bound on a GPU, so
    float32 can be as fast as 4 bits there. With one candidate left nothing is timed; a
    half-stored model too large for float32 stays as stored, the one case where near-ties may
    flip (logged)."""
    dtype, timings, _ = _fastest_exact(path)
    return dtype, timings


def _fastest_exact(path: Path):
    """`fastest_exact_dtype`, and the winner's (model, tokenizer) when candidates were timed
    (None when not), so the caller need not load it again."""
    from mlx_lm import load

    model, _ = load(str(path), lazy=True)
    fits, half = _fits_float32(model), stored_in_half(model)
    candidates = [d for d in GPU_CANDIDATES if d != "float32" or fits]
    if half and fits:
        candidates.remove("native")
    del model
    if len(candidates) == 1:
        if half and not fits:
            import logging

            logging.getLogger("specd.load").warning(
                "dtype auto: %s is too large for float32 on this device; it runs as stored, "
                "where a greedy near-tie may resolve unlike plain decoding",
                path.name,
            )
        return candidates[0], {}, None
    timings: dict[str, float] = {}
    best = None
    for dtype in candidates:
        loaded = load(str(path), lazy=True)
        convert_dtype(loaded[0], dtype)
        timings[dtype] = round(_forward_ms(loaded[0]), 3)
        if best is None or timings[dtype] < timings[best[0]]:
            best = (dtype, loaded)  # the slower one is dropped here
        del loaded
        mx.clear_cache()
    return best[0], timings, best[1]


def _float_module(module: nn.Module, dtype: mx.Dtype, half: bool = False) -> nn.Module:
    """The dequantized module in `dtype`; with `half` (float32 only), a weight dequantized as
    float16 (half scales) stays so: those are exactly its float32 values (specd.cpu.half)."""
    weight = mx.dequantize(
        module.weight,
        module.scales,
        module.get("biases"),
        module.group_size,
        module.bits,
        mode=getattr(module, "mode", "affine"),
    )
    keep_half = half and dtype == mx.float32 and weight.dtype == mx.float16
    if not keep_half:
        weight = weight.astype(dtype)
    if isinstance(module, nn.QuantizedEmbedding):
        new = (HalfEmbedding if keep_half else nn.Embedding)(*weight.shape)
    else:
        kind = HalfLinear if keep_half else nn.Linear
        new = kind(weight.shape[1], weight.shape[0], bias="bias" in module)
        if "bias" in module:
            new.bias = module.bias.astype(dtype)
    new.weight = weight
    return new


def convert_dtype(model: nn.Module, dtype: str, half_weights: bool = False) -> None:
    """Dequantize and cast in place, one module at a time so that the quantized and the
    float copy of the whole model never sit in memory together; `native` keeps the weights.
    half_weights (float32 only): Linear and Embedding weights that float16 holds exactly are
    kept so (specd.cpu.half), each as it is made, so no full float32 copy is ever held."""
    if dtype != "native":
        target = _FLOAT[dtype]
        half = half_weights and target == mx.float32
        # largest first: its dequantize temporaries then meet an almost empty memory
        sizes = {
            name: m.weight.size
            for name, m in model.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        }
        quantized = sorted(sizes, key=sizes.get, reverse=True)
        modules = dict(model.named_modules())
        for name in quantized:  # by name, so no list keeps replaced modules alive
            new = _float_module(modules.pop(name), target, half)
            mx.eval(new.parameters())
            if half:  # float32 scales: kept half only where that is exact
                new = half_copy(new) or new
            model.update_modules(tree_unflatten([(name, new)]))
        kept = {id(m.weight) for _, m in model.named_modules() if stored_half_module(m)}

        def cast(x: mx.array) -> mx.array:
            # only what differs (astype to the same dtype would still copy), not kept halves
            floating = mx.issubdtype(x.dtype, mx.floating)
            return x.astype(target) if floating and x.dtype != target and id(x) not in kept else x

        model.apply(cast)
        if half:  # weights that were stored unquantized
            store_half(model)
            if not CpuLlama.supports(model):  # whose prompts go to MLX's products
                keep_float32_copies(model)
    mx.eval(model.parameters())
    mx.clear_cache()  # the conversion's temporaries, else MLX keeps them for reuse


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over the id-ordered vocabulary and the EOS ids: same tokenizer, same print."""
    vocab = tokenizer.get_vocab()
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    digest = hashlib.sha256()
    digest.update(json.dumps(by_id, ensure_ascii=False).encode())
    digest.update(json.dumps(sorted(tokenizer.eos_token_ids)).encode())
    return digest.hexdigest()[:32]


def _text_config(config: dict) -> dict:
    return config.get("text_config", config)


def load_target(
    spec: str | None,
    dtype: str = "auto",
    cache_dir: Path | None = None,
    half_weights: bool = False,
):
    """Load model + tokenizer from a model spec (see `resolve_model`); half_weights: see
    `convert_dtype`."""
    from mlx_lm import load

    from specd.models.resolve import resolve_model

    path = resolve_model(spec, cache_dir)
    dtype = resolve_dtype(dtype)
    dtype_timings: dict[str, float] = {}
    timed = None
    if dtype == "auto":
        dtype, dtype_timings, timed = _fastest_exact(path)
    if timed is not None and not half_weights:  # converted as convert_dtype would: keep it
        model, tokenizer = timed
    else:
        model, tokenizer = load(str(path), lazy=True)  # weights come as convert_dtype needs
        convert_dtype(model, dtype, half_weights)
    config = _text_config(json.loads((path / "config.json").read_text()))
    identity = Identity(
        name=spec or path.name,
        fingerprint=tokenizer_fingerprint(tokenizer),
        vocab_size=int(config.get("vocab_size") or len(tokenizer.get_vocab())),
        hidden_size=int(config["hidden_size"]),
        num_layers=len(model.layers),
        eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)),
    )
    max_context = int(config.get("max_position_embeddings") or 4096)
    return LoadedTarget(model, tokenizer, path, dtype, identity, max_context, dtype_timings)


def load_tokenizer(spec: str | None, cache_dir: Path | None = None):
    """A model's tokenizer as `load_target` gives it (EOS ids from its config), no weights."""
    from mlx_lm.utils import load_tokenizer as mlx_lm_tokenizer

    from specd.models.resolve import resolve_model

    path = resolve_model(spec, cache_dir)
    config = json.loads((path / "config.json").read_text())
    return mlx_lm_tokenizer(path, eos_token_ids=config.get("eos_token_id"))


def describe_tokenizer(spec: str | None, cache_dir: Path | None = None) -> tuple[str, int]:
    """(fingerprint, vocab size) of a model without loading its weights."""
    from specd.models.resolve import resolve_model

    config = _text_config(json.loads((resolve_model(spec, cache_dir) / "config.json").read_text()))
    tokenizer = load_tokenizer(spec, cache_dir)  # the EOS ids the verifier's print has
    return tokenizer_fingerprint(tokenizer), int(config.get("vocab_size") or 0)


def tokenizer_files(path: Path) -> dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in TOKENIZER_FILES if (path / name).is_file()}
