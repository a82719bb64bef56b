"""Verifier sessions shared by the tests of forwards over many sessions."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

PROMPTS = [[5 + (7 * i + j) % 90 for j in range(4 + 5 * i)] for i in range(5)]
CAPTURES = [(0, 1), (), (1,), (0, 1), (0,)]


def close(got, want) -> None:
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    assert got.shape == want.shape
    assert np.allclose(got, want, rtol=1e-3, atol=2e-3), np.abs(got - want).max()


def recorded(monkeypatch, target, method: str) -> list[list[int]]:
    """Rows per session of each call of the target's MLX forward `method`, as it runs."""
    calls: list[list[int]] = []
    real = getattr(type(target._mlx), method)

    def recording(self, segments, capture):
        calls.append([len(seg.token_ids) for seg in segments])
        return real(self, segments, capture)

    monkeypatch.setattr(type(target._mlx), method, recording)
    return calls
