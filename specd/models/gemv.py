"""Weight products of decode-sized forwards as numpy matrix-vector products (CPU, float32).

MLX on CPU sends every Linear to one `cblas_sgemm`, and a general sgemm packs the whole
weight matrix before multiplying: for one to three input rows that packing costs more than
the product. numpy's bundled OpenBLAS does each row as a `gemv` that reads the weights once
(SmolLM2-135M, all 211 products of a step: ~25 ms against MLX's ~55 ms on a 2-core x86 box;
docs/benchmarks.md, "Cost of a verify step"). So forwards of at most `max_rows` tokens hand
their Linear products to numpy, on zero-copy views of the same weight buffers, and the rest
of the graph stays in MLX. Each such product makes MLX evaluate its input first, which is why
it pays only for a few rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

DEFAULT_MAX_ROWS = 3  # measured: 1-3 rows faster than MLX's sgemm here, 4 even, 5 slower
# A second row re-reads the weights; blocks of this size are still in cache when it does
# (SmolLM2's 108 MiB output head, 2 / 3 rows: 18.8 / 28.9 ms whole, 16.5 / 21.9 ms by blocks).
BLOCK_BYTES = 4 << 20
# From this many rows a block's sgemm beats a gemv per row (SmolLM2's products, 5 / 8 rows:
# ~146 / 149 ms against 184 / 177 ms per forward)
GEMM_ROWS = 4


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
    blocks: tuple[tuple[int, np.ndarray], ...]  # (first row, rows) of about BLOCK_BYTES each
    max_rows: int

    def wanted(self, x: mx.array) -> bool:
        return x.dtype == mx.float32 and x.size <= self.max_rows * x.shape[-1]

    def products(self, x: mx.array) -> mx.array:
        rows = np.asarray(x).reshape(-1, x.shape[-1])  # evaluates x
        out = self.of_rows(rows)
        return mx.array(out).reshape(*x.shape[:-1], self.weight.shape[0])

    def of_rows(self, rows: np.ndarray) -> np.ndarray:
        """rows [n, in] float32 -> [n, out]."""
        out = np.empty((rows.shape[0], self.weight.shape[0]), dtype=np.float32)
        if len(rows) == 1:
            np.matmul(self.weight, rows[0], out=out[0])
        elif len(rows) < GEMM_ROWS:
            for start, block in self.blocks:
                for i, row in enumerate(rows):
                    np.matmul(block, row, out=out[i, start : start + len(block)])
        else:
            for start, block in self.blocks:
                np.matmul(rows, block.T, out=out[:, start : start + len(block)])
        if self.bias is not None:
            out += self.bias
        return out


def weight_blocks(weight: np.ndarray) -> tuple[tuple[int, np.ndarray], ...]:
    step = max(1, BLOCK_BYTES // (weight.shape[1] * weight.itemsize))
    return tuple((start, weight[start : start + step]) for start in range(0, len(weight), step))


class GemvLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        if self._gemv.wanted(x):
            return self._gemv.products(x)
        return super().__call__(x)


class GemvEmbedding(nn.Embedding):
    def as_linear(self, x: mx.array) -> mx.array:  # tied output heads
        if self._gemv.wanted(x):
            return self._gemv.products(x)
        return super().as_linear(x)


_SWAPS = {nn.Linear: GemvLinear, nn.Embedding: GemvEmbedding}


def _weight_view(array: mx.array) -> np.ndarray | None:
    if array.dtype != mx.float32:
        return None  # numpy has no bfloat16, and half products are slow there
    view = np.asarray(array)
    return view if view.flags.c_contiguous else None  # else numpy copies it every call


def use_gemv(model: nn.Module, max_rows: int) -> int:
    """Route products of at most `max_rows` rows in `model`'s float32 Linears (and tied
    embedding heads) to numpy; the weights must not be replaced afterwards. Returns how many
    modules were switched."""
    if max_rows <= 0:
        return 0
    switched = 0
    for _, module in model.named_modules():
        swap = _SWAPS.get(type(module))
        if swap is None:
            continue
        weight = _weight_view(module.weight)
        bias = module.get("bias")
        bias_view = None if bias is None else _weight_view(bias)
        if weight is None or (bias is not None and bias_view is None):
            continue
        module._gemv = GemvWeights(weight, bias_view, weight_blocks(weight), max_rows)
        module.__class__ = swap
        switched += 1
    return switched
