"""Weight products of decode-sized forwards on numpy (CPU, float32).

MLX on CPU sends every Linear to one `cblas_sgemm`, and a general sgemm packs the whole
weight matrix before multiplying: for a few input rows that packing costs more than the
product. specd.cpu.row_products reads each weight once for one row or several (SmolLM2-135M,
all 211 products of a step, one row: ~40 ms against MLX's ~76 ms on a 2-core x86 box;
docs/history), on zero-copy views of the same weight buffers. Here the
rest of the graph stays in MLX, and each product makes MLX evaluate its input first, which is
why this pays only for a few rows; specd.cpu.llama runs whole Llama-family forwards
on these products instead.

Weights kept as float16 (specd.cpu.half) are read as such: the compiled products convert
them as they read and sum in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from specd.cpu.half import HalfEmbedding, HalfLinear, rebuilt, replace_modules
from specd.cpu.row_products import compiled, pair_rows, row_products

DEFAULT_MAX_ROWS = 3  # products alone, MLX around them: 1-3 rows faster than MLX's sgemm here


def default_max_rows(device: str, dtype: str) -> int:
    return DEFAULT_MAX_ROWS if device == "cpu" and dtype == "float32" else 0


def check_max_rows(max_rows: int, device: str, dtype: str) -> None:
    """Refuse a request that cannot apply, rather than ignore it."""
    if max_rows > 0 and (device != "cpu" or dtype != "float32"):
        raise ValueError(
            f"gemv products apply to float32 weights on the CPU; this target runs {dtype} "
            f"on the {device} (use --gemv-rows 0, or --dtype float32 on a CPU)"
        )


@dataclass(frozen=True)
class GemvWeights:
    """numpy views of one module's weights; a plain attribute, not an MLX parameter."""

    weight: np.ndarray
    bias: np.ndarray | None
    max_rows: int
    paired: np.ndarray | None = None  # specd.cpu.row_products.pair_rows(weight), read instead

    def wanted(self, x: mx.array) -> bool:
        return x.dtype == mx.float32 and x.size <= self.max_rows * x.shape[-1]

    def products(self, x: mx.array) -> mx.array:
        rows = np.asarray(x).reshape(-1, x.shape[-1])  # evaluates x
        out = self.of_rows(rows)
        return mx.array(out).reshape(*x.shape[:-1], self.weight.shape[0])

    def of_rows(self, rows: np.ndarray) -> np.ndarray:
        """rows [n, in] float32 -> [n, out] float32 (the weight float32 or float16)."""
        out = row_products(self.weight, rows, self.paired)
        if self.bias is not None:
            out += self.bias
        return out


class GemvLinear(HalfLinear):
    def __call__(self, x: mx.array) -> mx.array:
        if self._gemv.wanted(x):
            return self._gemv.products(x)
        return super().__call__(x)


class GemvEmbedding(HalfEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:  # tied output heads
        if self._gemv.wanted(x):
            return self._gemv.products(x)
        return super().as_linear(x)


_SWAPS = {
    nn.Linear: GemvLinear,
    HalfLinear: GemvLinear,
    nn.Embedding: GemvEmbedding,
    HalfEmbedding: GemvEmbedding,
}


def float32_view(array: mx.array) -> np.ndarray | None:
    if array.dtype != mx.float32:
        return None  # numpy has no bfloat16, and half products are slow there
    view = np.asarray(array)
    return view if view.flags.c_contiguous else None  # else numpy copies it every call


def weight_view(array: mx.array) -> np.ndarray | None:
    """A float32 view, or a float16 one of a weight kept half (the compiled products read
    both)."""
    if array.dtype == mx.float16 and compiled():
        view = np.asarray(array)
        return view if view.flags.c_contiguous else None
    return float32_view(array)


def use_gemv(model: nn.Module, max_rows: int) -> int:
    """Route products of at most `max_rows` rows in `model`'s float32 Linears (and tied
    embedding heads, and those keeping float16 weights: specd.cpu.half) to numpy, each
    module replaced by one holding the same weights and their numpy views; the weights must
    not be replaced afterwards. Returns how many modules were replaced."""
    if max_rows <= 0:
        return 0
    return replace_modules(model, lambda module: _with_products(module, max_rows))


def _with_products(module: nn.Module, max_rows: int) -> nn.Module | None:
    kind = _SWAPS.get(type(module))
    if kind is None:
        return None
    if module.weight.dtype != mx.float32 and type(module) not in (HalfLinear, HalfEmbedding):
        return None  # a model computing in half precision: MLX's
    weight = weight_view(module.weight)
    bias = module.get("bias")
    bias_view = None if bias is None else float32_view(bias)
    if weight is None or (bias is not None and bias_view is None):
        return None
    new = rebuilt(kind, module, module.weight)
    new._gemv = GemvWeights(weight, bias_view, max_rows)
    return new


def paired(gemv: GemvWeights) -> GemvWeights:
    """`gemv` reading a paired copy of its weight where the CPU and the shape allow one."""
    pairs = pair_rows(gemv.weight)
    return gemv if pairs is None else replace(gemv, paired=pairs)


def set_max_rows(model: nn.Module, max_rows: int) -> int:
    """Change how many rows switched modules send to numpy; returns max_rows."""
    for _, module in model.named_modules():
        if isinstance(module, (GemvLinear, GemvEmbedding)):
            module._gemv = replace(module._gemv, max_rows=max_rows)
    return max_rows
