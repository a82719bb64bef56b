"""Sampled sessions' plain draws (a step without drafts, sampling by temperature alone) made
by MLX where the logits are: on a GPU a row copied to the host costs a wait for the device, and
the host's draw ~0.3 ms over a 49,152-token vocabulary (run BH, docs/gpu.md), so a step of 64
sampled sessions took ~50 ms; drawn on the device, the step's draws are a few operations over
its rows and one copy of a token a session. On a GPU every plain draw is made so (a prompt's
first token, a lone session's step, a shared step's), so a session draws alike wherever it
runs; a CPU draws on the host, where that is the faster (`engine._draws_on_device`).

The draw is `sampling.sample` on `sampling.target_distribution` for temperature alone, in
float32: the first token whose running sum passes the session's uniform times the total. The
uniform comes from the session's own generator, one a draw as the host's draw takes it. The
float32 running sum moves a boundary by up to ~5e-5 of the mass over 49,152 tokens (the host
sums in float64), so where the tokens there are rarer than that, a token that close in the
running sum can be drawn in its place: a distribution off by that much at most. Filters
(top-k, top-p, min-p) and verifies with drafts draw on the host."""

from __future__ import annotations

import mlx.core as mx

from verifier_svc.sampling import SamplingConfig


def drawable_on_device(cfg: SamplingConfig, vocab_size: int) -> bool:
    """Whether a step's draw for `cfg` is made on the device: sampled, no filter."""
    return (
        cfg.temperature > 0
        and not 0 < cfg.top_p < 1
        and cfg.min_p <= 0
        and not 0 < cfg.top_k < vocab_size
    )


def draw(logits: mx.array, temperatures: mx.array, uniforms: mx.array) -> mx.array:
    """logits [S, V], temperatures and uniforms in [0, 1) [S] -> one token a row [S] (int32):
    the first whose running sum of exp((logit - max) / temperature) passes its uniform times
    the row's total, never a token of probability 0."""
    shifted = logits.astype(mx.float32)
    shifted = (shifted - shifted.max(axis=-1, keepdims=True)) / temperatures[:, None]
    p = mx.exp(shifted)
    running = mx.cumsum(p, axis=-1)
    # the first token of any probability whose running sum passes (a parallel sum's rounding
    # could leave it flat or stepping back there); none: a uniform within rounding of 1
    passing = (running > (uniforms * running[:, -1])[:, None]) & (p > 0)
    first = mx.argmax(passing.astype(mx.int32), axis=-1).astype(mx.int32)
    positions = mx.arange(logits.shape[-1], dtype=mx.int32)
    last_positive = mx.max(mx.where(p > 0, positions, -1), axis=-1)
    return mx.where(passing.any(axis=-1), first, last_positive)
