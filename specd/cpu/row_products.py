"""Products of a few input rows with one float32 weight matrix, reading the weights once.

For a few rows a BLAS sgemm first packs the whole weight matrix (numpy's and MLX's alike),
and a gemv per row reads it once per row; on a memory-bound CPU both cost about the rows
times one gemv. The compiled kernels (specd/cpu/_row_kernels.c, built by pip with the package)
walk the weight rows once and multiply each, while it is in cache, with one, two or four
input rows at a time (docs/history). They also read float16 weights, converting as they go
and summing in float32, for half the bytes (specd.cpu.gemv says when). Where they were not
built (no C compiler), numpy's gemv and sgemm do the products.

On an x86-64 CPU with AVX2 and F16C a float16 weight can also be held paired (`pair_rows`):
two rows interleaved in blocks of sixteen, so each input vector loaded serves two weight rows
and the rows multiplied together are one stream in memory. The same sums bit for bit, and every
row count then sums each row as a one-row product does; a pass of 1, 2, 4 and 8 rows over
the embedded model's weight shapes took 8.7, 9.0, 12.3 and 16.4 ms paired against 9.7, 11.4,
16.8 and 23.6 as stored on a CPU with AVX-512VL, whose 32 vector registers take four input rows
a pass (with AVX2's 16, two; benchmarks/row_kernels.py, docs/results.md).

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


def pairs_supported() -> bool:
    """Whether this CPU runs the paired products (AVX2, FMA and F16C)."""
    return _row_kernels is not None and _row_kernels.paired_supported()


def pair_rows(weight: np.ndarray) -> np.ndarray | None:
    """float16 `weight` [out, in] laid out for the paired products, [out/2, 2*in]: rows 2i and
    2i+1 interleaved in blocks of 16 values; None where the CPU or the shape does not allow it
    (an odd number of rows, rows not a multiple of 16 long)."""
    rows, width = weight.shape
    if not pairs_supported() or weight.dtype != np.float16 or rows % 2 or width % 16:
        return None
    blocks = weight.reshape(rows // 2, 2, width // 16, 16).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(blocks).reshape(rows // 2, 2 * width)


def row_products(
    weight: np.ndarray, rows: np.ndarray, paired: np.ndarray | None = None
) -> np.ndarray:
    """rows [n, in] @ weight[out, in].T -> [n, out] float32; weight C-contiguous, float32 (or
    float16 with the compiled kernels); `paired`, where given, is `pair_rows(weight)` and is
    read instead."""
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
    # a group of four in two paired passes of two (AVX2 alone) ran ~7 % behind the stored
    # four-row loop, which sums each row alike (benchmarks/row_kernels.py)
    if paired is None or (padded == GROUP and _row_kernels.paired_rows_a_pass() < GROUP):
        _row_kernels.products(weight, grouped, out)
    else:
        _row_kernels.paired_products(paired, grouped, out)
    return out[:n]
