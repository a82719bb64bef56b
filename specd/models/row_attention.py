"""Attention of a few query rows in one kernel on MLX's CUDA backend, each row summed exactly as
a decode step's one-row attention kernel sums it.

MLX's CUDA attention runs its one-pass vector kernel (`kernel_sdpav_1pass` in
mlx/backend/cuda/scaled_dot_product_attention.cu) only for fewer than four query rows, so a
verify of 7 or 16 tokens was cut into chunks of three (specd.models.rowwise.chunk_bounds): a
launch a chunk, a copy of its queries, and a join after. That kernel's arithmetic for one query
row does not depend on the other rows (the causal mask only skips keys), so here one launch
takes every row: a block a (head, row), 32 warps a block, warp w taking keys w, w + 32, ...
with the same online softmax in the same order, then the same merge of the warps' partial
results. A row r after `base` cached tokens sees base + r + 1 keys, what its decode step sees.
Rows whose decode step would see more than TWO_PASS_KEYS keys run MLX's two-pass kernel there
and are left to it. At first use the rows are compared with one-row attention bit for bit;
where they differ or the kernel does not build, the verifier logs why and keeps the chunks.
"""

from __future__ import annotations

import logging

import mlx.core as mx

from specd.models import few_rows

log = logging.getLogger(__name__)

MAX_ROWS = 16
HEAD_DIMS = (64, 96, 128)  # those MLX's vector kernel takes
TWO_PASS_KEYS = 1024  # past this many keys MLX's one-row kernel splits them another way
_WARPS = 32  # warps a block, each a stride of the keys: MLX's block of 1024 threads
_HEADER = "#include <cooperative_groups/reduce.h>\n"

# The one-row kernel's arithmetic for a block of (head, row) whose keys the caller names:
# `setup` declares head, row, heads, kv_head and key_count (and what `bounds` reads), `query`
# is the row's query, `bounds` what `visible` reads, `keys`/`values` key 0 of the row's kv
# head, `visible` whether key i counts. One template keeps every kernel's sums in the one-row
# kernel's order.
_ONE_ROW = """
    constexpr int WARPS = {warps};
    constexpr int PER_LANE = D / 32;
{setup}    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    const int lane = warp.thread_rank();
    const int w = warp.meta_group_rank();

    __shared__ float merged[WARPS][WARPS + 1];
    __shared__ float warp_max[WARPS];
    __shared__ float warp_sum[WARPS];

    // the scale times log2(e), rounded once from double as the one-row kernel rounds it
    const float scale_log2 = static_cast<float>(
        static_cast<double>(scale[0]) * 1.44269504088896340736);
    const T* query = {query};
    float qv[PER_LANE];
    float acc[PER_LANE];
    #pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {{
        qv[j] = scale_log2 * static_cast<float>(query[PER_LANE * lane + j]);
        acc[j] = 0.0f;
    }}
    float running_max = Limits<float>::finite_min();
    float running_sum = 0.0f;

{bounds}    const T* key = {keys} + w * keys_strides[2];
    const T* value = {values} + w * values_strides[2];
    const int64_t key_step = WARPS * keys_strides[2];
    const int64_t value_step = WARPS * values_strides[2];
    for (int i = w; i < key_count; i += WARPS) {{
        if ({visible}) {{
            float kv[PER_LANE];
            #pragma unroll
            for (int j = 0; j < PER_LANE; ++j) {{
                kv[j] = key[PER_LANE * lane + j];
            }}
            float score = 0.0f;
            #pragma unroll
            for (int j = 0; j < PER_LANE; ++j) {{
                score += qv[j] * kv[j];
            }}
            score = cg::reduce(warp, score, cg::plus<float>());
            const float new_max = max(running_max, score);
            const float shrink = exp2f(running_max - new_max);
            const float weight = exp2f(score - new_max);
            running_max = new_max;
            running_sum = running_sum * shrink + weight;
            #pragma unroll
            for (int j = 0; j < PER_LANE; ++j) {{
                acc[j] = acc[j] * shrink + weight * static_cast<float>(value[PER_LANE * lane + j]);
            }}
        }}
        key += key_step;
        value += value_step;
    }}

    if (lane == 0) {{
        warp_max[w] = running_max;
        warp_sum[w] = running_sum;
    }}
    block.sync();
    // lane l now speaks for warp l's keys
    const float lane_max = warp_max[lane];
    const float overall_max = cg::reduce(warp, lane_max, cg::greater<float>());
    const float lane_shrink = exp2f(lane_max - overall_max);
    float total = cg::reduce(warp, warp_sum[lane] * lane_shrink, cg::plus<float>());
    total = total == 0 ? 0 : __frcp_rn(total);

    T* out_row = out + static_cast<int64_t>(row) * heads * D + head * D;
    #pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {{
        merged[lane][w] = acc[j];
        block.sync();
        const float part = merged[w][lane] * lane_shrink;
        acc[j] = cg::reduce(warp, part, cg::plus<float>()) * total;
        block.sync();
    }}
    if (lane == 0) {{
        #pragma unroll
        for (int j = 0; j < PER_LANE; ++j) {{
            out_row[PER_LANE * w + j] = static_cast<T>(acc[j]);
        }}
    }}
"""


def one_row_source(setup: str, query: str, bounds: str, keys: str, values: str,
                   visible: str) -> str:  # fmt: skip
    """A kernel body: `_ONE_ROW` with the caller's parts (CUDA source)."""
    return _ONE_ROW.format(warps=_WARPS, setup=setup, query=query, bounds=bounds, keys=keys,
                           values=values, visible=visible)  # fmt: skip


# q [1, H, rows, D] (any strides), keys/values [1, KVH, L, D] (the cache's slices, strided),
# scale [1]; out [rows, H * D], the layout the output product reads. D is a template argument.
_SOURCE = one_row_source(
    setup="""\
    const int head = blockIdx.x;
    const int row = blockIdx.y;
    const int heads = q_shape[1];
    const int rows = q_shape[2];
    const int key_count = keys_shape[2];
    const int kv_head = head / (heads / keys_shape[1]);
""",
    query="q + head * q_strides[1] + row * q_strides[2]",
    bounds="    const int last_key = key_count - rows + row;"
    "  // the causal bound: keys 0..last_key\n",
    keys="keys + kv_head * keys_strides[1]",
    values="values + kv_head * values_strides[1]",
    visible="i <= last_key",
)


class OneRowKernel:
    """A kernel of `one_row_source`, built at its first call: a block a (head, row), inputs
    `input_names` then the scale, out [rows, heads * D] in the inputs' dtype (D = head size)."""

    _scales: dict[float, mx.array] = {}  # one small array a scale, not one a call

    def __init__(self, name: str, input_names: list[str], source: str):
        self.name, self.input_names, self.source = name, input_names, source
        self._kernel = None

    def __call__(self, inputs: list[mx.array], scale: float, rows: int, heads: int,
                 head_dim: int) -> mx.array:  # fmt: skip
        if self._kernel is None:
            self._kernel = mx.fast.cuda_kernel(
                name=self.name,
                input_names=[*self.input_names, "scale"],
                output_names=["out"],
                source=self.source,
                header=_HEADER,
                ensure_row_contiguous=False,  # the caches and the pool are read in place
            )
        if scale not in self._scales:
            self._scales[scale] = mx.array([scale], dtype=mx.float32)
        dtype = inputs[0].dtype
        (out,) = self._kernel(
            inputs=[*inputs, self._scales[scale]],
            template=[("T", dtype), ("D", head_dim)],
            grid=(32 * _WARPS * heads, rows, 1),
            threadgroup=(32 * _WARPS, 1, 1),
            output_shapes=[(rows, heads * head_dim)],
            output_dtypes=[dtype],
        )
        return out


_kernel = OneRowKernel("specd_row_attention", ["q", "keys", "values"], _SOURCE)
_works: dict[int, bool] = {}  # head size -> the first use's check on this device


def runs_here(head_dim: int) -> bool:
    """Whether the kernel runs here for heads of `head_dim`: the default device is a CUDA GPU
    and the kernel built and matched one-row attention bit for bit at its first use at that
    size (the size is a template argument: each is its own build)."""
    if not few_rows.on_cuda() or head_dim not in HEAD_DIMS:
        return False
    if head_dim not in _works:
        _works[head_dim] = _first_use_check(head_dim)
    return _works[head_dim]


def fits(q: mx.array, keys: mx.array, base: int) -> bool:
    """Whether `q` [1, H, rows, D] over `keys` (base cached tokens, then the rows' own) may
    take the kernel: float32 (MLX's half-precision decode steps may go to cuDNN instead), 2..16
    rows, a head size MLX's vector kernel takes, and no row past the one-pass kernel's keys."""
    rows = q.shape[2]
    return (
        1 < rows <= MAX_ROWS
        and q.shape[0] == 1
        and q.dtype == mx.float32
        and keys.dtype == mx.float32
        and q.shape[-1] in HEAD_DIMS
        and base + rows <= TWO_PASS_KEYS
    )


def attend(q: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """Causal attention of q [1, H, rows, D] over keys/values [1, KVH, L, D] (the rows' own
    keys last): [1, H, rows, D], a view of the kernel's [rows, H * D] output."""
    _, heads, rows, head_dim = q.shape
    out = _kernel([q, keys, values], scale, rows, heads, head_dim)
    return out.reshape(1, rows, heads, head_dim).transpose(0, 2, 1, 3)


def _first_use_check(head_dim: int) -> bool:
    """Rows from the kernel against one-row attention at a few cache lengths, keys read from a
    larger buffer as a KV cache holds them; any difference keeps MLX's chunks."""
    try:
        heads, kv_heads, capacity = 9, 3, 1280
        buffer_k = mx.random.normal((1, kv_heads, capacity, head_dim), key=mx.random.key(2))
        buffer_v = mx.random.normal((1, kv_heads, capacity, head_dim), key=mx.random.key(3))
        for base, rows in ((0, 2), (37, 7), (300, 16), (1008, 16)):
            seen = base + rows
            q = mx.random.normal((1, heads, rows, head_dim), key=mx.random.key(seen))
            keys, values = buffer_k[:, :, :seen], buffer_v[:, :, :seen]
            got = attend(q, keys, values, head_dim**-0.5)
            want = [
                mx.fast.scaled_dot_product_attention(
                    q[:, :, r : r + 1], keys[:, :, : base + r + 1], values[:, :, : base + r + 1],
                    scale=head_dim**-0.5,
                )
                for r in range(rows)
            ]  # fmt: skip
            if not mx.array_equal(got, mx.concatenate(want, axis=2)).item():
                log.warning("row attention disagrees with MLX's one-row kernel; keeping chunks")
                return False
        return True
    except Exception as error:  # a kernel that does not build must not stop the verifier
        log.warning("row attention unavailable here (%s); keeping chunks", error)
        return False
