"""Tiny random-weight Llama model directories for logic tests: nothing downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_level_tokenizer(extra_specials: tuple[str, ...] = ()) -> Tokenizer:
    specials = [*SPECIALS, *extra_specials]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return tok


def make_tiny_model_dir(
    path: Path,
    seed: int = 0,
    num_layers: int = 2,
    hidden: int = 64,
    extra_specials: tuple[str, ...] = (),
    max_positions: int = 1024,
    eos_token: str = "<|im_end|>",
    config_overrides: dict | None = None,
    half_exact: bool = False,
) -> Path:
    """A loadable mlx-lm directory: random Llama weights, byte-level tokenizer, chat template.
    half_exact: float32 weights float16 holds exactly, as a dequantized checkpoint's are."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _byte_level_tokenizer(extra_specials)
    vocab_size = tokenizer.get_vocab_size()
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": max_positions,
        "eos_token_id": tokenizer.token_to_id(eos_token),
    }
    config.update(config_overrides or {})
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    # larger-than-default weights make the random model's argmax decisive, not near-ties
    params = {k: v * 4 if v.ndim == 2 else v for k, v in tree_flatten(model.parameters())}
    if half_exact:
        params = {k: v.astype(mx.float16).astype(mx.float32) for k, v in params.items()}
    mx.save_safetensors(str(path / "model.safetensors"), params)
    (path / "config.json").write_text(json.dumps(config))
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": CHAT_TEMPLATE,
                "eos_token": eos_token,
                "bos_token": None,
                "unk_token": None,
                "pad_token": "<|endoftext|>",
                "model_max_length": 1024,
            }
        )
    )
    return path


def make_tiny_eagle3_dir(
    path: Path, target_dir: Path, seed: int = 0, capture=(0, 1), fingerprint: str | None = None
) -> Path:
    """A random EAGLE-3 head for a tiny target, with a reduced draft vocabulary. Its read-out
    starts from the target's own embedding rows so some drafts are right."""
    import numpy as np

    from drafter_svc.eagle3.model import Eagle3Config, Eagle3Head, save_head
    from specd.models.load import describe_tokenizer

    config = json.loads((target_dir / "config.json").read_text())
    vocab = config["vocab_size"]
    if fingerprint is None:
        fingerprint, _ = describe_tokenizer(str(target_dir))
    cfg = Eagle3Config(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        vocab_size=vocab,
        draft_vocab_size=vocab - 16,
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=config["rope_theta"],
        capture_layers=tuple(capture),
        target_fingerprint=fingerprint,
        target_name=target_dir.name,
    )
    mx.random.seed(seed)
    head = Eagle3Head(cfg)
    draft_ids = np.sort(np.random.default_rng(seed).choice(vocab, vocab - 16, replace=False))
    head.d2t = mx.array(draft_ids - np.arange(len(draft_ids)), dtype=mx.int64)
    embed = mx.load(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"]
    head.lm_head.weight = embed[mx.array(draft_ids)]
    save_head(head, path, dtype=mx.float32)
    return path


def make_tiny_dflash_dir(
    path: Path, target_dir: Path, seed: int = 0, layer_ids=(0, 1), block_size: int = 4,
    fingerprint: str | None = None,
) -> Path:  # fmt: skip
    """A random DFlash drafter for a tiny target (mask token: <|endoftext|>)."""
    from drafter_svc.dflash.model import DFlashConfig, DFlashDrafter, save_drafter
    from specd.models.load import describe_tokenizer

    config = json.loads((target_dir / "config.json").read_text())
    if fingerprint is None:
        fingerprint, _ = describe_tokenizer(str(target_dir))
    cfg = DFlashConfig(
        hidden_size=config["hidden_size"],
        num_hidden_layers=2,
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        vocab_size=config["vocab_size"],
        block_size=block_size,
        mask_token_id=0,
        target_layer_ids=tuple(layer_ids),
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=config["rope_theta"],
        num_target_layers=config["num_hidden_layers"],
        target_fingerprint=fingerprint,
        target_name=target_dir.name,
    )
    mx.random.seed(seed)
    save_drafter(DFlashDrafter(cfg), path, dtype=mx.float32)
    return path
