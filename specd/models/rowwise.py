"""Verify forwards of a few tokens computed row by row, as decode steps compute them (GPU).

On MLX's CUDA backend a product with one input row runs as a matrix-vector kernel, while two
or more rows go to cuBLAS, about 2.5x the time at a small model's sizes; and attention runs
fused for at most three query rows, unfused (about 5x) beyond. So a verify of k+1 tokens
costs about two decode steps (docs/gpu.md, benchmarks/gpu_ops.py). Here each weight product of
a few rows, the logits' included, runs on CUDA as one kernel that sums every row as the
matrix-vector kernel does (specd.models.few_rows; elsewhere as a batch of matrix-vector
products, the weight broadcast over the batch), and attention runs in causal chunks of at most
three query rows that MLX's one-row kernel covers: each row is computed as a decode step
computes it.

For Llama-family mlx-lm models with plain (unquantized) weights; anything else keeps mlx-lm's
own code.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from specd.models import few_rows

DEFAULT_MAX_ROWS = few_rows.MAX_ROWS  # past this a matrix product (weights read once) wins
FUSED_QUERY_ROWS = 3  # MLX's CUDA attention fuses fewer than four query rows
# MLX's one-row attention kernel splits its keys another way past this many: a chunk never
# holds rows from both sides, so each row is summed as its decode step sums it
TWO_PASS_KEYS = 1024
LINEARS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


class RowLinear(nn.Module):
    """A Linear whose input of 2..max_rows rows is multiplied as one-row products are: on CUDA
    by the few-row kernel, elsewhere as one batched matrix-vector product (cuda_only: there
    the model's own product)."""

    def __init__(self, inner: nn.Linear, max_rows: int, cuda_only: bool = False):
        super().__init__()
        self.inner = inner
        self._max_rows = max_rows
        self._cuda_only = cuda_only  # elsewhere the model's own product

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if not 1 < rows <= self._max_rows or (self._cuda_only and not few_rows.runs_here()):
            return self.inner(x)
        out = _few_rows_product(x, self.inner.weight, rows)
        if "bias" in self.inner:
            out = out + self.inner.bias
        return out


class RowEmbedding(nn.Embedding):
    """A tied embedding whose logits projection of 2..max_rows rows runs on CUDA as RowLinear's
    products do (elsewhere as the model's own)."""

    def __init__(self, inner: nn.Embedding, max_rows: int):
        nn.Module.__init__(self)
        self.weight = inner.weight
        self._max_rows = max_rows

    def as_linear(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if not 1 < rows <= self._max_rows or not few_rows.runs_here():
            return super().as_linear(x)
        return _few_rows_product(x, self.weight, rows)


class Joined:
    """Products that share their input as one weight [sum of outputs, in] for the few-row
    kernel (one launch for q, k and v; one for gate and up). Each Linear's weight becomes a
    view of it, so the model's own one-row products read the same numbers and no memory is
    added."""

    def __init__(self, linears: list[nn.Linear]):
        self.weight = mx.concatenate([linear.weight for linear in linears])
        mx.eval(self.weight)
        self.spans, start = [], 0
        for linear in linears:
            stop = start + linear.weight.shape[0]
            linear.weight = self.weight[start:stop]
            self.spans.append((start, stop))
            start = stop
        mx.eval([linear.weight for linear in linears])

    @staticmethod
    def of(linears: list[nn.Linear]) -> Joined | None:
        """Joined where the kernel runs and the products take it (no bias, a float weight)."""
        if not few_rows.runs_here() or any("bias" in linear for linear in linears):
            return None
        weight = linears[0].weight
        if weight.dtype not in few_rows.DTYPES:
            return None
        return Joined(linears)

    def takes(self, x: mx.array, rows: int, max_rows: int) -> bool:
        """Whether `rows` rows of x go through the kernel here."""
        return rows <= max_rows and few_rows.runs_here() and few_rows.fits(rows, x, self.weight)

    def products(self, x: mx.array) -> list[mx.array]:
        out = few_rows.product(x, self.weight)
        return [out[..., start:stop] for start, stop in self.spans]


class RowMLP(nn.Module):
    """mlx-lm's Llama MLP whose gate and up products of 2..max_rows rows run as one few-row
    product (`Joined`) where the kernel runs; elsewhere, and for other row counts, its own."""

    def __init__(self, inner: nn.Module, max_rows: int):
        super().__init__()
        self.inner = inner
        self._max_rows = max_rows
        self._gate_up: Joined | None = None

    def __getattr__(self, key):
        # code that reads the MLP's products (gate_proj, ...) finds the wrapped MLP's
        try:
            return super().__getattr__(key)
        except AttributeError:
            if "inner" not in self:
                raise
            return getattr(self["inner"], key)

    def join(self) -> None:
        if self._gate_up is None:
            self._gate_up = Joined.of([_linear(self.inner.gate_proj), _linear(self.inner.up_proj)])

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if not (self._gate_up is not None and self._gate_up.takes(x, rows, self._max_rows)):
            return self.inner(x)
        gate, up = self._gate_up.products(x)
        return self.inner.down_proj(swiglu(gate, up))  # as the model's MLP combines them


def _linear(module: nn.Module) -> nn.Linear:
    return module.inner if isinstance(module, RowLinear) else module


def _few_rows_product(x: mx.array, weight: mx.array, rows: int) -> mx.array:
    """x [..., in] times weight [out, in] transposed, for 2..max_rows rows."""
    if few_rows.runs_here() and few_rows.fits(rows, x, weight):
        return few_rows.product(x, weight)
    columns = x.reshape(rows, x.shape[-1], 1)
    out = mx.matmul(mx.broadcast_to(weight, (rows, *weight.shape)), columns)
    return out.reshape(*x.shape[:-1], weight.shape[0])


class ChunkedAttention(nn.Module):
    """mlx-lm's Llama attention, with 2..max_rows query rows under a causal mask attended in
    chunks the fused one-row kernel takes (`chunk_bounds`). Array masks (draft trees) and
    longer inputs (a prefill: hundreds of chunks would cost several times the unfused kernel)
    take the model's own path."""

    def __init__(self, inner: nn.Module, max_rows: int):
        super().__init__()
        self.inner = inner
        self._max_rows = max_rows
        self._qkv: Joined | None = None

    def join(self) -> None:
        if self._qkv is None:
            a = self.inner
            self._qkv = Joined.of([_linear(a.q_proj), _linear(a.k_proj), _linear(a.v_proj)])

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        batch, rows, _ = x.shape
        causal = mask is None or (isinstance(mask, str) and mask == "causal")
        if not self.chunks(rows) or batch != 1 or cache is None or not causal:
            return self.inner(x, mask=mask, cache=cache)
        a = self.inner
        if self._qkv is not None and self._qkv.takes(x, rows, self._max_rows):
            queries, keys, values = self._qkv.products(x)
        else:
            queries, keys, values = a.q_proj(x), a.k_proj(x), a.v_proj(x)
        queries = queries.reshape(1, rows, a.n_heads, -1).transpose(0, 2, 1, 3)
        keys = keys.reshape(1, rows, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = values.reshape(1, rows, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        queries = a.rope(queries, offset=cache.offset)
        keys = a.rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
        out = self.attend(queries, keys, values, rows)
        return a.o_proj(out.transpose(0, 2, 1, 3).reshape(1, rows, -1))

    def chunks(self, rows: int) -> bool:
        """Whether `rows` query rows are attended in chunks (else the model's own call)."""
        return 1 < rows <= self._max_rows

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, rows: int) -> mx.array:
        """Causal attention of the last `rows` positions [1, heads, rows, D] to the cache's
        keys and values, in chunks of rows the fused kernel takes."""
        scale = self.inner.scale
        base = keys.shape[2] - rows
        parts = []
        for start, stop in chunk_bounds(base, rows):
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
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def chunk_bounds(base: int, rows: int) -> list[tuple[int, int]]:
    """Chunks [start, stop) of at most FUSED_QUERY_ROWS of the `rows` queries after `base`
    cached tokens (query r sees base + r + 1 keys), none holding queries that see at most
    TWO_PASS_KEYS keys beside ones that see more."""
    split = TWO_PASS_KEYS - base  # the first query seeing more keys than that
    bounds, start = [], 0
    while start < rows:
        stop = min(start + FUSED_QUERY_ROWS, rows)
        if start < split < stop:
            stop = split
        bounds.append((start, stop))
        start = stop
    return bounds


def _unwrapped(module: nn.Module) -> nn.Module:
    return module.inner if isinstance(module, (ChunkedAttention, RowMLP)) else module


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
        if not isinstance(layer.mlp, RowMLP):
            layer.mlp = RowMLP(layer.mlp, max_rows)
        layer.self_attn.join()
        layer.mlp.join()
    _install_logits(model, max_rows)
    return True


def _install_logits(model: nn.Module, max_rows: int) -> None:
    """The logits projection of a few rows as the decoder's products (mlx-lm's Model: a tied
    embedding's `as_linear`, or a plain `lm_head`)."""
    inner = getattr(model, "model", None)
    embedding = getattr(inner, "embed_tokens", None)
    if type(embedding) is nn.Embedding:
        inner.embed_tokens = RowEmbedding(embedding, max_rows)
    head = getattr(model, "lm_head", None)
    if type(head) is nn.Linear:
        model.lm_head = RowLinear(head, max_rows, cuda_only=True)
