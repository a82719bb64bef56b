"""Whole decode-sized forwards of a Llama-family model on numpy (CPU, float32).

With its weight products on numpy's gemv (specd.cpu.gemv), a one-token forward of
SmolLM2-135M still spent ~37 of its ~89 ms waiting on MLX: every product makes MLX evaluate
its input, ~4 small graphs per layer at ~35-170 us each. The rest of a layer (two RMSNorms,
RoPE, attention over the cache, SwiGLU) is little arithmetic per token, so forwards of a few
tokens run every layer here and write their keys and values straight into the buffers of the
model's own KV caches (MLX's update and evaluation per layer cost ~1 ms a sequence per
forward); draft trees come with their ancestor mask and depth positions. Bigger forwards and
other architectures stay in MLX. That rest runs in the compiled kernels where they were built
(numpy's dozen calls per part cost more than the arithmetic), else in numpy. docs/history,
entries of 2026-12-01.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import Llama3RoPE

from specd.cpu import PAIRED_COPIES_BYTES
from specd.cpu.gemv import GemvWeights, float32_view, paired, weight_view
from specd.cpu.half import move_weight
from specd.cpu.row_products import layer_kernels, pairs_supported

ROPE_BLOCK = 256  # positions per table of RoPE angles, made on first use
# numpy beat MLX at every size measured up to 32 tokens, and tied at 33 (benchmarks/step_floor.py;
# docs/history, 2026-12-01): a 16-token tree's verify is 17 tokens
DEFAULT_MAX_ROWS = 32


@dataclass(frozen=True)
class _Layer:
    input_norm: np.ndarray
    post_norm: np.ndarray
    qkv: GemvWeights  # q, k and v side by side: one product (`_joined`)
    o: GemvWeights
    gate_up: GemvWeights  # gate and up side by side
    down: GemvWeights


def _return_freed_memory() -> None:
    """Give freed buffers back to the system: MLX's cache, and glibc's heap, which keeps
    freed pages resident (joining a model's weights otherwise left ~100 MiB of them)."""
    mx.clear_cache()
    if _malloc_trim is not None:
        _malloc_trim(0)


def _find_malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc; other C libraries lack it
    except (AttributeError, OSError):
        return None


_malloc_trim = _find_malloc_trim()


def _joined(modules: list[nn.Module]) -> GemvWeights | None:
    """One product for gemv modules that share their input (q/k/v, gate/up): their weights
    moved into one buffer of which each module's weight, and its numpy view, is now a slice,
    so no memory is added. Each output sums as it did alone; a few rows' forward reads the
    layer in fewer, longer passes (~8 % less time for its products here, 1-4 rows)."""
    gemvs = [_gemv_of(m) for m in modules]
    if any(g is None for g in gemvs):
        return None
    bias = None  # the biases side by side too (a small copy), zeros for a module without
    if any(g.bias is not None for g in gemvs):
        bias = np.concatenate([
            g.bias if g.bias is not None else np.zeros(g.weight.shape[0], np.float32)
            for g in gemvs
        ])  # fmt: skip
    joined = mx.concatenate([m.weight for m in modules])
    mx.eval(joined)
    view = weight_view(joined)
    if view is None:
        return None
    start = 0
    for module, gemv in zip(modules, gemvs, strict=True):
        stop = start + module.weight.shape[0]
        move_weight(module, joined[start:stop])
        module._gemv = replace(gemv, weight=view[start:stop])
        start = stop
    return GemvWeights(view, bias, gemvs[0].max_rows)


def _products(layers: list[_Layer]) -> list[GemvWeights]:
    return [g for layer in layers for g in (layer.qkv, layer.o, layer.gate_up, layer.down)]


def _paired_within(
    layers: list[_Layer], head: GemvWeights, limit: int
) -> tuple[list[_Layer], GemvWeights]:
    """The layers' products and the head reading paired copies of their half weights, if the
    copies together take at most `limit` bytes (else all unchanged)."""
    if (
        sum(g.weight.nbytes for g in [*_products(layers), head] if g.weight.dtype == np.float16)
        > limit
    ):
        return layers, head
    layers = [
        replace(
            layer,
            qkv=paired(layer.qkv),
            o=paired(layer.o),
            gate_up=paired(layer.gate_up),
            down=paired(layer.down),
        )
        for layer in layers
    ]
    return layers, paired(head)


# RoPEs that turn each pair of features by an angle of its position alone
_PAIR_ROTATIONS = (nn.RoPE, Llama3RoPE)


def turns_pairs(rope: nn.Module) -> bool:
    """Whether RopeTables reproduces this RoPE: each feature pair turned by an angle of its
    position alone."""
    return type(rope) in _PAIR_ROTATIONS


def _rope_of(attn) -> nn.Module | None:
    rope = attn.rope
    rope = getattr(rope, "inner", rope)  # under specd.models.capture.GroupedRoPE
    return rope if turns_pairs(rope) else None


def _gemv_of(module) -> GemvWeights | None:
    return getattr(module, "_gemv", None)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder layers, unwrapped from specd.models.capture's CapturingLayer."""
    return [getattr(layer, "inner", layer) for layer in model.layers]


class RopeTables:
    """cos and sin of a pairwise RoPE at any positions, exactly as the MLX module turns them."""

    def __init__(self, rope: nn.Module):
        self.rope = rope
        self.dims, self.traditional = rope.dims, rope.traditional
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin [T, dims/2] at `positions`."""
        tables = [(self._block(p // ROPE_BLOCK), p % ROPE_BLOCK) for p in positions.tolist()]
        cos = np.stack([cos[i] for (cos, _), i in tables])
        sin = np.stack([sin[i] for (_, sin), i in tables])
        return cos, sin

    def _block(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        # Rotating (1, 0) pairs yields (cos, sin): MLX's own angles, which a numpy
        # recomputation misses by up to ~1e-5 rad at position 2000 (float32 rounding).
        if index not in self._blocks:
            half = self.dims // 2
            unit = np.zeros((ROPE_BLOCK, self.dims), dtype=np.float32)
            first_of_pair = slice(0, None, 2) if self.traditional else slice(0, half)
            second_of_pair = slice(1, None, 2) if self.traditional else slice(half, None)
            unit[:, first_of_pair] = 1.0
            with mx.stream(mx.cpu):  # host work: on a GPU it would queue behind the device's
                turned = self.rope(mx.array(unit)[None], offset=index * ROPE_BLOCK)[0]
                turned = np.array(turned)
            self._blocks[index] = (turned[:, first_of_pair], turned[:, second_of_pair])
        return self._blocks[index]


@dataclass
class Segment:
    """One sequence's part of a forward: new tokens at the end of its own cache."""

    token_ids: np.ndarray  # [T]
    cache: list  # its KVCache per layer
    positions: np.ndarray | None = None  # [T] RoPE positions (default: places in the cache)
    sees: np.ndarray | None = None  # [T, T] which new tokens each sees (default: causal)


class CpuLlama:
    """numpy forwards of at most `max_rows` tokens for an mlx-lm `llama` model whose products
    were switched to gemv; build with `CpuLlama.attach`, which says None when it cannot."""

    def __init__(self, layers, embed, final_norm, head, eps, heads, kv_heads, head_dim, rope):
        self.layers: list[_Layer] = layers
        self.embed: np.ndarray = embed
        self.final_norm: np.ndarray = final_norm
        self.head: GemvWeights = head
        self.eps = eps
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.rope = RopeTables(rope)
        self.max_rows = head.max_rows

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """The architecture this module runs: mlx-lm's `llama`, full attention, a RoPE that
        turns feature pairs by position alone, float32 weights."""
        args = getattr(model, "args", None)
        if getattr(model, "model_type", None) != "llama" or args is None:
            return False
        if any(t != "full_attention" for t in (args.layer_types or [])):
            return False
        blocks = _blocks(model)
        return bool(blocks) and all(
            _rope_of(b.self_attn) is not None
            and b.input_layernorm.weight.dtype == mx.float32
            and isinstance(b.self_attn.q_proj, nn.Linear)
            for b in blocks
        )

    @classmethod
    def attach(cls, model: nn.Module, paired_bytes: int = PAIRED_COPIES_BYTES) -> CpuLlama | None:
        """None unless `supports(model)` and its products were switched to gemv. Half weights
        get paired copies (specd.cpu.row_products.pair_rows) where the CPU allows and all of
        them together take at most `paired_bytes`."""
        if not cls.supports(model):
            return None
        args, blocks = model.args, _blocks(model)
        layers = []
        for block in blocks:
            attn, mlp = block.self_attn, block.mlp
            parts = [
                _gemv_of(m)
                for m in (
                    attn.q_proj,
                    attn.k_proj,
                    attn.v_proj,
                    attn.o_proj,
                    mlp.gate_proj,
                    mlp.up_proj,
                    mlp.down_proj,
                )
            ]
            norms = [
                float32_view(block.input_layernorm.weight),
                float32_view(block.post_attention_layernorm.weight),
            ]
            if any(p is None for p in parts) or any(n is None for n in norms):
                return None
            qkv = _joined([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up = _joined([mlp.gate_proj, mlp.up_proj])
            if qkv is None or gate_up is None:
                return None
            layers.append(_Layer(norms[0], norms[1], qkv, parts[3], gate_up, parts[6]))
            _return_freed_memory()  # the layer's weights before `_joined`
        inner = model.model
        embed = _gemv_of(inner.embed_tokens)
        head = embed if args.tie_word_embeddings else _gemv_of(getattr(model, "lm_head", None))
        final_norm = float32_view(inner.norm.weight)
        if embed is None or head is None or final_norm is None:
            return None
        layers, head = _paired_within(layers, head, paired_bytes)
        heads, kv_heads = args.num_attention_heads, args.num_key_value_heads
        head_dim = args.head_dim or args.hidden_size // heads
        norm_eps = blocks[0].input_layernorm.eps
        rope = _rope_of(blocks[0].self_attn)
        return cls(
            layers, embed.weight, final_norm, head, norm_eps, heads, kv_heads, head_dim, rope
        )

    def paired_bytes(self) -> int:
        """Bytes of the paired weight copies this holds beside the model's own."""
        return sum(g.paired.nbytes for g in self._all_products() if g.paired is not None)

    @property
    def rows_exact(self) -> bool:
        """Whether every row of a forward is the number a one-row forward gives it, however
        many rows run together: half weights on a CPU with the paired products (each row
        then sums as one row does, at any row count) and the compiled attention (each row's
        keys summed as one sequence). So a token's keys and values do not depend on how a
        prompt was cut into forwards."""
        return (
            layer_kernels() is not None
            and self.head_dim % 8 == 0  # else the numpy attention runs
            and pairs_supported()
            and all(g.weight.dtype == np.float16 for g in self._all_products())
        )

    def _all_products(self) -> list[GemvWeights]:
        return [*_products(self.layers), self.head]

    def can_run(self, tokens: int, cache: list) -> bool:
        return 0 < tokens <= self.max_rows and all(type(c) is KVCache for c in cache)

    def forward(
        self,
        token_ids: np.ndarray,
        cache: list,
        capture: frozenset[int],
        positions: np.ndarray | None = None,
        sees: np.ndarray | None = None,
        logits: bool = True,
    ) -> tuple[np.ndarray | None, dict[int, np.ndarray]]:
        """token_ids [T] appended at the cache end -> (logits [T, V], {layer: output [T, H]}).

        Each new token sees the whole cache and, among the new tokens, those `sees` [T, T]
        allows (default: itself and the ones before it); `positions` [T] are its RoPE
        positions (default: its place in the cache). Appends each layer's keys and values
        to its KVCache, as MLX's forward would. logits: False skips the output head (None in
        their place), as a prompt's chunks before its last token need no logits."""
        segment = Segment(token_ids, cache, positions, sees)
        return self.forward_many([segment], capture, logits)[0]

    def forward_many(
        self, segments: list[Segment], capture: frozenset[int], logits: bool = True
    ) -> list[tuple[np.ndarray | None, dict[int, np.ndarray]]]:
        """Several sequences' new tokens in one forward, each at the end of its own cache: the
        products and norms run over every row at once (a weight read once for all), RoPE by
        each row's position, attention over each sequence's own cache (in the compiled kernels
        one call a layer for all of them, their heads on the pool's threads)."""
        bounds = np.cumsum([0] + [len(s.token_ids) for s in segments])
        offsets = [s.cache[0].offset for s in segments]
        positions = np.concatenate(
            [
                np.arange(o, o + len(s.token_ids)) if s.positions is None else s.positions
                for s, o in zip(segments, offsets, strict=True)
            ]
        )
        sees = [
            np.tri(len(s.token_ids), dtype=bool)
            if s.sees is None
            else np.ascontiguousarray(s.sees, dtype=bool)
            for s in segments
        ]
        cos, sin = self.rope.at(positions)
        kernels = layer_kernels() if self.head_dim % 8 == 0 else None
        if kernels is not None:
            rms, heads = self._rms_compiled, self._heads_compiled
            attend, swiglu = self._attend_compiled, kernels.swiglu
        else:
            rms, heads, attend, swiglu = self._rms, self._heads, self._attend, _swiglu
        token_ids = np.concatenate([s.token_ids for s in segments])
        n = len(token_ids)
        q_end = self.heads * self.head_dim
        k_end = q_end + self.kv_heads * self.head_dim
        h = self.embed[token_ids].astype(np.float32, copy=False)  # [T, H]; a half table's rows
        captured: dict[int, np.ndarray] = {}
        try:
            # each layer's keys and values go straight into its cache's buffer, rows
            # [offset, offset + T): no MLX array, update or evaluation per layer and sequence
            buffers = [self._cache_buffers(s.cache, len(s.token_ids)) for s in segments]
            for i, layer in enumerate(self.layers):
                x = rms(h, layer.input_norm)
                qkv = layer.qkv.of_rows(x)
                q = heads(np.ascontiguousarray(qkv[:, :q_end]), self.heads, cos, sin)
                k = heads(np.ascontiguousarray(qkv[:, q_end:k_end]), self.kv_heads, cos, sin)
                v = qkv[:, k_end:].reshape(n, self.kv_heads, self.head_dim).transpose(1, 0, 2)
                keys, values = [own[i][0] for own in buffers], [own[i][1] for own in buffers]
                attended = attend(q, k, v, keys, values, offsets, bounds, sees)
                h = h + layer.o.of_rows(attended)
                x = rms(h, layer.post_norm)
                gate_up = layer.gate_up.of_rows(x)
                width = gate_up.shape[1] // 2
                gate = np.ascontiguousarray(gate_up[:, :width])
                swiglu(gate, np.ascontiguousarray(gate_up[:, width:]))
                h = h + layer.down.of_rows(gate)
                if i in capture:
                    captured[i] = h
            out = self.head.of_rows(rms(h, self.final_norm)) if logits else None
        except BaseException:
            for s, offset in zip(segments, offsets, strict=True):
                for layer_cache in s.cache:  # all layers as they were, so rollback trims alike
                    layer_cache.offset = min(layer_cache.offset, offset)
            raise
        for s in segments:
            for layer_cache in s.cache:
                layer_cache.offset += len(s.token_ids)
        spans = list(zip(bounds[:-1], bounds[1:], strict=True))
        return [
            (None if out is None else out[a:b], {i: rows[a:b] for i, rows in captured.items()})
            for a, b in spans
        ]

    def _cache_buffers(self, cache: list, tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Writable numpy views [kv, C, D] of each layer's key and value buffers, with room for
        `tokens` more rows; a buffer too small grows as KVCache.update_and_fetch grows it."""
        grown = []
        for c in cache:
            if c.keys is None or c.offset + tokens > c.keys.shape[2]:
                # MLX's own growth (zeros written, then not counted), so the buffers match its
                zeros = mx.zeros((1, self.kv_heads, tokens, self.head_dim), mx.float32)
                c.update_and_fetch(zeros, zeros)
                c.offset -= tokens
                grown.extend([c.keys, c.values])
        if grown:
            mx.eval(grown)
        views = []
        for c in cache:
            keys, values = np.asarray(c.keys)[0], np.asarray(c.values)[0]
            if not (keys.flags.carray and values.flags.carray):  # C-contiguous and writable
                # not a plain writable buffer: a contiguous copy of its own first
                c.keys = mx.array(np.ascontiguousarray(c.keys))
                c.values = mx.array(np.ascontiguousarray(c.values))
                keys, values = np.asarray(c.keys)[0], np.asarray(c.values)[0]
            views.append((keys, values))
        return views

    def _rms_compiled(self, h: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return rms_norm(h, weight, self.eps)

    def _rms(self, h: np.ndarray, weight: np.ndarray) -> np.ndarray:
        mean_square = np.mean(np.square(h), axis=-1, keepdims=True)
        return h * (1.0 / np.sqrt(mean_square + self.eps)) * weight

    def _heads_compiled(self, rows: np.ndarray, heads: int, cos, sin) -> np.ndarray:
        out = np.empty((heads, len(rows), self.head_dim), np.float32)
        layer_kernels().rope(rows, cos, sin, self.rope.traditional, out)
        return out

    def _heads(self, rows: np.ndarray, heads: int, cos, sin) -> np.ndarray:
        """[T, heads*D] -> [heads, T, D] with RoPE applied."""
        x = rows.reshape(len(rows), heads, self.head_dim).transpose(1, 0, 2)
        dims, half = self.rope.dims, self.rope.dims // 2
        out = x.copy()
        if self.rope.traditional:
            a, b = x[..., 0:dims:2], x[..., 1:dims:2]
            out[..., 0:dims:2] = a * cos - b * sin
            out[..., 1:dims:2] = a * sin + b * cos
        else:
            a, b = x[..., :half], x[..., half:dims]
            out[..., :half] = a * cos - b * sin
            out[..., half:dims] = a * sin + b * cos
        return out

    def _attend_compiled(self, q, k, v, keys, values, offsets, bounds, sees) -> np.ndarray:
        """As `_attend`, every sequence in one call of the compiled kernels."""
        out = np.empty((q.shape[1], self.heads * self.head_dim), np.float32)
        layer_kernels().attention_many(
            q, k, np.ascontiguousarray(v), keys, values, offsets, bounds.tolist(), sees,
            self.scale, out,
        )  # fmt: skip
        return out

    def _attend(self, q, k, v, keys, values, offsets, bounds, sees) -> np.ndarray:
        """Each sequence's new queries [heads, a:b, D] over its first `offset` cached rows
        ([kv, C, D] buffers) and its new rows -> [T, heads*D]; then its new keys and values
        written into the buffers after those rows."""
        parts = []
        for keys_of, values_of, offset, seen, a, b in zip(
            keys, values, offsets, sees, bounds[:-1], bounds[1:], strict=True
        ):
            new_k, new_v = k[:, a:b], v[:, a:b]
            if offset:
                new_k = np.concatenate([keys_of[:, :offset], new_k], axis=1)
                new_v = np.concatenate([values_of[:, :offset], new_v], axis=1)
            visible = np.concatenate([np.ones((len(seen), offset), dtype=bool), seen], axis=1)
            parts.append(attend_numpy(q[:, a:b] * self.scale, new_k, new_v, visible))
            keys_of[:, offset : offset + b - a] = k[:, a:b]
            values_of[:, offset : offset + b - a] = v[:, a:b]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def rms_norm(h: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """h / sqrt(mean(h^2) + eps) * weight, rows [T, H], in the compiled kernel."""
    out = np.empty_like(h)
    layer_kernels().rms_norm(h, weight, eps, out)
    return out


def attend_numpy(queries, keys, values, visible) -> np.ndarray:
    """Scaled queries [heads, T, D] over keys and values [kv, S, D], query t seeing key s where
    visible[t, s] -> [T, heads * D]."""
    heads, n, dim = queries.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    # query head j reads kv head j // group: a kv head's rows are its query heads' tokens
    scores = queries.reshape(kv_heads, group * n, dim) @ keys.transpose(0, 2, 1)
    scores[:, ~np.tile(visible, (group, 1))] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = (scores @ values).reshape(heads, n, dim)
    return np.ascontiguousarray(out.transpose(1, 0, 2)).reshape(n, heads * dim)


def _swiglu(gate: np.ndarray, up: np.ndarray) -> None:
    """gate = silu(gate) * up in place; the tanh form of the sigmoid cannot overflow."""
    gate *= 0.5 * (1.0 + np.tanh(0.5 * gate))
    gate *= up
