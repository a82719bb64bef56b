"""Weight products of a few rows on MLX's CUDA backend, each row summed exactly as a decode
step's matrix-vector kernel sums it.

MLX multiplies one row by a weight with its own matrix-vector kernel (~10 us at a small
model's sizes, launch-bound) and two or more rows with cuBLAS (~26 us), whose sums also run in
another order. Here one kernel takes 2..MAX_ROWS rows: a warp per output column, each lane
summing the same columns in the same order as MLX's kernel (`gemv_impl` in
mlx/backend/cuda/gemms/gemv.cu: lane j takes `per_lane` columns from `per_lane * j`, strides of
32 * per_lane, then a warp reduction), for every row at once, so each row of a verify is the
number a decode step computes. `benchmarks/gpu_ops.py` checks the rows bit for bit on a GPU and
times the kernel: on an H200, in compiled chains, 8-31 us for 2-16 rows against 6-9 for one
row's product (docs/gpu.md, run AG).

How the sums are spread over warps is a layout (LAYOUTS): `whole` gives each warp one output
column of every row, the row count built in; the tiled layouts give a warp a tile of a few rows
(grid z counts the tiles) and one or two columns, so 16 rows run as four times the warps, each
a quarter as long. Every layout sums a (row, column) the same way, so each is bit for bit the
one-row product; benchmarks/few_rows_layouts.py times them and checks that on a GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx

log = logging.getLogger(__name__)

MAX_ROWS = 16
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
_WARPS_PER_BLOCK = 8

_HEADER = "#include <cooperative_groups/reduce.h>\n"

# x: [rows, K], w: [N, K] -> out: [rows, N]; T (dtype) and PER_LANE (1, 2 or 4) are template
# arguments. The row count is a compile-time constant (sums in registers, no per-row branches)
# and each lane reads its PER_LANE columns in one vector load, as MLX's kernel reads them. One
# function per row count, all in one kernel that switches on the rows: MLX compiles a custom
# kernel in every process without a disk cache, so one build a dtype and lane width, not one a
# row count.
_HEADER_ROWS = (
    _HEADER
    + f"""
template <typename T, int PER_LANE, int ROWS>
__device__ void specd_rows_product(const T* x, const T* w, T* out, int cols, int outputs) {{
    struct alignas(sizeof(T) * PER_LANE) Pack {{
        T v[PER_LANE];
    }};
    namespace cg = cooperative_groups;
    auto warp = cg::tiled_partition<32>(cg::this_thread_block());
    const int n = blockIdx.y * {_WARPS_PER_BLOCK} + threadIdx.y;
    if (n >= outputs) {{
        return;  // a whole warp: n is the same across its lanes
    }}
    float sums[ROWS];
    #pragma unroll
    for (int t = 0; t < ROWS; ++t) {{
        sums[t] = 0.0f;
    }}
    const T* weight_row = w + static_cast<int64_t>(n) * cols;
    for (int col = PER_LANE * warp.thread_rank(); col < cols; col += 32 * PER_LANE) {{
        const Pack weights = *reinterpret_cast<const Pack*>(weight_row + col);
        #pragma unroll
        for (int t = 0; t < ROWS; ++t) {{
            const T* x_at = x + static_cast<int64_t>(t) * cols + col;
            const Pack xs = *reinterpret_cast<const Pack*>(x_at);
            #pragma unroll
            for (int j = 0; j < PER_LANE; ++j) {{
                sums[t] += static_cast<float>(weights.v[j]) * static_cast<float>(xs.v[j]);
            }}
        }}
    }}
    #pragma unroll
    for (int t = 0; t < ROWS; ++t) {{
        float total = cg::reduce(warp, sums[t], cg::plus<float>());
        if (warp.thread_rank() == 0) {{
            out[static_cast<int64_t>(t) * outputs + n] = static_cast<T>(total);
        }}
    }}
}}
"""
)
_SOURCE_ROWS = (
    "    switch (x_shape[0]) {\n"
    + "".join(
        f"    case {rows}: specd_rows_product<T, PER_LANE, {rows}>"
        "(x, w, out, w_shape[1], w_shape[0]); break;\n"
        for rows in range(2, MAX_ROWS + 1)
    )
    + "    }\n"
)

# The same sums spread wider: a warp takes ROW_TILE rows (a tile; grid z counts the tiles, the
# last one's missing rows skipped) of COLUMNS output columns, so a product of many rows runs as
# many short warps instead of a few long ones, and a warp's loads of x serve COLUMNS weight
# rows. Each (row, column) sum is still one lane's columns in order, then the warp reduction.
_HEADER_TILES = (
    _HEADER
    + f"""
template <typename T, int PER_LANE, int ROW_TILE, int COLUMNS>
__device__ void specd_tile_product(
        const T* x, const T* w, T* out, int rows, int cols, int outputs) {{
    struct alignas(sizeof(T) * PER_LANE) Pack {{
        T v[PER_LANE];
    }};
    namespace cg = cooperative_groups;
    auto warp = cg::tiled_partition<32>(cg::this_thread_block());
    const int first = (blockIdx.y * {_WARPS_PER_BLOCK} + threadIdx.y) * COLUMNS;
    if (first >= outputs) {{
        return;  // a whole warp
    }}
    const int row0 = blockIdx.z * ROW_TILE;
    const int tile_rows = min(ROW_TILE, rows - row0);
    const T* x_tile = x + static_cast<int64_t>(row0) * cols;
    float sums[ROW_TILE][COLUMNS];
    #pragma unroll
    for (int t = 0; t < ROW_TILE; ++t) {{
        #pragma unroll
        for (int c = 0; c < COLUMNS; ++c) {{
            sums[t][c] = 0.0f;
        }}
    }}
    for (int col = PER_LANE * warp.thread_rank(); col < cols; col += 32 * PER_LANE) {{
        Pack weights[COLUMNS];
        #pragma unroll
        for (int c = 0; c < COLUMNS; ++c) {{
            // a column past the last re-reads the last one; its sums are never written
            const int n = min(first + c, outputs - 1);
            weights[c] = *reinterpret_cast<const Pack*>(w + static_cast<int64_t>(n) * cols + col);
        }}
        #pragma unroll
        for (int t = 0; t < ROW_TILE; ++t) {{
            if (t < tile_rows) {{
                const Pack xs =
                    *reinterpret_cast<const Pack*>(x_tile + static_cast<int64_t>(t) * cols + col);
                #pragma unroll
                for (int c = 0; c < COLUMNS; ++c) {{
                    #pragma unroll
                    for (int j = 0; j < PER_LANE; ++j) {{
                        sums[t][c] +=
                            static_cast<float>(weights[c].v[j]) * static_cast<float>(xs.v[j]);
                    }}
                }}
            }}
        }}
    }}
    #pragma unroll
    for (int t = 0; t < ROW_TILE; ++t) {{
        #pragma unroll
        for (int c = 0; c < COLUMNS; ++c) {{
            if (t < tile_rows && first + c < outputs) {{
                float total = cg::reduce(warp, sums[t][c], cg::plus<float>());
                if (warp.thread_rank() == 0) {{
                    out[static_cast<int64_t>(row0 + t) * outputs + first + c] =
                        static_cast<T>(total);
                }}
            }}
        }}
    }}
}}
"""
)
_SOURCE_TILES = (
    "    specd_tile_product<T, PER_LANE, ROW_TILE, COLUMNS>"
    "(x, w, out, x_shape[0], w_shape[1], w_shape[0]);\n"
)


@dataclass(frozen=True)
class Layout:
    """How a product's sums are spread over warps: row_tile rows and `columns` output columns
    a warp (row_tile 0: every row in one warp, the row count built in)."""

    row_tile: int
    columns: int = 1


# benchmarks/few_rows_layouts.py times each on a GPU and checks its rows bit for bit
LAYOUTS = {
    "whole": Layout(0),
    "t2": Layout(2),
    "t4": Layout(4),
    "t8": Layout(8),
    "t4c2": Layout(4, 2),
    "t2c2": Layout(2, 2),
    "t16c2": Layout(16, 2),
    "t16c4": Layout(16, 4),
}
# Past this a weight does not stay in the GPU's L2 cache (50 MB on an H100) between the tiles
# that read it: the logits' (113 MB in float32) is read once, whole.
TILED_WEIGHT_BYTES = 32 * 2**20
_layout: Layout | None = None  # None: by the weight's size (`layout_for`)


def layout_for(weight: mx.array) -> Layout:
    """Tiles of two rows for a weight that stays in L2 (on an H100 a product of 16 rows 2.4x
    faster than whole, of 8 rows 1.2x, the same at 2-4 rows; docs/gpu.md, run AW), whole for a
    larger one (tiles would read it from memory once each)."""
    if _layout is not None:
        return _layout
    return LAYOUTS["t2"] if weight.nbytes <= TILED_WEIGHT_BYTES else LAYOUTS["whole"]


def layout_name() -> str:
    if _layout is None:
        return "auto"
    return next(name for name, layout in LAYOUTS.items() if layout == _layout)


def use(name: str) -> None:
    """Make LAYOUTS[name] the layout of every product from now on, or "auto" (`layout_for`)
    again (for benchmarks)."""
    global _layout
    if name != "auto" and name not in LAYOUTS:
        raise ValueError(f"few-row layout is auto or one of {', '.join(LAYOUTS)}, not {name!r}")
    _layout = None if name == "auto" else LAYOUTS[name]


_kernels: dict[bool, object] = {}  # tiled or not: built at first use
_works: bool | None = None  # the first use's check on this device


def runs_here() -> bool:
    """Whether the kernel runs here: the default device is a CUDA GPU (the kernel exists
    nowhere else) and the kernel built and matched MLX's products at its first use."""
    global _works
    if not on_cuda():
        return False
    if _works is None:
        _works = _first_use_check()
    return _works


def on_cuda() -> bool:
    """Whether MLX's default device is a CUDA GPU, where specd's own kernels may run."""
    cuda = getattr(mx, "cuda", None)
    return cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu


def _first_use_check() -> bool:
    """Build the kernels (tiled and whole) and compare a small product of each with MLX's; on
    any failure the products stay MLX's, with the reason logged once."""
    try:
        weight = mx.random.normal((40, 192), key=mx.random.key(0))
        x = mx.random.normal((3, 192), key=mx.random.key(1))
        got = [product(x, weight, LAYOUTS[name]) for name in ("t2", "whole")]
        want = mx.concatenate([x[t : t + 1] @ weight.T for t in range(3)])  # one-row kernels
        mx.eval(got, want)
        if all(mx.allclose(g, want, rtol=1e-5, atol=1e-5).item() for g in got):
            return True
        log.warning("few-row products disagree with MLX's here; using MLX's own")
    except Exception as error:  # a kernel that does not build must not stop the verifier
        log.warning("few-row products unavailable here (%s); using MLX's own", error)
    return False


def per_lane(cols: int) -> int:
    """The columns a lane reads at once, as MLX's matrix-vector kernel picks them (its inputs
    are aligned here: whole rows of freshly allocated arrays)."""
    if cols % 128 == 0:
        return 4
    if cols % 64 == 0:
        return 2
    return 1


def fits(rows: int, x: mx.array, weight: mx.array) -> bool:
    return (
        1 < rows <= MAX_ROWS
        and weight.ndim == 2
        and x.dtype == weight.dtype
        and weight.dtype in DTYPES
    )


def product(x: mx.array, weight: mx.array, layout: Layout | None = None) -> mx.array:
    """x [..., K] (2..MAX_ROWS rows in all) times weight [N, K] transposed: [..., N]."""
    layout = layout or layout_for(weight)
    tiled = layout.row_tile > 0
    kernel = _kernels.get(tiled)
    if kernel is None:
        kernel = _kernels[tiled] = mx.fast.cuda_kernel(
            name="specd_few_row_tiles" if tiled else "specd_few_rows",
            input_names=["x", "w"],
            output_names=["out"],
            source=_SOURCE_TILES if tiled else _SOURCE_ROWS,
            header=_HEADER_TILES if tiled else _HEADER_ROWS,
        )
    cols = x.shape[-1]
    rows = x.size // cols
    outputs = weight.shape[0]
    template = [("T", weight.dtype), ("PER_LANE", per_lane(cols))]
    if tiled:
        template += [("ROW_TILE", layout.row_tile), ("COLUMNS", layout.columns)]
    warps = -(-outputs // layout.columns)
    blocks = -(-warps // _WARPS_PER_BLOCK)
    tiles = -(-rows // layout.row_tile) if tiled else 1
    (out,) = kernel(
        inputs=[x.reshape(rows, cols), weight],
        template=template,
        grid=(32, blocks * _WARPS_PER_BLOCK, tiles),
        threadgroup=(32, _WARPS_PER_BLOCK, 1),
        output_shapes=[(rows, outputs)],
        output_dtypes=[weight.dtype],
    )
    return out.reshape(*x.shape[:-1], outputs)
