"""Keys and values of a drafter's committed context: one buffer per layer, numpy or MLX,
grown a step at a time along the entry axis (-2) instead of a concatenation per call."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

KV_STEP = 256  # entries added at a time when a buffer is full


def _zeros(like, shape: tuple[int, ...]):
    if isinstance(like, np.ndarray):
        return np.zeros(shape, like.dtype)
    return mx.zeros(shape, dtype=like.dtype)


@dataclass
class EntryBuffers:
    """Per layer [keys, values] with entries along axis -2. Rows past `entries` are scratch: a
    proposal may write its drafted entries there, and the next commit overwrites them."""

    layers: list[list] | None = None
    entries: int = 0

    @property
    def capacity(self) -> int:
        return 0 if self.layers is None else self.layers[0][0].shape[-2]

    def reserve(self, more: int, like: list[tuple]) -> None:
        """Room for `more` entries past the committed ones. like: per layer (keys, values)
        arrays giving the buffers' kind, dtype and every dimension but the entry axis."""
        if self.entries + more <= self.capacity:
            return
        capacity = -(-(self.entries + more) // KV_STEP) * KV_STEP
        grown = []
        for i, pair in enumerate(like):
            new_pair = []
            for j, a in enumerate(pair):
                buf = _zeros(a, (*a.shape[:-2], capacity, a.shape[-1]))
                if self.layers is not None:
                    buf[..., : self.entries, :] = self.layers[i][j][..., : self.entries, :]
                new_pair.append(buf)
            grown.append(new_pair)
        self.layers = grown

    def append(self, kvs: list[tuple]) -> None:
        """Commit per layer (keys, values) of n new entries after the committed ones."""
        n = kvs[0][0].shape[-2]
        self.reserve(n, kvs)
        for (kb, vb), (k, v) in zip(self.layers, kvs, strict=True):
            kb[..., self.entries : self.entries + n, :] = k
            vb[..., self.entries : self.entries + n, :] = v
        self.entries += n

    def committed(self) -> list[tuple]:
        """Per layer (keys, values) of the committed entries (views)."""
        if self.layers is None:
            return []
        return [(k[..., : self.entries, :], v[..., : self.entries, :]) for k, v in self.layers]
