"""A Llama-family forward whose work between two attentions runs as one compiled function.

On a GPU a forward of the embedded model is bound by the host: Python builds ~60 operations a
layer for a verify of a few rows, ~6 µs each, and the device launches each (docs/gpu.md, run
AD). Here everything from one layer's attention output to the next layer's rotated queries and
keys (output product, residual, norm, MLP, residual, norm, q/k/v product, RoPE) is one function
under `mx.compile`, traced once per row count and reused for every layer: Python builds one call
and a few attention operations a layer, and the device runs the fused elementwise kernels.

The same primitives run as in mlx-lm's forward, in the same order: one row through MLX's
matrix-vector product, 2..16 rows through the few-row kernel (specd.models.few_rows) where it
runs, attention of 2..16 rows in one launch of specd.models.row_attention where it runs, else
through `specd.models.rowwise.chunk_bounds`' chunks. On an H200 a forward of
1-16 tokens equals mlx-lm's decode steps bit for bit, and a decode step is built in ~1 ms
instead of ~2.2 (benchmarks/gpu_forwards.py, variant `compiled`; docs/gpu.md, run AE). On a
CPU the joined q/k/v and gate/up products may go to another BLAS kernel than separate ones,
so there the numbers are the model's up to float32 rounding.

Only mlx-lm's Llama models with plain weights and no biases take this path (`supports`); the
KV cache is mlx-lm's own, so trimming and rollback are unchanged.
"""

from __future__ import annotations

import logging
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.activations import swiglu

from specd.models import few_rows, pool_attention, row_attention
from specd.models.capture import Bypass
from specd.models.rowwise import Joined, chunk_bounds
from specd.options import GPU_MODES

log = logging.getLogger(__name__)

MAX_ROWS = few_rows.MAX_ROWS  # beyond, the model's own forward (a prefill)


def _product(x: mx.array, weight: mx.array) -> mx.array:
    """x [rows, K] times weight [N, K] transposed, as the model's Linear or the few-row kernel."""
    rows = x.shape[0]
    if rows > 1 and few_rows.runs_here() and few_rows.fits(rows, x, weight):
        return few_rows.product(x, weight)
    return x @ weight.T


class _Shape:
    """The attention's geometry, fixed for the model (static in every trace)."""

    def __init__(self, attn: nn.Module, eps: float):
        self.heads = attn.n_heads
        self.kv_heads = attn.n_kv_heads
        self.head_dim = _bare(attn.q_proj).weight.shape[0] // attn.n_heads
        self.eps = eps
        self.rope = attn.rope
        self.scale = attn.scale


def _rotated(shape: _Shape, x, offset, norm_w, qkv_w):
    """The next layer's rotated queries and keys, and its values, from its input x [rows, H]."""
    rows = x.shape[0]
    qkv = _product(mx.fast.rms_norm(x, norm_w, shape.eps), qkv_w)
    nq = shape.heads * shape.head_dim
    nk = shape.kv_heads * shape.head_dim
    q = qkv[:, :nq].reshape(1, rows, shape.heads, -1).transpose(0, 2, 1, 3)
    k = qkv[:, nq : nq + nk].reshape(1, rows, shape.kv_heads, -1).transpose(0, 2, 1, 3)
    v = qkv[:, nq + nk :].reshape(1, rows, shape.kv_heads, -1).transpose(0, 2, 1, 3)
    return shape.rope(q, offset=offset), shape.rope(k, offset=offset), v


def _rotated_rows(shape: _Shape, x, positions, norm_w, qkv_w):
    """`_rotated` for rows each at its own position (rows of many sequences): queries
    [rows, heads, 1, D], keys and values [rows, kv_heads, 1, D], row r rotated at positions[r]."""
    rows = x.shape[0]
    qkv = _product(mx.fast.rms_norm(x, norm_w, shape.eps), qkv_w)
    nq = shape.heads * shape.head_dim
    nk = shape.kv_heads * shape.head_dim
    q = qkv[:, :nq].reshape(rows, shape.heads, 1, -1)
    k = qkv[:, nq : nq + nk].reshape(rows, shape.kv_heads, 1, -1)
    v = qkv[:, nq + nk :].reshape(rows, shape.kv_heads, 1, -1)
    return shape.rope(q, offset=positions), shape.rope(k, offset=positions), v


def _finish_layer(shape: _Shape, h, attn_parts, o_w, post_w, gate_up_w, down_w):
    """h after a layer, given its attention output in chunks [1, heads, chunk, D]."""
    attn = attn_parts[0] if len(attn_parts) == 1 else mx.concatenate(attn_parts, axis=2)
    rows = h.shape[0]
    flat = attn.transpose(0, 2, 1, 3).reshape(rows, -1)
    return _finish_rows(shape, h, flat, o_w, post_w, gate_up_w, down_w)


def _finish_rows(shape: _Shape, h, attn, o_w, post_w, gate_up_w, down_w):
    """h after a layer, given its attention output [rows, heads * D]."""
    h = h + _product(attn, o_w)
    gate_up = _product(mx.fast.rms_norm(h, post_w, shape.eps), gate_up_w)
    width = gate_up.shape[-1] // 2
    return h + _product(swiglu(gate_up[:, :width], gate_up[:, width:]), down_w)


class CompiledForward:
    """Forwards of 1..MAX_ROWS new tokens of one sequence at the end of mlx-lm KV caches, with
    the decoder layers' outputs wanted by a caller (an EAGLE-3 head's rows). The model's
    wrappers (capture, row by row) are looked through: this reads their weights."""

    def __init__(
        self, model: nn.Module, one_launch_attention: bool = True, pool_kernel: str = "off"
    ):
        """pool_kernel: auto, on or off: pooled batches' rows attend in
        specd.models.pool_attention's one launch (auto: where it runs, on a CUDA GPU with a
        float32 target; on: a warning where it cannot)."""
        self.model = model
        inner = model.model
        self.layers = inner.layers  # what mlx-lm's make_prompt_cache counts
        self.embed = inner.embed_tokens
        layers = [_bare(layer) for layer in inner.layers]
        first = _bare(layers[0].self_attn)
        self.shape = _Shape(first, layers[0].input_layernorm.eps)
        self.final_norm = inner.norm.weight
        head = _bare(model["lm_head"]) if "lm_head" in model else None
        self.logits_w = head.weight if head is not None else inner.embed_tokens.weight
        self.weights = [_layer_weights(layer) for layer in layers]
        few_rows.runs_here()  # its first-use check evaluates, which a trace may not
        # every query row's attention in one kernel where it runs, not chunks of three
        self.one_launch_attention = one_launch_attention and row_attention.runs_here(
            self.shape.head_dim
        )
        # a pooled batch's rows in one launch reading the pool in place (float32, as the
        # one-row kernel it copies is checked in)
        if pool_kernel not in GPU_MODES:
            raise ValueError(f"pool_kernel is one of {', '.join(GPU_MODES)}, not {pool_kernel!r}")
        self.pool_kernel = (
            pool_kernel != "off"
            and self.final_norm.dtype == mx.float32
            and pool_attention.runs_here(self.shape.head_dim)
        )
        if pool_kernel == "on" and not self.pool_kernel:
            log.warning("--pool-kernel: the pool kernel runs on a CUDA GPU with a float32 "
                        "target whose head size is one of %s; the pooled batch keeps the "
                        "masked attention", pool_attention.HEAD_DIMS)  # fmt: skip
        shape = self.shape
        self._first = mx.compile(partial(_rotated, shape))
        self._middle = mx.compile(partial(_middle, shape, _finish_layer, _rotated))
        self._last = mx.compile(partial(_last, shape, _finish_layer))
        # rows of many sequences (a pooled batch): traced per row count of `traced_rows`
        self._first_rows = mx.compile(partial(_rotated_rows, shape))
        self._middle_rows = mx.compile(partial(_middle, shape, _finish_rows, _rotated_rows))
        self._last_rows = mx.compile(partial(_last, shape, _finish_rows))

    def forward(
        self, token_ids: mx.array, cache: list, capture: frozenset[int] = frozenset()
    ) -> tuple[mx.array, dict[int, mx.array]]:
        """token_ids [T] appended at the end of `cache`: (logits [T, V], {layer: output [T, H]}
        for the layers in `capture`). Lazy, as the model's own call."""
        rows = token_ids.shape[0]

        def attend(layer: int, q, k, v) -> list[mx.array]:
            base = cache[layer].offset
            keys, values = cache[layer].update_and_fetch(k, v)
            return self._attend(q, keys, values, base, rows)

        offset = mx.array(cache[0].offset, dtype=mx.int32)
        return self._layers(self._first, self._middle, self._last, self.embed(token_ids),
                            offset, attend, capture)  # fmt: skip

    def forward_tree(
        self,
        token_ids: mx.array,
        cache: list,
        positions: mx.array,
        node_sees: np.ndarray,
        capture: frozenset[int] = frozenset(),
    ) -> tuple[mx.array, dict[int, mx.array]]:
        """A draft tree's nodes [T] appended at the end of `cache`, node i rotated at
        positions[i] (the cache's length plus its depth) and attending to the whole cache and,
        among the nodes, where `node_sees` [T, T] (bool) allows: itself and its ancestors. The
        nodes go through the rows' compiled pieces, one sequence; returns as `forward`. Where
        the pool kernel runs, every node's attention is one launch a layer reading the cache
        in place; else one masked attention a layer (on a GPU several launches and a mask the
        size of the cache, which made a tree of a few nodes cost twice a chain's verify)."""
        rows, scale = token_ids.shape[0], self.shape.scale
        base = cache[0].offset
        info = None
        if self.pool_kernel:
            info = pool_attention.row_info(np.zeros(1, np.int32), np.array([base]),
                                           np.array([rows]), [(None, node_sees)])  # fmt: skip
        if info is not None:
            info, mask = mx.array(info), None
        else:
            mask = mx.array(sees_after(node_sees, base))

        def attend(layer: int, q, k, v):
            # rows [T, heads, 1, D] -> one sequence [1, heads, T, D], as the cache keeps it
            keys, values = cache[layer].update_and_fetch(k.transpose(2, 1, 0, 3),
                                                         v.transpose(2, 1, 0, 3))  # fmt: skip
            if mask is None:  # the cache as a pool of one slot
                return pool_attention.attend(q.reshape(rows, q.shape[1], -1), keys, values,
                                             info, scale)  # fmt: skip
            out = mx.fast.scaled_dot_product_attention(
                q.transpose(2, 1, 0, 3), keys, values, scale=scale, mask=mask
            )
            return out[0].transpose(1, 0, 2).reshape(rows, -1)

        return self.forward_rows(token_ids, positions, attend, capture)

    def forward_rows(
        self, token_ids: mx.array, positions: mx.array, attend, capture=frozenset()
    ) -> tuple[mx.array, dict[int, mx.array]]:
        """Rows of many sequences at once, row r at position positions[r] of its own sequence:
        `attend(layer, queries, keys, values)` (rotated, [rows, heads or kv_heads, 1, D])
        stores the keys and values where each row's sequence keeps them and returns each row's
        attention over its own sequence, [rows, heads * D]. Returns (logits [rows, V],
        {layer: output [rows, H]} for the layers in `capture`). Lazy. A caller keeps the row
        count to `traced_rows`' values, so few shapes are traced."""
        return self._layers(self._first_rows, self._middle_rows, self._last_rows,
                            self.embed(token_ids), positions, attend, capture)  # fmt: skip

    def _layers(self, first, middle, last, h, where, attend, capture):
        """Every layer from the embedded rows h: `first`, `middle`, `last` are the compiled
        pieces of one kind (a sequence at `where`, an offset, or rows at `where`, positions),
        `attend(layer, q, k, v)` the attention between them."""
        w = self.weights
        kept = {}
        q, k, v = first(h, where, w[0]["in"], w[0]["qkv"])
        for i in range(len(w)):
            out = attend(i, q, k, v)
            tail = (w[i]["o"], w[i]["post"], w[i]["gate_up"], w[i]["down"])
            if i + 1 < len(w):
                h, q, k, v = middle(h, out, where, *tail, w[i + 1]["in"], w[i + 1]["qkv"])
            else:
                h, logits = last(h, out, *tail, self.final_norm, self.logits_w)
            if i in capture:
                kept[i] = h
        return logits, kept

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        """As the model's own call (logits [1, T, V]); what this does not take goes to it."""
        if cache is None or inputs.ndim != 2 or inputs.shape[0] != 1:
            return self.model(inputs, cache=cache)
        if not 1 <= inputs.shape[1] <= MAX_ROWS:
            return self.model(inputs, cache=cache)
        return self.forward(inputs[0], cache)[0][None]

    def _attend(self, q, keys, values, base: int, rows: int) -> list[mx.array]:
        """Attention of the rows in the chunks a decode step's kernel takes (rowwise)."""
        sdpa = mx.fast.scaled_dot_product_attention
        scale = self.shape.scale
        if rows == 1:
            return [sdpa(q, keys, values, scale=scale)]
        if self.one_launch_attention and row_attention.fits(q, keys, base):
            return [row_attention.attend(q, keys, values, scale)]
        parts = []
        for start, stop in chunk_bounds(base, rows):
            seen = base + stop
            k, v = (keys, values) if stop == rows else (keys[:, :, :seen], values[:, :, :seen])
            parts.append(sdpa(q[:, :, start:stop], k, v, scale=scale, mask="causal"))
        return parts


def sees_after(sees: np.ndarray, past: int) -> np.ndarray:
    """[T, past + T] bool: new tokens that see the whole cache and, among themselves, `sees`."""
    return np.concatenate([np.ones((len(sees), past), dtype=bool), sees], axis=1)


def _middle(shape, finish, rotate, h, attn, offset, o_w, post_w, gate_up_w, down_w, in_w, qkv_w):
    h = finish(shape, h, attn, o_w, post_w, gate_up_w, down_w)
    return (h, *rotate(shape, h, offset, in_w, qkv_w))


def _last(shape, finish, h, attn, o_w, post_w, gate_up_w, down_w, norm_w, logits_w):
    h = finish(shape, h, attn, o_w, post_w, gate_up_w, down_w)
    return h, _product(mx.fast.rms_norm(h, norm_w, shape.eps), logits_w)


EXACT_ROWS = 8  # row counts traced as they are; above, rounded up (`traced_rows`)
MAX_POOLED_ROWS = 256  # beyond, a batch is compute-bound: the model's own forward


def traced_rows(rows: int) -> int:
    """The row count a batch of `rows` rows runs `forward_rows` at: each new count is a trace
    (and on a GPU, kernels to build), so above EXACT_ROWS counts go up to a multiple of 8, and
    above 64 to a power of two; the padding rows cost little where a step is bound by the
    host and the weights' reads."""
    if rows <= EXACT_ROWS:
        return rows
    if rows <= 64:
        return -(-rows // 8) * 8
    return 1 << (rows - 1).bit_length()


def _bare(module: nn.Module) -> nn.Module:
    """The module under specd's wrappers (capture, row by row)."""
    while isinstance(module, Bypass.WRAPPERS):
        module = module.inner
    return module


def _layer_weights(layer: nn.Module) -> dict[str, mx.array]:
    """A layer's weights, q/k/v and gate/up joined: the joins row by row already made where
    rowwise is installed, else new ones whose views replace the Linears' weights (no copy
    stays)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = getattr(attn, "_qkv", None)
    if qkv is None:
        a = _bare(attn)
        qkv = Joined([_bare(a.q_proj), _bare(a.k_proj), _bare(a.v_proj)])
    gate_up = getattr(mlp, "_gate_up", None)
    if gate_up is None:
        m = _bare(mlp)
        gate_up = Joined([_bare(m.gate_proj), _bare(m.up_proj)])
    a, m = _bare(attn), _bare(mlp)
    return {
        "in": layer.input_layernorm.weight,
        "qkv": qkv.weight,
        "o": _bare(a.o_proj).weight,
        "post": layer.post_attention_layernorm.weight,
        "gate_up": gate_up.weight,
        "down": _bare(m.down_proj).weight,
    }


def supports(model: nn.Module) -> bool:
    """mlx-lm Llama layers (no sliding window) with plain Linear products and no biases, a
    plain embedding and logits head."""
    inner = getattr(model, "model", None)
    if inner is None or type(inner).__module__ != "mlx_lm.models.llama":
        return False
    if getattr(inner, "swa_idx", None) is not None:
        return False
    if not isinstance(inner.embed_tokens, nn.Embedding):  # not QuantizedEmbedding
        return False
    if "lm_head" in model and type(_bare(model["lm_head"])) is not nn.Linear:
        return False
    for layer in inner.layers:
        layer = _bare(layer)
        attn, mlp = _bare(layer.self_attn), _bare(layer.mlp)
        if type(attn).__module__ != "mlx_lm.models.llama":
            return False
        products = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
        products += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(type(_bare(p)) is not nn.Linear or "bias" in _bare(p) for p in products):
            return False
    return True
