"""The EAGLE-3 draft head in MLX, and its two checkpoint formats.

One Llama decoder layer whose attention reads 2H inputs: the normed embedding of the next token
next to the normed feature `g`. At a committed position `g = fc(concat(target rows))`; while
drafting past the committed context, `g` is the head's own previous output (no fc). Logits are
over a reduced draft vocabulary; `d2t` maps a draft id to a target id.
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

EAGLE_CONFIG = "config.json"


def default_capture_layers(num_target_layers: int) -> tuple[int, ...]:
    """Outputs of layers 1, L//2-1, L-4 (= inputs of layers 2, L//2, L-3); shallow targets get
    the distinct layers those clamp to."""
    n = num_target_layers
    wanted = (1, n // 2 - 1, n - 4)
    if n >= 6:
        return wanted
    return tuple(sorted({min(max(i, 0), n - 1) for i in wanted}))


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    head_dim: int | None = None
    target_hidden_size: int | None = None  # when the target's width differs from the head's
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    capture_layers: tuple[int, ...] = ()  # target layer outputs feeding fc (0-based)
    norm_before_residual: bool = False  # speculators: the residual is the normed feature
    # what specd records about the target a head was trained for (empty for published heads)
    target_fingerprint: str = ""
    target_name: str = ""
    tree: dict = field(default_factory=dict)  # drafting defaults: total_tokens, depth, top_k

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def feature_size(self) -> int:
        return self.target_hidden_size or self.hidden_size


def _rope(cfg: Eagle3Config) -> nn.Module:
    from mlx_lm.models.rope_utils import initialize_rope

    return initialize_rope(
        cfg.dim_per_head,
        cfg.rope_theta,
        traditional=False,
        scaling_config=cfg.rope_scaling,
        max_position_embeddings=cfg.max_position_embeddings,
    )


class Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        hd, nh, nkv = cfg.dim_per_head, cfg.num_attention_heads, cfg.num_key_value_heads
        self.n_heads, self.n_kv, self.head_dim = nh, nkv, hd
        self.scale = hd**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(2 * cfg.hidden_size, nh * hd, bias=bias)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, nkv * hd, bias=bias)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, nkv * hd, bias=bias)
        self.o_proj = nn.Linear(nh * hd, cfg.hidden_size, bias=bias)
        self.rope = _rope(cfg)

    def project(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array, mx.array]:
        """x [B, T, 2H] at positions offset.. -> q [B,nh,T,hd], k and v [B,nkv,T,hd]."""
        b, t, _ = x.shape

        def heads(y, n):
            return y.reshape(b, t, n, self.head_dim).transpose(0, 2, 1, 3)

        q = self.rope(heads(self.q_proj(x), self.n_heads), offset=offset)
        k = self.rope(heads(self.k_proj(x), self.n_kv), offset=offset)
        return q, k, heads(self.v_proj(x), self.n_kv)

    def attend(self, q, k, v, mask) -> mx.array:
        """mask: bool [T, S] (True = visible) or None (all visible)."""
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1))


class MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def inputs(self, emb: mx.array, feature: mx.array) -> tuple[mx.array, mx.array]:
        """(attention input [.., 2H], residual [.., H])."""
        normed = self.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature
        return mx.concatenate([self.input_layernorm(emb), normed], axis=-1), residual

    def finish(self, attn_out: mx.array, residual: mx.array) -> mx.array:
        h = residual + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        n_rows = max(1, len(cfg.capture_layers))
        self.fc = nn.Linear(n_rows * cfg.feature_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # draft id -> target id offset; fixed, not trained
        self.d2t = mx.zeros((cfg.draft_vocab_size,), dtype=mx.int64)

    def target_ids(self) -> np.ndarray:
        """The target token each draft id reads out: draft id i is target id i + d2t[i]."""
        d2t = np.asarray(self.d2t).astype(np.int64)
        return np.arange(len(d2t)) + d2t

    def step(
        self,
        emb: mx.array,
        feature: mx.array,
        offset: int,
        past: tuple[mx.array, mx.array] | None,
        mask: mx.array | None,
    ) -> tuple[mx.array, tuple[mx.array, mx.array]]:
        """One pass of the layer for T new entries at positions offset.. (tree levels share one
        position). Returns (hidden [B,T,H] before the final norm, (k, v) of the new entries)."""
        x, residual = self.midlayer.inputs(emb, feature)
        attn = self.midlayer.self_attn
        q, k, v = attn.project(x, offset)
        keys, values = (
            (k, v)
            if past is None
            else (
                mx.concatenate([past[0], k], axis=2),
                mx.concatenate([past[1], v], axis=2),
            )
        )
        out = attn.attend(q, keys, values, mask)
        return self.midlayer.finish(out, residual), (k, v)

    def logits(self, hidden: mx.array) -> mx.array:
        return self.lm_head(self.norm(hidden))


# ---------------------------------------------------------------- checkpoint formats

_LAYER_KEYS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
)


def _config_from_llama(d: dict, **extra) -> Eagle3Config:
    def need(key):
        if key not in d:
            raise CheckpointError(f"config lacks {key!r}")
        return d[key]

    return Eagle3Config(
        hidden_size=int(need("hidden_size")),
        intermediate_size=int(need("intermediate_size")),
        num_attention_heads=int(need("num_attention_heads")),
        num_key_value_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
        vocab_size=int(need("vocab_size")),
        draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
        head_dim=d.get("head_dim"),
        target_hidden_size=d.get("target_hidden_size"),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(d.get("rope_theta", 10000.0)),
        rope_scaling=d.get("rope_scaling"),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        attention_bias=bool(d.get("attention_bias", False)),
        **extra,
    )


def detect_format(directory: Path) -> str:
    cfg = json.loads((directory / EAGLE_CONFIG).read_text())
    return (
        "speculators"
        if "speculators_config" in cfg or "transformer_layer_config" in cfg
        else "eagle"
    )


def read_head_config(directory: Path) -> Eagle3Config:
    """The head's config from config.json alone, weights unread: enough to tell its target."""
    raw = json.loads((directory / EAGLE_CONFIG).read_text())
    if detect_format(directory) == "speculators":
        return _from_speculators(raw, {})[0]
    return _from_eagle_config(raw)


def load_head(directory: str | Path) -> tuple[Eagle3Head, dict[str, mx.array]]:
    """Load a head in the EAGLE/SpecForge or the speculators format.

    Returns the head and the optional tensors it may carry besides its own (`embed_tokens`).
    """
    directory = Path(directory)
    if not (directory / EAGLE_CONFIG).is_file():
        raise CheckpointError(f"{directory} has no {EAGLE_CONFIG}")
    raw = json.loads((directory / EAGLE_CONFIG).read_text())
    weights = strip_prefix(read_weights(directory))
    if detect_format(directory) == "speculators":
        cfg, weights = _from_speculators(raw, weights)
    else:
        cfg = _from_eagle_config(raw)
    extras = {}
    if "embed_tokens.weight" in weights:
        extras["embed_tokens"] = weights.pop("embed_tokens.weight")
    cfg_rows = weights.get("fc.weight")
    if cfg_rows is None:
        raise CheckpointError("checkpoint has no fc.weight")
    if not cfg.capture_layers:
        raise CheckpointError(
            "the head's config does not say which target layers feed it; "
            "set eagle_config.eagle_aux_hidden_state_layer_ids"
        )
    head = Eagle3Head(cfg)
    d2t = weights.pop("d2t", None)
    weights.pop("t2d", None)  # derivable from d2t
    if d2t is not None:
        head.d2t = d2t.astype(mx.int64)
    elif cfg.draft_vocab_size != cfg.vocab_size:
        raise CheckpointError("draft vocab is reduced but the checkpoint has no d2t")
    expected = {k for k, _ in _flat(head.parameters())} - {"d2t"}
    missing = expected - set(weights)
    unknown = set(weights) - expected
    if missing or unknown:
        raise CheckpointError(
            f"weights do not match an EAGLE-3 head: missing {sorted(missing)[:6]}, "
            f"unexpected {sorted(unknown)[:6]}"
        )
    for name, value in weights.items():
        want = dict(_flat(head.parameters()))[name].shape
        if tuple(value.shape) != tuple(want):
            raise CheckpointError(f"{name} has shape {tuple(value.shape)}, config implies {want}")
    head.load_weights([(k, v.astype(mx.float32)) for k, v in weights.items()], strict=False)
    mx.eval(head.parameters())
    return head, extras


def _flat(tree, prefix=""):
    from mlx.utils import tree_flatten

    return tree_flatten(tree, prefix=prefix)


def _from_eagle_config(raw: dict) -> Eagle3Config:
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    return _config_from_llama(raw, **_capture_and_specd(raw, aux))


def _capture_and_specd(raw: dict, aux) -> dict:
    """Published configs count aux layers as layer *inputs* (vLLM, speculators); specd captures
    layer outputs, so layer i's input is layer i-1's output."""
    specd = raw.get("specd") or {}
    capture = specd.get("capture_layers")
    if capture is None and aux:
        capture = [int(i) - 1 for i in aux]
    if capture is None:
        n = raw.get("num_target_layers") or specd.get("target_num_layers")
        capture = list(default_capture_layers(int(n))) if n else []
    if any(i < 0 for i in capture):
        raise CheckpointError(f"aux hidden state layer ids {aux} must be >= 1 (layer inputs)")
    return {
        "capture_layers": tuple(int(i) for i in capture),
        "target_fingerprint": specd.get("target_fingerprint", ""),
        "target_name": specd.get("target_name", ""),
        "tree": dict(specd.get("tree") or {}),
    }


def _from_speculators(raw: dict, weights: dict) -> tuple[Eagle3Config, dict]:
    layer_cfg = raw.get("transformer_layer_config")
    if layer_cfg is None:
        raise CheckpointError("speculators config lacks transformer_layer_config")
    aux = raw.get("eagle_aux_hidden_state_layer_ids") or []
    layer_cfg = {**layer_cfg}
    layer_cfg.setdefault("draft_vocab_size", raw.get("draft_vocab_size"))
    if raw.get("target_hidden_size"):
        layer_cfg["target_hidden_size"] = raw["target_hidden_size"]
    cfg = _config_from_llama(
        layer_cfg,
        # the speculators library's own default; vLLM's adapter assumes True when absent
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        **_capture_and_specd(raw, aux),
    )
    if raw.get("norm_before_fc"):
        raise CheckpointError("norm_before_fc heads are not supported yet")
    renamed = {}
    for k, v in weights.items():
        if k.startswith("layers.0."):
            renamed["midlayer." + k.removeprefix("layers.0.")] = v
        elif k.startswith("layers."):
            raise CheckpointError(f"{k}: only single-layer EAGLE-3 heads are supported")
        else:
            renamed[k] = v
    return cfg, renamed


def save_head(
    head: Eagle3Head, directory: str | Path, fmt: str = "eagle", dtype: mx.Dtype = mx.float16
) -> None:
    """Write the head in the EAGLE/SpecForge (`eagle`) or the `speculators` format."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = head.config
    flat = {k: v for k, v in _flat(head.parameters()) if k != "d2t"}
    weights = {k: v.astype(dtype) for k, v in flat.items()}
    d2t = np.asarray(head.d2t).astype(np.int64)
    t2d = np.zeros(cfg.vocab_size, dtype=np.bool_)
    t2d[head.target_ids()] = True
    weights["d2t"] = mx.array(d2t)
    weights["t2d"] = mx.array(t2d)
    llama = {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.dim_per_head,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": cfg.attention_bias,
        "hidden_act": "silu",
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "model_type": "llama",
    }
    if cfg.target_hidden_size:
        llama["target_hidden_size"] = cfg.target_hidden_size
    specd = {
        "target_fingerprint": cfg.target_fingerprint,
        "target_name": cfg.target_name,
        "capture_layers": list(cfg.capture_layers),
        "tree": cfg.tree,
    }
    aux = [i + 1 for i in cfg.capture_layers]  # published configs count layer inputs
    if fmt == "eagle":
        if cfg.norm_before_residual:
            raise ValueError("the eagle format has no norm_before_residual; use speculators")
        config = {
            "architectures": ["LlamaForCausalLMEagle3"],
            **llama,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux},
            "specd": specd,
        }
    elif fmt == "speculators":
        weights = {
            ("layers.0." + k.removeprefix("midlayer.")) if k.startswith("midlayer.") else k: v
            for k, v in weights.items()
        }
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": {**llama, "architectures": ["LlamaForCausalLM"]},
            "draft_vocab_size": cfg.draft_vocab_size,
            "norm_before_residual": cfg.norm_before_residual,
            "eagle_aux_hidden_state_layer_ids": aux,
            "speculators_config": {"algorithm": "eagle3"},
            "specd": specd,
        }
        if cfg.target_hidden_size:
            config["target_hidden_size"] = cfg.target_hidden_size
    else:
        raise ValueError(f"unknown format {fmt!r}; choose eagle or speculators")
    save_weights(directory, weights)
    (directory / EAGLE_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
