"""Products of a few input rows with one float32 weight matrix, reading the weights once.

For a few rows a BLAS sgemm first packs the whole weight matrix (numpy's and MLX's alike),
and a gemv per row reads it once per row; on a memory-bound CPU both cost about the rows
times one gemv. The compiled kernels (specd/cpu/_row_kernels.c, built by pip with the package)
walk the weight rows once and multiply each, while it is in cache, with one, two, four or
(half weights on AVX2) eight input rows at a time (docs/history). They also read float16 weights,
converting as they go and summing in float32, for half the bytes (specd.cpu.gemv says
when). Where they were not built (no C compiler), numpy's gemv and sgemm do the products.

Their threads are the extension's own, one pool per process whichever thread calls: a second
BLAS thread pool busy or spinning beside them halves their speed on two cores, so the verifier
keeps numpy's BLAS on one thread while it uses them.
"""

from __future__ import annotations

import numpy as np

try:
    from specd.cpu import _row_kernels
except ImportError:  # built without a C compiler
    _row_kernels = None

GROUP = 4  # input rows per pass over a weight row (the kernel's accumulators)


def compiled() -> bool:
    return _row_kernels is not None


def layer_kernels():
    """The compiled module, whose attention, rms_norm, rope and swiglu serve
    specd.cpu.llama; None where it was not built."""
    return _row_kernels


def row_products(weight: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """rows [n, in] @ weight[out, in].T -> [n, out] float32; weight C-contiguous, float32 (or
    float16 with the compiled kernels)."""
    n, width = rows.shape
    if _row_kernels is None:
        return np.matmul(weight, rows[0])[None] if n == 1 else rows @ weight.T
    padded = n if n <= 2 else -(-n // GROUP) * GROUP
    if padded == n:
        grouped = np.ascontiguousarray(rows, dtype=np.float32)
    else:
        grouped = np.zeros((padded, width), dtype=np.float32)
        grouped[:n] = rows
    out = np.empty((padded, weight.shape[0]), dtype=np.float32)
    _row_kernels.products(weight, grouped, out)
    return out[:n]
