"""The DFlash block drafter in MLX, and its (z-lab) checkpoint format.

Qwen3-style layers (q_norm/k_norm) draft a whole block at once: the block
`[last token, MASK x (bs-1)]` is embedded with the target's embedding, attends to itself
bidirectionally and to the context, and is read out with the target's lm_head at positions
1..bs-1. The context enters every layer only as keys and values: each layer projects the shared
feature `hidden_norm(fc(concat(target rows)))` with its own k_proj/v_proj (k normed too).
Context keys sit at their true positions, the block right after them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from drafter_svc.checkpoints import CheckpointError, read_weights, save_weights, strip_prefix
from drafter_svc.layers import MLP

CONFIG = "config.json"
# optional: the target tokens the drafter reads out, most frequent first (frequency-ranked
# readout); a checkpoint without it reads out the whole vocabulary
DRAFT_VOCAB = "draft_vocab.npy"


@dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # outputs of these target layers feed fc (0-based)
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    num_target_layers: int = 0
    target_hidden_size: int | None = None
    target_fingerprint: str = ""
    target_name: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def feature_size(self) -> int:
        return self.target_hidden_size or self.hidden_size


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        hd, nh, nkv = cfg.dim_per_head, cfg.num_attention_heads, cfg.num_key_value_heads
        self.n_heads, self.n_kv, self.head_dim = nh, nkv, hd
        self.scale = hd**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, nh * hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, nkv * hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, nkv * hd, bias=bias)
        self.o_proj = nn.Linear(nh * hd, cfg.hidden_size, bias=bias)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        from mlx_lm.models.rope_utils import initialize_rope

        self.rope = initialize_rope(
            hd, cfg.rope_theta, False, cfg.rope_scaling, cfg.max_position_embeddings
        )

    def _heads(self, y: mx.array, n: int) -> mx.array:
        b, t, _ = y.shape
        return y.reshape(b, t, n, self.head_dim).transpose(0, 2, 1, 3)

    def context_kv(self, ctx: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        """Keys and values of context features [B, C, H] at positions offset.."""
        k = self.rope(self.k_norm(self._heads(self.k_proj(ctx), self.n_kv)), offset=offset)
        return k, self._heads(self.v_proj(ctx), self.n_kv)

    def __call__(self, x, offset: int, past_k, past_v, mask=None) -> mx.array:
        """x: block [B, T, H] at positions offset..; attends to past (context) keys and to the
        whole block (or as `mask` [T, S] says)."""
        q = self.rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), offset=offset)
        k = self.rope(self.k_norm(self._heads(self.k_proj(x), self.n_kv)), offset=offset)
        v = self._heads(self.v_proj(x), self.n_kv)
        if past_k is not None:
            k = mx.concatenate([past_k, k], axis=2)
            v = mx.concatenate([past_v, v], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1))


class Layer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x, offset, past_k, past_v, mask=None):
        h = x + self.self_attn(self.input_layernorm(x), offset, past_k, past_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.feature_size, cfg.hidden_size,
                            bias=False)  # fmt: skip
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [Layer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def context_features(self, rows: mx.array) -> mx.array:
        return self.hidden_norm(self.fc(rows))

    def context_kv(self, rows: mx.array, offset: int) -> list[tuple[mx.array, mx.array]]:
        """Per layer (keys, values) of target rows [B, C, L*H] at positions offset.."""
        ctx = self.context_features(rows)
        return [layer.self_attn.context_kv(ctx, offset) for layer in self.layers]

    def __call__(self, block_emb, offset: int, past: list, mask=None) -> mx.array:
        """block_emb [B, T, H] at positions offset..; past: per layer (k, v) or None.
        Returns hidden states after the final norm [B, T, H]."""
        x = block_emb
        for layer, kv in zip(self.layers, past, strict=True):
            k, v = kv if kv is not None else (None, None)
            x = layer(x, offset, k, v, mask)
        return self.norm(x)


# ---------------------------------------------------------------- checkpoint format


def _need(d: dict, key: str):
    if key not in d:
        raise CheckpointError(f"config lacks {key!r}")
    return d[key]


def config_from_dict(raw: dict) -> DFlashConfig:
    dcfg = raw.get("dflash_config")
    if not isinstance(dcfg, dict):
        raise CheckpointError("config lacks dflash_config {mask_token_id, target_layer_ids}")
    if "mask_token_id" not in dcfg or "target_layer_ids" not in dcfg:
        raise CheckpointError(
            "dflash_config must give mask_token_id and target_layer_ids (they are not guessed)"
        )
    specd = raw.get("specd") or {}
    return DFlashConfig(
        hidden_size=int(_need(raw, "hidden_size")),
        num_hidden_layers=int(_need(raw, "num_hidden_layers")),
        intermediate_size=int(_need(raw, "intermediate_size")),
        num_attention_heads=int(_need(raw, "num_attention_heads")),
        num_key_value_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
        vocab_size=int(_need(raw, "vocab_size")),
        block_size=int(_need(raw, "block_size")),
        mask_token_id=int(dcfg["mask_token_id"]),
        target_layer_ids=tuple(int(i) for i in dcfg["target_layer_ids"]),
        head_dim=raw.get("head_dim"),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta", 1e6)),
        rope_scaling=raw.get("rope_scaling"),
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        attention_bias=bool(raw.get("attention_bias", False)),
        num_target_layers=int(raw.get("num_target_layers", 0)),
        target_hidden_size=raw.get("target_hidden_size"),
        target_fingerprint=specd.get("target_fingerprint", ""),
        target_name=specd.get("target_name", ""),
    )


def read_drafter_config(directory: Path) -> DFlashConfig:
    """The drafter's config from config.json alone, weights unread."""
    return config_from_dict(json.loads((directory / CONFIG).read_text()))


def load_drafter(directory: str | Path) -> DFlashDrafter:
    directory = Path(directory)
    if not (directory / CONFIG).is_file():
        raise CheckpointError(f"{directory} has no {CONFIG}")
    cfg = read_drafter_config(directory)
    weights = strip_prefix(read_weights(directory))
    model = DFlashDrafter(cfg)
    from mlx.utils import tree_flatten

    expected = dict(tree_flatten(model.parameters()))
    missing = set(expected) - set(weights)
    unknown = set(weights) - set(expected)
    if missing or unknown:
        raise CheckpointError(
            f"weights do not match a DFlash drafter of {cfg.num_hidden_layers} layers: missing "
            f"{sorted(missing)[:6]}, unexpected {sorted(unknown)[:6]}"
        )
    for name, value in weights.items():
        if tuple(value.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{name} has shape {tuple(value.shape)}, config implies {expected[name].shape}"
            )
    model.load_weights([(k, v.astype(mx.float32)) for k, v in weights.items()])
    mx.eval(model.parameters())
    return model


def save_drafter(model: DFlashDrafter, directory: str | Path, dtype=mx.float16) -> None:
    from mlx.utils import tree_flatten

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    weights = {k: v.astype(dtype) for k, v in tree_flatten(model.parameters())}
    save_weights(directory, weights)
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.dim_per_head,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": cfg.attention_bias,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
        },
        "specd": {"target_fingerprint": cfg.target_fingerprint, "target_name": cfg.target_name},
    }
    if cfg.target_hidden_size:
        config["target_hidden_size"] = cfg.target_hidden_size
    (directory / CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def save_draft_vocab(directory: str | Path, token_ids) -> None:
    np.save(Path(directory) / DRAFT_VOCAB, np.asarray(token_ids, dtype=np.int32))


def load_draft_vocab(directory: str | Path, vocab_size: int) -> np.ndarray | None:
    """The checkpoint's readout tokens, most frequent first, or None if it has none."""
    path = Path(directory) / DRAFT_VOCAB
    if not path.is_file():
        return None
    try:
        ids = np.load(path, allow_pickle=False)
    except ValueError as exc:
        raise CheckpointError(f"{path} is not a .npy array: {exc}") from None
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise CheckpointError(f"{path} must be a 1-D array of token ids")
    ids = ids.astype(np.int64)
    if not len(ids) or ids.min() < 0 or ids.max() >= vocab_size:
        raise CheckpointError(f"{path}: token ids must be in [0, {vocab_size})")
    if len(np.unique(ids)) != len(ids):
        raise CheckpointError(f"{path}: token ids repeat")
    return ids
