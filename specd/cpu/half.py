"""float32 weights kept as float16 where float16 holds every value exactly.

A model dequantized from a 4-bit or half checkpoint (the embedded SmolLM2 among them) has only
float16 values, so its float32 copy doubles the bytes a memory-bound decode step reads and the
memory it holds. These modules keep such weights as float16 and still compute in float32: MLX's
products convert the weight first and then transpose it, the same BLAS call, bit for bit, as
with a float32 copy; the embedding hands out float32 rows. The verifier's compiled products
(specd.cpu.row_products) read the float16 weights directly.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from specd.cpu import FLOAT32_COPIES_BYTES


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
    """The module's weight as float32: the float32 copy `keep_float32_copies` made beside the
    float16 weight, where it made one (a prompt's prefill, compute-bound, then converts no
    weight per call), else the float16 weight converted at each product. The same values,
    the same BLAS call, either way."""
    weight = module["weight"]
    if weight.dtype != mx.float16:
        return weight
    kept = module.__dict__.get("_float32_copy")  # outside MLX's parameters
    if kept is None:
        return weight.astype(mx.float32)
    if kept[0] is not weight:  # the weight was replaced: so is its copy
        kept = _copy_of(module, weight)
    return kept[1]


def move_weight(module: nn.Module, weight: mx.array) -> None:
    """Give `module` `weight`, its own values in another buffer: a float32 copy made beside
    the old one stays (it would otherwise be remade, and hold the old buffer meanwhile)."""
    kept = module.__dict__.get("_float32_copy")
    module.weight = weight
    if kept is not None:
        module.__dict__["_float32_copy"] = (weight, kept[1])


def _copy_of(module: nn.Module, weight: mx.array) -> tuple[mx.array, mx.array]:
    kept = (weight, weight.astype(mx.float32))
    mx.eval(kept[1])
    module.__dict__["_float32_copy"] = kept
    return kept


class HalfLinear(nn.Linear):
    """A float32 Linear whose weight is stored as float16 (or float32: then it is nn.Linear)."""

    def __call__(self, x: mx.array) -> mx.array:
        weight = float32_weight(self)
        if "bias" in self:
            return mx.addmm(self["bias"], x, weight.T)
        return x @ weight.T


class HalfEmbedding(nn.Embedding):
    """A float32 Embedding whose table is stored as float16; also a tied output head."""

    def __call__(self, x: mx.array) -> mx.array:
        rows = self.weight[x]
        return rows.astype(mx.float32) if rows.dtype == mx.float16 else rows

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ float32_weight(self).T


_HALF = {nn.Linear: HalfLinear, nn.Embedding: HalfEmbedding}


def rebuilt(kind: type, module: nn.Module, weight: mx.array) -> nn.Module:
    """A `kind` module (a Linear or an Embedding class) holding `weight` and `module`'s bias;
    the constructor's random weight is lazy and never computed."""
    if issubclass(kind, nn.Embedding):
        new = kind(*weight.shape)
    else:
        new = kind(weight.shape[1], weight.shape[0], bias="bias" in module)
        if "bias" in module:
            new.bias = module.bias
    new.weight = weight
    if "_float32_copy" in module.__dict__:  # a model's copies outlive the module swap
        new.__dict__["_float32_copy"] = module.__dict__["_float32_copy"]
    return new


def replace_modules(model: nn.Module, make) -> int:
    """Put make(module) in place of each module below `model` it returns one for (None: keep
    the module); returns how many were replaced."""
    pairs = []
    for name, module in model.named_modules():
        new = make(module) if name else None  # the root has no parent to hold a new one
        if new is not None:
            pairs.append((name, new))
    if pairs:
        model.update_modules(tree_unflatten(pairs))
    return len(pairs)


def half_copy(module: nn.Module) -> nn.Module | None:
    """A float32 Linear or Embedding with its weight kept as float16, if that loses nothing;
    else None. The float32 copy is freed once nothing else holds it."""
    kind = _HALF.get(type(module))
    if kind is None or "weight" not in module:
        return None
    half = exactly_half(module.weight)
    return None if half is None else rebuilt(kind, module, half)


def store_half(model: nn.Module) -> int:
    """Keep every weight of `model` that float16 holds exactly as float16 (half_copy)."""
    return replace_modules(model, half_copy)


def keep_float32_copies(model: nn.Module, limit: int = FLOAT32_COPIES_BYTES) -> bool:
    """Give `model`'s half weights float32 copies for MLX's products when all of them
    together take at most `limit` bytes; True when they have them. The verifier's decode
    steps read the float16 weights in its own kernels all the same."""
    halves = [m for _, m in model.named_modules() if stored_half_module(m)]
    if 2 * sum(m.weight.nbytes for m in halves) > limit:
        return False
    for module in halves:  # now, not in a first request's prefill
        _copy_of(module, module.weight)
    return True


def float32_copy_bytes(model: nn.Module) -> int:
    """Bytes the float32 copies of `model`'s half weights take (`keep_float32_copies`)."""
    return sum(m.__dict__["_float32_copy"][1].nbytes
               for _, m in model.named_modules() if "_float32_copy" in m.__dict__)  # fmt: skip


def stored_half_module(module: nn.Module) -> bool:
    return isinstance(module, (HalfLinear, HalfEmbedding)) and module.weight.dtype == mx.float16


def stored_half(model: nn.Module) -> int:
    """How many of `model`'s modules keep their weight as float16."""
    return sum(1 for _, m in model.named_modules() if stored_half_module(m))
