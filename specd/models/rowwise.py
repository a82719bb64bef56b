"""Verify forwards of a few tokens computed row by row, as decode steps compute them (GPU).

On MLX's CUDA backend a product with one input row runs as a matrix-vector kernel, while two
or more rows go to cuBLAS, about 2.5x the time at a small model's sizes; and attention runs
fused for at most three query rows, unfused (about 5x) beyond. So a verify of k+1 tokens
costs about two decode steps (docs/gpu.md, benchmarks/gpu_ops.py). Here each weight product of
a few rows runs as a batch of matrix-vector products, the weight broadcast over the batch
(read once per row from cache), and attention in causal chunks of three query rows: each row
is computed by the kernels a decode step uses.

For Llama-family mlx-lm models with plain (unquantized) weights; the logits projection and
anything else keep mlx-lm's own code.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

DEFAULT_MAX_ROWS = 16  # past this a matrix product (weights read once) wins
FUSED_QUERY_ROWS = 3  # MLX's CUDA attention fuses fewer than four query rows
LINEARS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


class RowLinear(nn.Module):
    """A Linear whose input of 2..max_rows rows is multiplied one row at a time, in one
    batched matrix-vector product."""

    def __init__(self, inner: nn.Linear, max_rows: int):
        super().__init__()
        self.inner = inner
        self._max_rows = max_rows

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if not 1 < rows <= self._max_rows:
            return self.inner(x)
        weight = self.inner.weight  # [out, in]
        columns = x.reshape(rows, x.shape[-1], 1)
        out = mx.matmul(mx.broadcast_to(weight, (rows, *weight.shape)), columns)
        out = out.reshape(*x.shape[:-1], weight.shape[0])
        if "bias" in self.inner:
            out = out + self.inner.bias
        return out


class ChunkedAttention(nn.Module):
    """mlx-lm's Llama attention, with 4..max_rows query rows under a causal mask attended in
    chunks small enough for the fused kernel. Array masks (draft trees) and longer inputs (a
    prefill: hundreds of chunks would cost several times the unfused kernel) take the model's
    own path."""

    def __init__(self, inner: nn.Module, max_rows: int):
        super().__init__()
        self.inner = inner
        self._max_rows = max_rows

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        batch, rows, _ = x.shape
        causal = mask is None or (isinstance(mask, str) and mask == "causal")
        if not self.chunks(rows) or batch != 1 or cache is None or not causal:
            return self.inner(x, mask=mask, cache=cache)
        a = self.inner
        queries = a.q_proj(x).reshape(1, rows, a.n_heads, -1).transpose(0, 2, 1, 3)
        keys = a.k_proj(x).reshape(1, rows, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = a.v_proj(x).reshape(1, rows, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        queries = a.rope(queries, offset=cache.offset)
        keys = a.rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
        out = self.attend(queries, keys, values, rows)
        return a.o_proj(out.transpose(0, 2, 1, 3).reshape(1, rows, -1))

    def chunks(self, rows: int) -> bool:
        """Whether `rows` query rows are attended in chunks (else the model's own call)."""
        return FUSED_QUERY_ROWS < rows <= self._max_rows

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, rows: int) -> mx.array:
        """Causal attention of the last `rows` positions [1, heads, rows, D] to the cache's
        keys and values, in chunks of rows the fused kernel takes."""
        scale = self.inner.scale
        base = keys.shape[2] - rows
        parts = []
        for start in range(0, rows, FUSED_QUERY_ROWS):
            stop = min(start + FUSED_QUERY_ROWS, rows)
            # "causal" aligns the chunk's last query with the last key given
            parts.append(
                mx.fast.scaled_dot_product_attention(
                    queries[:, :, start:stop],
                    keys[:, :, : base + stop],
                    values[:, :, : base + stop],
                    scale=scale,
                    mask="causal",
                )
            )
        return mx.concatenate(parts, axis=2)


def _unwrapped(module: nn.Module) -> nn.Module:
    return module.inner if isinstance(module, ChunkedAttention) else module


def supports(model: nn.Module) -> bool:
    """Llama-family decoder layers whose products are plain Linears."""
    for layer in model.layers:
        layer = getattr(layer, "inner", layer)  # a capture wrapper
        attn = getattr(layer, "self_attn", None)
        if attn is None or type(_unwrapped(attn)).__module__ != "mlx_lm.models.llama":
            return False
        for part, names in LINEARS.items():
            module = _unwrapped(getattr(layer, part, None))
            for name in names:
                if type(getattr(module, name, None)) not in (nn.Linear, RowLinear):
                    return False
    return True


def install(model: nn.Module, max_rows: int = DEFAULT_MAX_ROWS) -> bool:
    """Wrap every decoder layer's products and attention once; False (nothing changed) when
    the architecture is not one this covers."""
    if not supports(model):
        return False
    for layer in model.layers:
        layer = getattr(layer, "inner", layer)
        for part, names in LINEARS.items():
            module = _unwrapped(getattr(layer, part))
            for name in names:
                linear = getattr(module, name)
                if not isinstance(linear, RowLinear):
                    setattr(module, name, RowLinear(linear, max_rows))
        if not isinstance(layer.self_attn, ChunkedAttention):
            layer.self_attn = ChunkedAttention(layer.self_attn, max_rows)
    return True
