"""Products of a few input rows with one float32 weight matrix, reading the weights once.

For a few rows a BLAS sgemm first packs the whole weight matrix (numpy's and MLX's alike),
and a gemv per row reads it once per row; on a memory-bound CPU both cost about the rows
times one gemv. These kernels walk the weight rows once and multiply each, while it is in
cache, with four input rows at a time (SmolLM2-135M's 211 products, medians on a 2-core x86
box with numpy's BLAS on one thread: 1 / 4 / 8 / 16 rows 39 / 48 / 69 / 110 ms, against
61 ms for one row by numpy's gemv and 116-141 ms for 2-16 rows by its sgemm;
docs/benchmarks.md, session 11).

Their threads are numba's: a second BLAS thread pool busy or spinning beside them halves
their speed on two cores, so the verifier keeps numpy's BLAS on one thread while it uses them.
"""

from __future__ import annotations

import numpy as np
from numba import njit, parallel_chunksize, prange

GROUP = 4  # input rows per pass over a weight row: 4 accumulators x 4 unrolled AVX registers
TILE_BYTES = 256 << 10  # weight rows walked once per group of input rows: well inside L2
# Each parallel loop is cut into this many pieces, handed to threads as they come free: with
# static halves, a thread the OS puts aside for another process (the coordinator, a drafter)
# holds up the whole product. Beside a process waking every 0.5 ms, an 8-token forward took
# 89-107 ms static and 75-78 ms in 64-iteration pieces; pieces of 1/16 against static in
# two more alternating runs: within the noise.
PIECES = 16


# reassoc lets LLVM split each sum across vector lanes; contract fuses multiply-adds. No
# nnan/ninf: a NaN in the activations must come out as NaN, as it would from BLAS.
@njit(parallel=True, fastmath={"reassoc", "contract"}, cache=True, nogil=True)
def _by_fours(weight, rows, out, tile):  # pragma: no cover - compiled
    outputs, width = weight.shape
    for t in prange((outputs + tile - 1) // tile):
        # a tile of weight rows comes from memory once and stays in L2 for every group of
        # four input rows, which stay in L1 while the tile is walked
        first, last = t * tile, min(t * tile + tile, outputs)
        for i in range(0, rows.shape[0], GROUP):
            for o in range(first, last):
                a = np.float32(0.0)
                b = np.float32(0.0)
                c = np.float32(0.0)
                d = np.float32(0.0)
                for k in range(width):
                    w = weight[o, k]
                    a += w * rows[i, k]
                    b += w * rows[i + 1, k]
                    c += w * rows[i + 2, k]
                    d += w * rows[i + 3, k]
                out[i, o] = a
                out[i + 1, o] = b
                out[i + 2, o] = c
                out[i + 3, o] = d


@njit(parallel=True, fastmath={"reassoc", "contract"}, cache=True, nogil=True)
def _one(weight, row, out):  # pragma: no cover - compiled
    outputs, width = weight.shape
    for o in prange(outputs):
        a = np.float32(0.0)
        for k in range(width):
            a += weight[o, k] * row[k]
        out[o] = a


def row_products(weight: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """rows [n, in] @ weight[out, in].T -> [n, out], float32, weight C-contiguous."""
    n, width = rows.shape
    if n == 1:
        out = np.empty((1, weight.shape[0]), dtype=np.float32)
        with parallel_chunksize(_piece(weight.shape[0])):
            _one(weight, np.ascontiguousarray(rows[0]), out[0])
        return out
    padded = -(-n // GROUP) * GROUP
    grouped = np.zeros((padded, width), dtype=np.float32)
    grouped[:n] = rows
    out = np.empty((padded, weight.shape[0]), dtype=np.float32)
    tile = max(1, TILE_BYTES // (width * 4))
    with parallel_chunksize(_piece(-(-weight.shape[0] // tile))):
        _by_fours(weight, grouped, out, tile)
    return out[:n]


def _piece(iterations: int) -> int:
    return max(1, iterations // PIECES)


def compile_kernels() -> None:
    """Compile (or load from numba's cache) both kernels now, not in the first request."""
    weight = np.zeros((2, 8), dtype=np.float32)
    for rows in (1, GROUP):
        row_products(weight, np.zeros((rows, 8), dtype=np.float32))
