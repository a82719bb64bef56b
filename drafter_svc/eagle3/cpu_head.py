"""EAGLE-3 head forwards of a few rows on numpy and the compiled kernels (CPU).

The head is one decoder layer and a read-out, ~9 M weights. In MLX on a CPU a one-row step
costs ~2.5 ms, most of it evaluating a dozen small graphs; a chain of four drafts took ~10 ms
of a ~13 ms decode step, so adaptive speculation rarely found drafting worth it. The same step
here reads each weight once (float16 where the checkpoint's values are float16) with the
verifier's kernels (specd.cpu.row_products, specd.cpu.llama): docs/history,
"The EAGLE-3 head off MLX" (2026-12-01).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from drafter_svc.eagle3.model import Eagle3Head
from specd.cpu.gemv import GemvWeights, float32_view, paired
from specd.cpu.half import exactly_half
from specd.cpu.llama import RopeTables, attend_numpy, rms_norm, turns_pairs
from specd.cpu.row_products import layer_kernels

MAX_ROWS = 64  # faster than MLX at every size measured to 64 rows; a prompt goes to MLX


def _products(linear: nn.Linear) -> GemvWeights:
    half = exactly_half(linear.weight)
    weight = np.asarray(half) if half is not None else np.asarray(linear.weight)
    bias = linear.get("bias")
    bias = None if bias is None else np.asarray(bias.astype(mx.float32))
    return paired(GemvWeights(np.ascontiguousarray(weight), bias, MAX_ROWS))


def _norm(norm: nn.RMSNorm) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(norm.weight.astype(mx.float32)))


class CpuHead:
    """A head's forwards on the CPU (numpy and the compiled kernels); build with
    `CpuHead.attach`, which says None when it cannot (kernels not built, a head size not a
    multiple of 8, a RoPE it does not know)."""

    max_rows = MAX_ROWS

    def __init__(self, head: Eagle3Head, embedding: mx.array):
        cfg = head.config
        layer, attn = head.midlayer, head.midlayer.self_attn
        self.hidden_size = cfg.hidden_size
        self.heads, self.kv_heads, self.head_dim = attn.n_heads, attn.n_kv, attn.head_dim
        self.scale = np.float32(attn.scale)
        self.eps = cfg.rms_norm_eps
        self.norm_before_residual = cfg.norm_before_residual
        self.fc, self.q, self.k, self.v, self.o = (
            _products(m) for m in (head.fc, attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        )
        self.gate, self.up, self.down = (
            _products(m) for m in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)
        )
        self.lm_head = _products(head.lm_head)
        self.input_norm, self.hidden_norm = _norm(layer.input_layernorm), _norm(layer.hidden_norm)
        self.post_norm, self.final_norm = _norm(layer.post_attention_layernorm), _norm(head.norm)
        self.embedding = float32_view(embedding)  # the target's [V, H]; rows only
        self.rope = RopeTables(attn.rope)

    @classmethod
    def attach(cls, head: Eagle3Head, embedding: mx.array) -> CpuHead | None:
        attn = head.midlayer.self_attn
        if layer_kernels() is None or attn.head_dim % 8 or not turns_pairs(attn.rope):
            return None
        if float32_view(embedding) is None:
            return None
        return cls(head, embedding)

    def embed(self, target_ids) -> np.ndarray:
        return self.embedding[np.asarray(target_ids, dtype=np.int64)]

    def _rms(self, h: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return rms_norm(h, weight, self.eps)

    def features(self, rows: np.ndarray) -> np.ndarray:
        """fc over target rows [T, layers * H] -> g [T, H]."""
        return self.fc.of_rows(np.ascontiguousarray(rows, dtype=np.float32))

    def step(
        self,
        emb: np.ndarray,
        feature: np.ndarray,
        positions: np.ndarray,
        keys: np.ndarray,
        values: np.ndarray,
        past: int,
        sees: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The layer for T new entries at `positions`, attending over the first `past` cached
        entries of keys / values [kv, capacity, D] and the new ones: `sees` [T, T] says which
        new entries each sees, beside every cached one (the compiled kernel); [T, past + T]
        says which of all (a draft tree's level, in numpy). Returns (hidden [T, H] before the
        final norm, new keys and values [kv, T, D])."""
        kernels = layer_kernels()
        n, width = len(emb), self.hidden_size
        normed = self._rms(np.ascontiguousarray(feature, dtype=np.float32), self.hidden_norm)
        x = np.empty((n, 2 * width), np.float32)
        x[:, :width] = self._rms(np.ascontiguousarray(emb, dtype=np.float32), self.input_norm)
        x[:, width:] = normed
        residual = normed if self.norm_before_residual else feature
        cos, sin = self.rope.at(np.asarray(positions))
        q = np.empty((self.heads, n, self.head_dim), np.float32)
        kernels.rope(self.q.of_rows(x), cos, sin, self.rope.traditional, q)
        k = np.empty((self.kv_heads, n, self.head_dim), np.float32)
        kernels.rope(self.k.of_rows(x), cos, sin, self.rope.traditional, k)
        v = self.v.of_rows(x).reshape(n, self.kv_heads, self.head_dim).transpose(1, 0, 2)
        v = np.ascontiguousarray(v)
        if sees.shape[1] == n:
            attended = np.empty((n, self.heads * self.head_dim), np.float32)
            kernels.attention(q * self.scale, k, v, keys, values, past, sees, attended)
        else:
            keys = np.concatenate([keys[:, :past], k], axis=1)
            values = np.concatenate([values[:, :past], v], axis=1)
            attended = attend_numpy(q * self.scale, keys, values, sees)
        h = residual + self.o.of_rows(attended)
        x = self._rms(h, self.post_norm)
        gate = self.gate.of_rows(x)
        kernels.swiglu(gate, self.up.of_rows(x))
        return h + self.down.of_rows(gate), k, v

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [T, H] -> draft-vocabulary logits [T, draft vocab]."""
        return self.lm_head.of_rows(self._rms(hidden, self.final_norm))
