"""float32 weights kept as float16 where float16 holds every value exactly.

A model dequantized from a 4-bit or half checkpoint (the embedded SmolLM2 among them) has only
float16 values, so its float32 copy doubles the bytes a memory-bound decode step reads and the
memory it holds. These modules keep such weights as float16 and still compute in float32: MLX's
products convert the weight first and then transpose it, the same BLAS call, bit for bit, as
with a float32 copy; the embedding hands out float32 rows. The verifier's compiled products
(specd.models.row_products) read the float16 weights directly.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def exactly_half(weight: mx.array) -> mx.array | None:
    """float32 `weight` as float16 if every value survives the trip, else None."""
    if weight.dtype != mx.float32:
        return None
    half = weight.astype(mx.float16)
    if not mx.array_equal(half.astype(mx.float32), weight).item():
        return None
    mx.eval(half)
    return half


def float32_weight(module: nn.Module) -> mx.array:
    weight = module["weight"]
    return weight.astype(mx.float32) if weight.dtype == mx.float16 else weight


class HalfLinear(nn.Linear):
    """A float32 Linear whose weight is stored as float16 (or float32: then it is nn.Linear)."""

    def __call__(self, x: mx.array) -> mx.array:
        if "bias" in self:
            return mx.addmm(self["bias"], x, float32_weight(self).T)
        return x @ float32_weight(self).T


class HalfEmbedding(nn.Embedding):
    """A float32 Embedding whose table is stored as float16; also a tied output head."""

    def __call__(self, x: mx.array) -> mx.array:
        rows = self.weight[x]
        return rows.astype(mx.float32) if rows.dtype == mx.float16 else rows

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ float32_weight(self).T


_HALF = {nn.Linear: HalfLinear, nn.Embedding: HalfEmbedding}


def store_half(module: nn.Module) -> bool:
    """Keep a float32 Linear's or Embedding's weight as float16 if that loses nothing; the
    float32 copy is freed once nothing else holds it."""
    swap = _HALF.get(type(module))
    if swap is None or "weight" not in module:
        return False
    half = exactly_half(module.weight)
    if half is None:
        return False
    module.weight = half
    module.__class__ = swap
    return True


def stored_half_module(module: nn.Module) -> bool:
    return isinstance(module, (HalfLinear, HalfEmbedding)) and module.weight.dtype == mx.float16


def stored_half(model: nn.Module) -> int:
    """How many of `model`'s modules keep their weight as float16."""
    return sum(1 for _, m in model.named_modules() if stored_half_module(m))
