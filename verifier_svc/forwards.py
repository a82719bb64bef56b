"""The one seam for the target's forwards: `Forward` and its two backends.

A backend appends `token_ids` [T] at the end of `cache` and returns (logits [T, V], the captured
layers' outputs [T, L*H] or None); a tree verify passes its layout. `Target` chooses its
backends once, when it is built, in order of preference, and each call takes the first that
fits: on a CPU with a float32 Llama-family target the CPU kernels for forwards of a few tokens,
MLX for the rest; on a GPU forwards of 1-16 tokens with the work between attentions compiled
(`CompiledMlxForward`), MLX for the rest; everywhere else MLX alone.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

from specd.cpu.llama import CpuLlama, Segment
from specd.models.capture import (
    Bypass,
    CaptureSink,
    CapturingLayer,
    GroupedRoPE,
    rotate_at,
)
from specd.models.compiled import MAX_POOLED_ROWS, CompiledForward, sees_after, traced_rows
from specd.models.compiled import MAX_ROWS as COMPILED_MAX_ROWS
from specd.models.rowwise import ChunkedAttention
from verifier_svc.kv_pool import PooledStep, attend_rows, batched_attention, spare_position
from verifier_svc.tree import ancestor_mask, depths


@dataclass(frozen=True)
class TreeLayout:
    """A draft tree after the cache's `base` tokens: [root, drafts...], each draft's parent."""

    parents: list[int]
    base: int

    def positions(self) -> np.ndarray:
        return np.array([self.base, *[self.base + d for d in depths(self.parents)]])

    def sees(self) -> np.ndarray:
        """[T, T] bool: a node attends to itself and its ancestors only."""
        return ancestor_mask(self.parents)

    def attention_mask(self) -> mx.array:
        """[T, base + T] bool: every node sees the whole cache, and among the nodes itself and
        its ancestors."""
        return mx.array(sees_after(self.sees(), self.base))


class Forward(Protocol):
    queues: bool  # the forward is a graph the device runs while Python goes on

    def fits(self, tokens: int, cache: list) -> bool: ...

    def __call__(
        self, token_ids: mx.array, cache: list, capture: tuple[int, ...], tree: TreeLayout | None
    ) -> tuple[mx.array, mx.array | None]: ...


class MlxForward:
    """The model's own forward in MLX (verifies of a few tokens row by row where
    `specd.models.rowwise` is installed); the capture sink keeps the wanted layers' outputs and
    carries a tree's mask and positions into the layers."""

    queues = True

    def __init__(self, model: nn.Module, sink: CaptureSink):
        self.model, self.sink = model, sink
        self.bypass = Bypass(model)
        # pooled batches of up to MAX_POOLED_ROWS rows with the work between attentions
        # compiled (the verifier's --compiled-pooled); None: the model's own modules
        self.compiled_pooled: CompiledForward | None = None

    def fits(self, tokens: int, cache: list) -> bool:
        return True

    def __call__(self, token_ids, cache, capture, tree=None):
        # a decode step runs the model's own modules, wrapped only where it keeps rows
        self.bypass.set(token_ids.size == 1 and tree is None, frozenset(capture))
        sink = self.sink
        if tree is not None:
            sink.mask = tree.attention_mask()
            sink.rope_positions = tree.positions().tolist()
        sink.wanted, sink.outputs = frozenset(capture), {}
        try:
            logits = self.model(token_ids[None], cache=cache)[0]
            rows = None
            if capture:
                rows = mx.concatenate([sink.outputs[i][0] for i in capture], axis=-1)
        finally:
            sink.wanted, sink.outputs = frozenset(), {}
            sink.mask, sink.rope_positions = None, None
        return logits, rows

    def layer_by_layer(self, token_ids, cache, capture):
        """The forward of `token_ids` for their KV and captured rows alone (no logits), one
        decoder layer per step: a generator that evaluates a layer each `next()` and returns
        the rows (or None). The same kernels on the same shapes as `__call__`, so the same
        numbers. Other forwards may run between steps (and swap wrappers, reset the sink): this
        holds its own list of the bare layers and keeps the wanted outputs itself.
        Llama-family models (mlx-lm's `llama` module) only: see `slices_layers`."""
        inner = self.model.model
        layers = [layer.inner if isinstance(layer, CapturingLayer) else layer
                  for layer in inner.layers]  # fmt: skip
        hidden = inner.embed_tokens(token_ids[None])
        # as mlx-lm's LlamaModel makes its masks (older versions have no sliding layers)
        masks = {False: create_attention_mask(hidden, cache[getattr(inner, "fa_idx", 0)])}
        if getattr(inner, "swa_idx", None) is not None:
            masks[True] = create_attention_mask(
                hidden, cache[inner.swa_idx], window_size=inner.sliding_window
            )
        kept = {}
        for index, (layer, layer_cache) in enumerate(zip(layers, cache, strict=True)):
            mask = masks[bool(getattr(layer, "use_sliding", False))]
            hidden = layer(hidden, mask, cache=layer_cache)
            if index in capture:
                kept[index] = hidden[0]
            mx.eval(hidden, *layer_cache.state)
            yield
        return mx.concatenate([kept[i] for i in capture], axis=-1) if capture else None

    def slices_layers(self) -> bool:
        return type(self.model.model).__module__ == "mlx_lm.models.llama"

    def takes_many(self) -> bool:
        """Whether `forward_many` covers the model: mlx-lm's Llama, no sliding-window layers."""
        return self.slices_layers() and getattr(self.model.model, "swa_idx", None) is None

    def forward_many(
        self, segments: list[Segment], capture: frozenset[int]
    ) -> list[tuple[mx.array, dict[int, mx.array]]]:
        """Several sessions' new tokens in one MLX graph, each at the end of its own cache:
        the norms, products and MLP over every row at once (a decode step's launches shared
        by the sessions), RoPE, the cache update and attention per session, and the logits
        per session with the shapes it has alone. A draft tree's nodes (a segment with
        positions and a mask) are rotated and attended as `__call__` does them alone. Lazy: the
        caller's one evaluation of the greedy choices runs it. `takes_many` models only."""
        self.bypass.set(False)  # products of a few rows through the row-by-row wrappers
        inner = self.model.model
        spans = np.cumsum([0] + [len(s.token_ids) for s in segments]).tolist()
        ids = mx.array(np.concatenate([s.token_ids for s in segments]), dtype=mx.int32)
        hidden = inner.embed_tokens(ids[None])
        kept: dict[int, mx.array] = {}
        for index, layer in enumerate(inner.layers):
            layer = layer.inner if isinstance(layer, CapturingLayer) else layer
            hidden = hidden + _attention_many(layer.self_attn, layer.input_layernorm(hidden),
                                              spans, segments, index)  # fmt: skip
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            if index in capture:
                kept[index] = hidden[0]
        final = inner.norm(hidden)
        out = []
        for a, b in itertools.pairwise(spans):
            part = final[:, a:b]
            if self.model.args.tie_word_embeddings:
                logits = inner.embed_tokens.as_linear(part)
            else:
                logits = self.model.lm_head(part)
            out.append((logits[0], {i: rows[a:b] for i, rows in kept.items()}))
        return out

    def forward_pooled(
        self, segments: list[Segment], capture: frozenset[int]
    ) -> list[tuple[mx.array, dict[int, mx.array]]]:
        """Several pooled sessions' new tokens (verifier_svc.kv_pool) as one batch: [B, T]
        where every session brings T, else the real rows alone [1, N] for the products and a
        grid padded to the longest for attention (`RaggedRows`); attention through the pool
        with a mask per session, so the operations per layer do not grow with the sessions.
        Advances each cache's offset by its real rows; a draft tree's rows at their depths,
        each seeing its ancestors. Lazy, as `forward_many`. With `compiled_pooled`, batches
        of up to its row limit run there (`_compiled_pooled`)."""
        lengths = np.array([len(s.token_ids) for s in segments])
        if self.compiled_pooled is not None and int(lengths.sum()) <= MAX_POOLED_ROWS:
            return self._compiled_pooled(segments, capture, lengths)
        self.bypass.set(False)
        inner = self.model.model
        tokens = int(lengths.max())
        trees = _trees(segments)
        step = PooledStep.of([s.cache[0] for s in segments], tokens, trees, lengths)
        ragged = step.ragged is not None
        if ragged:
            ids = np.concatenate([s.token_ids for s in segments]).astype(np.int32)[None]
        else:
            ids = np.stack([s.token_ids for s in segments]).astype(np.int32)
        pool = segments[0].cache[0].pool
        pool.reserve(int(step.offsets.max()) + tokens)
        hidden = inner.embed_tokens(mx.array(ids))
        kept: dict[int, mx.array] = {}
        for index, layer in enumerate(inner.layers):
            layer = layer.inner if isinstance(layer, CapturingLayer) else layer
            attn = layer.self_attn
            own = attn.inner if isinstance(attn, ChunkedAttention) else attn
            x = layer.input_layernorm(hidden)
            hidden = hidden + batched_attention(own, x, pool, index, step)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
            if index in capture:
                kept[index] = hidden
        _advance(segments, lengths)
        final = inner.norm(hidden)
        if self.model.args.tie_word_embeddings:
            logits = inner.embed_tokens.as_linear(final)
        else:
            logits = self.model.lm_head(final)
        if ragged:
            return _per_session(logits[0], {i: rows[0] for i, rows in kept.items()}, lengths)
        return SessionOutputs(
            [(logits[b], {i: rows[b] for i, rows in kept.items()}) for b in range(len(lengths))],
            logits.reshape(-1, logits.shape[-1]),
        )

    def _compiled_pooled(
        self, segments: list[Segment], capture: frozenset[int], lengths: np.ndarray
    ) -> list[tuple[mx.array, dict[int, mx.array]]]:
        """`forward_pooled` through `CompiledForward.forward_rows`: every batch ragged, its
        rows padded to a traced count (the spare rows write where nothing reads), the work
        between attentions one compiled call a layer, attention through the pool as
        `attend_rows` does it. The same kernels on the same rows as the model's own modules
        but for the joined q/k/v and gate/up products."""
        compiled = self.compiled_pooled
        real = int(lengths.sum())
        rows = traced_rows(real)
        trees = _trees(segments)
        caches = [s.cache[0] for s in segments]
        tokens = int(lengths.max())
        step = PooledStep.of(caches, tokens, trees, lengths, rows - real, compiled.pool_kernel)
        pool = caches[0].pool
        # the attention grid spans the furthest offset plus the longest rows; the spare rows
        # write at their own position
        grid_end = int(step.offsets.max()) + tokens
        pool.reserve(max(grid_end, spare_position(step.offsets, lengths) + 1))
        ids = np.zeros(rows, np.int32)
        ids[:real] = np.concatenate([s.token_ids for s in segments])
        scale = compiled.shape.scale

        def attend(layer: int, queries, keys, values):
            return attend_rows(scale, pool, step, layer, queries, keys, values)

        logits, kept = compiled.forward_rows(mx.array(ids), step.ragged.positions, attend,
                                             capture)  # fmt: skip
        _advance(segments, lengths)
        return _per_session(logits, kept, lengths)


def _trees(segments: list[Segment]) -> list:
    """Per segment None (rows in a causal line) or its draft tree's (positions, sees)."""
    return [None if s.sees is None else (s.positions, s.sees) for s in segments]


def _advance(segments: list[Segment], lengths: np.ndarray) -> None:
    """Each pooled cache's offset past its segment's rows, once the batch's writes are made."""
    for s, n in zip(segments, lengths, strict=True):
        for c in s.cache:
            c.offset += int(n)


class SessionOutputs(list):
    """A pooled forward's (logits, captured rows) per session, in the sessions' order, with
    the logits of all its rows at once (`every_logits` [N, V], padding rows after the
    sessions'): a step's greedy choices then take a few operations, not a few per session."""

    def __init__(self, outputs: list, every_logits: mx.array):
        super().__init__(outputs)
        self.every_logits = every_logits


def _per_session(logits: mx.array, kept: dict[int, mx.array], lengths: np.ndarray):
    """Rows [N, ...] of sessions bringing `lengths` rows each, session by session."""
    spans = itertools.pairwise(np.cumsum([0, *lengths.tolist()]).tolist())
    return SessionOutputs(
        [(logits[a:b], {i: rows[a:b] for i, rows in kept.items()}) for a, b in spans], logits
    )


def _attention_many(
    attn: nn.Module, x: mx.array, spans: list[int], segments: list[Segment], layer: int
) -> mx.array:
    """A Llama attention over [1, rows, H] holding several sessions' rows (spans), each session
    rotated at its own offset (a tree's nodes at their depths) and attending to its own cache
    (a tree's nodes to their ancestors), as it would alone."""
    own = attn.inner if isinstance(attn, ChunkedAttention) else attn
    rope = own.rope.inner if isinstance(own.rope, GroupedRoPE) else own.rope
    queries, keys, values = own.q_proj(x), own.k_proj(x), own.v_proj(x)
    parts = []
    for (a, b), segment in zip(itertools.pairwise(spans), segments, strict=True):
        rows, cache = b - a, segment.cache[layer]
        q = queries[:, a:b].reshape(1, rows, own.n_heads, -1).transpose(0, 2, 1, 3)
        k = keys[:, a:b].reshape(1, rows, own.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = values[:, a:b].reshape(1, rows, own.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if segment.positions is None:
            q, k = rope(q, offset=cache.offset), rope(k, offset=cache.offset)
        else:
            q = rotate_at(rope, q, segment.positions)
            k = rotate_at(rope, k, segment.positions)
        past = cache.offset
        k, v = cache.update_and_fetch(k, v)
        if segment.sees is not None:  # a tree, as `MlxForward.__call__` attends it
            mask = mx.array(sees_after(segment.sees, past))
            out = scaled_dot_product_attention(q, k, v, cache=cache, scale=own.scale, mask=mask)
        elif isinstance(attn, ChunkedAttention) and attn.chunks(rows):
            out = attn.attend(q, k, v, rows)
        else:  # as the model's own attention calls it
            mask = "causal" if rows > 1 else None
            out = scaled_dot_product_attention(q, k, v, cache=cache, scale=own.scale, mask=mask)
        parts.append(out.transpose(0, 2, 1, 3).reshape(1, rows, -1))
    return own.o_proj(mx.concatenate(parts, axis=1) if len(parts) > 1 else parts[0])


class CompiledMlxForward:
    """Forwards of 1-16 tokens at the end of mlx-lm KV caches with the work between two
    attentions compiled (specd.models.compiled): each row on a decode step's kernels, so on
    CUDA the decode steps' numbers bit for bit, built by Python in a fraction of the time.
    A draft tree's nodes run as rows at their depths with one masked attention a layer."""

    queues = True

    def __init__(self, compiled: CompiledForward):
        self.compiled = compiled

    def fits(self, tokens: int, cache: list) -> bool:
        return 1 <= tokens <= COMPILED_MAX_ROWS and all(type(c) is KVCache for c in cache)

    def __call__(self, token_ids, cache, capture, tree=None):
        if tree is None:
            logits, kept = self.compiled.forward(token_ids, cache, frozenset(capture))
        else:
            positions = mx.array(tree.positions(), dtype=mx.int32)
            logits, kept = self.compiled.forward_tree(token_ids, cache, positions, tree.sees(),
                                                      frozenset(capture))  # fmt: skip
        rows = mx.concatenate([kept[i] for i in capture], axis=-1) if capture else None
        return logits, rows


class CpuKernelForward:
    """Forwards of a few tokens on specd's CPU kernels: whole Llama layers on numpy and the
    compiled row products (`specd.cpu.llama`), computed before they return."""

    queues = False

    def __init__(self, layers: CpuLlama):
        self.layers = layers

    def fits(self, tokens: int, cache: list) -> bool:
        return self.layers.can_run(tokens, cache)

    def __call__(self, token_ids, cache, capture, tree=None):
        positions = sees = None
        if tree is not None:
            positions, sees = tree.positions(), tree.sees()
        logits, outputs = self.layers.forward(
            np.asarray(token_ids), cache, frozenset(capture), positions, sees
        )
        return mx.array(logits), _captured_rows(outputs, capture)

    def rows_only(self, token_ids, cache, capture) -> mx.array | None:
        """The forward without its output head: a prompt's chunks before its last token need
        only their KV and captured rows, and the head is a fifth of the embedded model."""
        _, outputs = self.layers.forward(np.asarray(token_ids), cache, frozenset(capture),
                                         logits=False)  # fmt: skip
        return _captured_rows(outputs, capture)


def _captured_rows(outputs: dict[int, np.ndarray], capture) -> mx.array | None:
    """The captured layers' outputs side by side [T, L*H], or None where none are captured."""
    if not capture:
        return None
    return mx.array(np.concatenate([outputs[i] for i in capture], axis=-1))
