"""Keep chosen decoder-layer outputs of an mlx-lm model during its forward pass."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from specd.models.rowwise import ChunkedAttention, RowLinear, RowMLP


class CaptureSink:
    """Shared by the wrapped layers: what to keep, and overrides for one tree forward."""

    def __init__(self):
        self.wanted: frozenset[int] = frozenset()
        self.outputs: dict[int, mx.array] = {}
        self.mask: mx.array | None = None  # replaces the model's causal mask
        self.rope_positions: list[int] | None = None  # a tree forward's position per token


class CapturingLayer(nn.Module):
    """Wraps a decoder layer and keeps its output when its index is wanted."""

    def __init__(self, inner: nn.Module, index: int, sink: CaptureSink):
        super().__init__()
        self.inner = inner
        self._index = index
        self._sink = sink

    def __getattr__(self, key):
        # model code reads layer attributes (e.g. `use_sliding`): answer for the wrapped layer
        try:
            return super().__getattr__(key)
        except AttributeError:
            if "inner" not in self:  # during __init__, before the layer is set
                raise
            return getattr(self["inner"], key)

    def __call__(self, x, *args, **kwargs):
        if self._sink.mask is not None:
            if args:
                args = (self._sink.mask, *args[1:])
            else:
                kwargs["mask"] = self._sink.mask
        out = self.inner(x, *args, **kwargs)
        if self._index in self._sink.wanted:
            self._sink.outputs[self._index] = out
        return out


def install_capture(model: nn.Module) -> CaptureSink:
    """Wrap every decoder layer of `model` once; return the sink that says which to keep."""
    layers = model.layers
    if layers and isinstance(layers[0], CapturingLayer):
        return layers[0]._sink
    sink = CaptureSink()
    for i, layer in enumerate(layers):
        layers[i] = CapturingLayer(layer, i, sink)
    return sink


class GroupedRoPE(nn.Module):
    """Wraps a layer's RoPE: in a tree forward, runs of tokens share a position (their depth),
    each run rotated by the same kernel as plain decoding at that offset."""

    def __init__(self, inner: nn.Module, sink: CaptureSink):
        super().__init__()
        self.inner = inner
        self._sink = sink

    def __call__(self, x, offset=0):
        positions = self._sink.rope_positions
        if positions is None:
            return self.inner(x, offset=offset)
        return rotate_at(self.inner, x, positions)


def rotate_at(rope: nn.Module, x: mx.array, positions) -> mx.array:
    """x [..., T, D], token t rotated by `rope` at positions[t]: the tokens sharing a position
    in one call at that offset, as plain decoding rotates a token there. Positions in any
    order; where they do not already rise in runs (a tree listed depth-first), the tokens are
    gathered into runs and put back, a gather each way."""
    positions = np.asarray(positions)
    order = np.argsort(positions, kind="stable")
    in_runs = bool((order == np.arange(len(order))).all())
    if not in_runs:
        x = mx.take(x, mx.array(order.astype(np.int32)), axis=-2)
    ranked = positions[order]
    starts = [0, *(np.flatnonzero(ranked[1:] != ranked[:-1]) + 1).tolist(), len(ranked)]
    parts = []
    for a, b in zip(starts[:-1], starts[1:], strict=True):
        # RoPE numbers tokens offset, offset+1, ...: put a run's tokens in the batch axis
        # so each one is a length-1 sequence at its position
        run = x[..., a:b, :]
        lead, n, dim = run.shape[:-2], b - a, run.shape[-1]
        flat = mx.moveaxis(run, -2, 0).reshape(n, -1, 1, dim)
        turned = rope(flat, offset=int(ranked[a])).reshape(n, *lead, dim)
        parts.append(mx.moveaxis(turned, 0, -2))
    out = mx.concatenate(parts, axis=-2) if len(parts) > 1 else parts[0]
    if in_runs:
        return out
    return mx.take(out, mx.array(np.argsort(order).astype(np.int32)), axis=-2)


def install_tree_positions(model: nn.Module, sink: CaptureSink) -> bool:
    """Wrap every layer's RoPE once; False when the architecture has none we can wrap."""
    attns = []
    for layer in model.layers:
        inner = layer.inner if isinstance(layer, CapturingLayer) else layer
        attn = getattr(inner, "self_attn", None)
        if isinstance(attn, ChunkedAttention):
            attn = attn.inner
        if attn is None or not hasattr(attn, "rope"):
            return False
        attns.append(attn)
    for attn in attns:
        if not isinstance(attn.rope, GroupedRoPE):
            attn.rope = GroupedRoPE(attn.rope, sink)
    return True


class Bypass:
    """Takes the wrappers (capture, tree RoPE, row-by-row) out of a model's forward and puts
    them back. A one-token forward that verifies no tree needs none of them but the capture of
    the layers it keeps, and on a launch-bound GPU their Python calls (about ten a layer) are
    host time each decode step waits for (benchmarks/graph_build.py). The switch is sticky, so
    a run of decode steps pays it once; wrappers are installed only with them in (`wrapped`)."""

    WRAPPERS = (CapturingLayer, GroupedRoPE, RowLinear, ChunkedAttention, RowMLP)

    def __init__(self, model: nn.Module):
        self._model = model
        self._slots: list | None = None  # (parent, key, wrapper); found at the first switch
        self._state: tuple[bool, frozenset[int]] = (False, frozenset())

    @property
    def bare(self) -> bool:
        return self._state[0]

    def set(self, bare: bool, keep: frozenset[int] = frozenset()) -> None:
        """bare: every wrapper out but the capture of the layers in `keep`; else all in."""
        state = (bare, keep if bare else frozenset())
        if state == self._state:
            return
        if self._slots is None:
            self._slots = self._find()
        for parent, key, wrapper in self._slots:
            stays = not bare or (isinstance(wrapper, CapturingLayer) and wrapper._index in keep)
            parent[key] = wrapper if stays else wrapper.inner
        self._state = state

    def wrapped(self) -> None:
        """Put the wrappers back, for a caller about to install more (found again later)."""
        self.set(False)
        self._slots = None

    def _find(self) -> list:
        slots = []

        def visit(parent, key, child) -> None:
            if isinstance(child, self.WRAPPERS):
                slots.append((parent, key, child))
                child = child.inner  # a wrapper's parent is never a wrapper: swaps commute
            if isinstance(child, nn.Module):
                for name, value in child.items():
                    if isinstance(value, (nn.Module, list)):
                        visit(child, name, value)
            elif isinstance(child, list):
                for index, value in enumerate(child):
                    visit(child, index, value)

        visit(None, None, self._model)  # the model itself is never a wrapper
        return slots
