"""Load a target for computing: resolve it, pick the dtype, describe it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from specd.models.half import HalfEmbedding, HalfLinear, store_half, stored_half_module

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


def device_kind() -> str:
    return "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"


def resolve_dtype(requested: str) -> str:
    """`auto`: float32 on CPU (quantized and half matmuls are slow there), native on GPUs."""
    if requested not in DTYPES:
        raise ValueError(f"unknown dtype {requested!r}; choose one of {', '.join(DTYPES)}")
    if requested != "auto":
        return requested
    return "float32" if device_kind() == "cpu" else "native"


def _float_module(module: nn.Module, dtype: mx.Dtype, half: bool = False) -> nn.Module:
    """The dequantized module in `dtype`; with `half` (float32 only), a weight dequantized as
    float16 (half scales) stays so: those are exactly its float32 values (specd.models.half)."""
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
    kept so (specd.models.half), each as it is made, so no full float32 copy is ever held."""
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
            if half:
                store_half(new)  # float32 scales: kept half only where that is exact
            model.update_modules(tree_unflatten([(name, new)]))
        kept = {id(m.weight) for _, m in model.named_modules() if stored_half_module(m)}

        def cast(x: mx.array) -> mx.array:
            # only what differs (astype to the same dtype would still copy), not kept halves
            floating = mx.issubdtype(x.dtype, mx.floating)
            return x.astype(target) if floating and x.dtype != target and id(x) not in kept else x

        model.apply(cast)
        if half:  # weights that were stored unquantized
            for _, module in model.named_modules():
                store_half(module)
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
    model, tokenizer = load(str(path), lazy=True)  # weights arrive as convert_dtype needs them
    dtype = resolve_dtype(dtype)
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
    return LoadedTarget(model, tokenizer, path, dtype, identity, max_context)


def describe_tokenizer(spec: str | None, cache_dir: Path | None = None) -> tuple[str, int]:
    """(fingerprint, vocab size) of a model without loading its weights."""
    from mlx_lm.utils import load_tokenizer

    from specd.models.resolve import resolve_model

    path = resolve_model(spec, cache_dir)
    full_config = json.loads((path / "config.json").read_text())
    config = _text_config(full_config)
    # the EOS ids as mlx_lm.load sees them, so the print equals the verifier's
    tokenizer = load_tokenizer(path, eos_token_ids=full_config.get("eos_token_id"))
    return tokenizer_fingerprint(tokenizer), int(config.get("vocab_size") or 0)


def tokenizer_files(path: Path) -> dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in TOKENIZER_FILES if (path / name).is_file()}
