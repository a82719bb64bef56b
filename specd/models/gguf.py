"""Turn a Llama GGUF file into a standard mlx-lm model directory.

The quantized tensors are kept as `mx.load` returns them (affine, group 32), so the
directory is about the size of the GGUF and `mlx_lm.load` builds the same kernels.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
import warnings
from collections import Counter
from pathlib import Path

import mlx.core as mx

# Bump when the output layout changes, so older caches are rebuilt.
CONVERTER_VERSION = 1
GROUP_SIZE = 32  # every GGUF block type mx.load keeps quantized uses 32-wide blocks
STAMP_FILE = "specd.json"

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# HF tokenizers equivalents of llama.cpp's BPE pre-tokenizer types.
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell")
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def file_signature(path: Path, with_hash: bool = True) -> dict:
    st = path.stat()
    sig = {"source": path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if with_hash:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        sig["sha256"] = digest.hexdigest()
    return sig


def is_materialized(out_dir: Path, gguf_path: Path) -> bool:
    """True if out_dir holds a complete conversion of this exact GGUF file."""
    try:
        stamp = json.loads((Path(out_dir) / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    if stamp.get("converter_version") != CONVERTER_VERSION:
        return False
    cheap = file_signature(Path(gguf_path), with_hash=False)
    if (stamp.get("source"), stamp.get("size")) != (cheap["source"], cheap["size"]):
        return False
    if stamp.get("mtime_ns") == cheap["mtime_ns"]:
        return True  # same name, size and mtime: skip re-hashing a large file
    return stamp.get("sha256") == file_signature(Path(gguf_path))["sha256"]


def _scalar(meta: dict, key: str, default=None):
    value = meta.get(key, default)
    return value.item() if isinstance(value, mx.array) else value


def _f32(x) -> float:
    # GGUF floats are float32; print 1e-05 rather than 9.999999747378752e-06.
    return float(f"{float(x):.7g}")


def _unpermute(x: mx.array, n_heads: int) -> mx.array:
    # llama.cpp stores each head's rows as (half, 2) interleaved pairs for GPT-J style
    # RoPE; HF keeps them as (2, half). Rows of weight/scales/biases move together.
    rows = x.shape[0]
    y = x.reshape(n_heads, rows // n_heads // 2, 2, *x.shape[1:]).swapaxes(1, 2)
    return y.reshape(x.shape)


def _rename(name: str) -> str:
    base, _, suffix = name.rpartition(".")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    # e.g. rope_freqs (Llama 3.1 rope scaling), which mlx-lm cannot take as a tensor
    raise ValueError(f"unsupported GGUF tensor {name!r}")


def _convert_weights(tensors: dict, n_heads: int, n_kv_heads: int) -> dict:
    out = {}
    for name, value in tensors.items():
        if ".attn_q." in name:
            value = _unpermute(value, n_heads)
        elif ".attn_k." in name:
            value = _unpermute(value, n_kv_heads)
        out[_rename(name)] = value
    return out


def _quantization(weights: dict) -> dict | None:
    """mlx-lm quantization entry: the common bit width plus per-module overrides."""
    bits = {}
    for name, scales in weights.items():
        if name.endswith(".scales"):
            module = name[: -len(".scales")]
            bits[module] = weights[f"{module}.weight"].shape[-1] // scales.shape[-1]
    if not bits:
        return None
    default = Counter(bits.values()).most_common(1)[0][0]
    quant = {"group_size": GROUP_SIZE, "bits": default, "mode": "affine"}
    for module, b in sorted(bits.items()):
        if b != default:
            quant[module] = {"group_size": GROUP_SIZE, "bits": b, "mode": "affine"}
    return quant


def _model_config(meta: dict, weights: dict, vocab_size: int) -> dict:
    def key(name, default=None):
        return _scalar(meta, f"llama.{name}", default)

    hidden, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    n_kv_heads = int(key("attention.head_count_kv", n_heads))
    head_dim = int(key("attention.key_length", hidden // n_heads))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(key("block_count")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "rope_traditional": False,
        "vocab_size": vocab_size,
        "max_position_embeddings": int(key("context_length", 2048)),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in weights,
        "mlp_bias": "model.layers.0.mlp.up_proj.bias" in weights,
    }
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ValueError("partial rotary embeddings are not supported")
    scaling = key("rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": _f32(key("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ValueError(f"unsupported rope scaling {scaling!r}")
    return config


def _pre_tokenizer(pre: str | None):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        # Same split as llama.cpp's ["\p{N}", gpt-2 regex] and SmolLM2's own tokenizer.json.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated")
        no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, no_regex])
    if pre not in (None, "default", "gpt2", "gpt-2"):
        warnings.warn(f"GGUF pre-tokenizer {pre!r} unknown; using the GPT-2 split", stacklevel=3)
    return byte_level


def _build_tokenizer(meta: dict):
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    if _scalar(meta, "tokenizer.ggml.model") != "gpt2":
        raise ValueError("only byte-level BPE (tokenizer.ggml.model = gpt2) GGUFs are supported")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = meta.get("tokenizer.ggml.token_type")
    types = types.tolist() if types is not None else [1] * len(tokens)
    vocab = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(_scalar(meta, "tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    post = [processors.ByteLevel(trim_offsets=False)]
    bos_id = _scalar(meta, "tokenizer.ggml.bos_token_id")
    if _scalar(meta, "tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        post.append(
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0",
                pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, bos_id)],
            )
        )
    tok.post_processor = processors.Sequence(post)
    added = [
        AddedToken(tokens[i], special=t == _CONTROL, normalized=False)
        for i, t in enumerate(types)
        if t in (_CONTROL, _USER_DEFINED)
    ]
    tok.add_tokens(added)
    return tok, tokens


def _special_ids(meta: dict) -> dict:
    names = ("bos", "eos", "unknown", "padding", "eot")
    ids = {n: _scalar(meta, f"tokenizer.ggml.{n}_token_id") for n in names}
    return {n: int(v) for n, v in ids.items() if v is not None}


def _read_gguf(path: Path) -> tuple[dict, dict]:
    # Q4_0/Q4_1/Q8_0 come back as affine (weight, scales, biases); other types as floats.
    return mx.load(str(path), return_metadata=True)


def _write_dir(gguf_path: Path, dest: Path) -> None:
    tensors, meta = _read_gguf(gguf_path)
    if (arch := _scalar(meta, "general.architecture")) != "llama":
        raise ValueError(f"only llama GGUF files are supported, got {arch!r}")
    tokenizer, tokens = _build_tokenizer(meta)
    n_heads = int(_scalar(meta, "llama.attention.head_count"))
    n_kv_heads = int(_scalar(meta, "llama.attention.head_count_kv", n_heads))
    weights = _convert_weights(tensors, n_heads, n_kv_heads)
    config = _model_config(meta, weights, weights["model.embed_tokens.weight"].shape[0])
    ids = _special_ids(meta)
    if "bos" in ids:
        config["bos_token_id"] = ids["bos"]
    if "padding" in ids:
        config["pad_token_id"] = ids["padding"]
    if eos_ids := sorted({ids[k] for k in ("eos", "eot") if k in ids}):
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if (quant := _quantization(weights)) is not None:
        config["quantization"] = quant

    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    tokenizer.save(str(dest / "tokenizer.json"))

    roles = ("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token")
    special = {
        key: tokens[ids[name]] for name, key in roles + (("padding", "pad_token"),) if name in ids
    }
    if "eos_token" in special:
        special.setdefault("pad_token", special["eos_token"])
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_prefix_space": False,
        "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        **special,
    }
    if (template := _scalar(meta, "tokenizer.chat_template")) is not None:
        tok_config["chat_template"] = template
    gen_keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    generation = {k: config[k] for k in gen_keys if k in config}
    stamp = {"converter_version": CONVERTER_VERSION, **file_signature(gguf_path)}
    files = {
        "config.json": config,
        "tokenizer_config.json": tok_config,
        "special_tokens_map.json": special,
        "generation_config.json": generation,
        STAMP_FILE: stamp,  # written last: its presence marks a complete directory
    }
    for name, content in files.items():
        (dest / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")


def materialize_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert gguf_path into the mlx-lm directory out_dir (atomically) and return out_dir.

    If another process finishes a conversion of the same file first, its result is kept.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_dir(gguf_path, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache should be readable
        for _ in range(5):
            try:
                os.rename(tmp, out_dir)  # fails if out_dir exists and is not empty
                return out_dir
            except OSError:
                if is_materialized(out_dir, gguf_path):
                    return out_dir  # lost the race to an identical conversion
                _discard(out_dir)
        raise OSError(f"could not replace {out_dir}")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _discard(path: Path) -> None:
    # Move a stale entry aside first so readers never see a half-deleted directory.
    trash = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    if trash.is_dir() and not trash.is_symlink():
        shutil.rmtree(trash, ignore_errors=True)
    else:
        trash.unlink(missing_ok=True)
