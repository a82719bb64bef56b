"""Keep chosen decoder-layer outputs of an mlx-lm model during its forward pass."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class CaptureSink:
    def __init__(self):
        self.wanted: frozenset[int] = frozenset()
        self.outputs: dict[int, mx.array] = {}


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

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
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
