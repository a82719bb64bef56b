"""Which operations make a forward of T tokens cost more than one of 1 token, per op class.

Times chains of dependent operations at the embedded model's sizes (hidden 576, MLP 1536, 9 query
heads over 3 KV heads of 64, a 512-token cache) for T = 1, 2, 4, 8, 16 rows: weight products as
MLX picks the kernel (`x @ W.T`), the same rows as a batch of one-row products
(`x[:, None] @ W.T`), 4-bit products (`quantized_matmul`, both ways), and attention through
`mx.fast.scaled_dot_product_attention` (causal for T > 1) against the same written out and
specd.models.row_attention's one launch; on CUDA specd's few-row kernel
(specd.models.few_rows), and the plain and few-row products also as chains under mx.compile
(no Python per operation). Prints microseconds per operation, the median of several chains;
then, on CUDA, whether the few-row kernel's rows equal one-row products bit for bit at the
embedded model's product shapes (the logits' included).

    python benchmarks/gpu_ops.py [--dtype float32] [--rows 1 2 4 8 16] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

from specd.models import few_rows, row_attention

HIDDEN, MLP, HEADS, KV_HEADS, HEAD_DIM, CONTEXT = 576, 1536, 9, 3, 64, 512
VOCAB = 49152
# (in, out) of the embedded model's products: q/o, k/v, gate/up, down, logits
SHAPES = ((HIDDEN, HIDDEN), (HIDDEN, 192), (HIDDEN, MLP), (MLP, HIDDEN), (HIDDEN, VOCAB))


def per_op_us(step, x, links: int = 30, repeats: int = 15, compiled: bool = False) -> float:
    """Median microseconds per link of a chain of `links` dependent calls of step; compiled:
    the chain under mx.compile, so no Python builds the links and what is left is MLX's
    evaluation of each operation and the device's work."""

    def chain(v):
        for _ in range(links):
            v = step(v)
        return v

    run = mx.compile(chain) if compiled else chain
    mx.eval(run(x))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(run(x))
        samples.append((time.perf_counter() - start) / links)
    return round(1e6 * statistics.median(samples), 1)


def products(dtype, rows: int) -> dict:
    up = mx.random.normal((MLP, HIDDEN)).astype(dtype) * 0.02
    down = mx.random.normal((HIDDEN, MLP)).astype(dtype) * 0.02
    qup, qdown = mx.quantize(up, 32, 4), mx.quantize(down, 32, 4)
    x = mx.random.normal((rows, HIDDEN)).astype(dtype)
    mx.eval(up, down, qup, qdown, x)

    def plain(v):
        return (v @ up.T) @ down.T

    def one_row_each(v):
        return ((v[:, None] @ up.T) @ down.T)[:, 0]

    def quantized(v):
        h = mx.quantized_matmul(v, *qup, transpose=True, group_size=32, bits=4)
        return mx.quantized_matmul(h, *qdown, transpose=True, group_size=32, bits=4)

    def quantized_one_row_each(v):
        return quantized(v[:, None])[:, 0]

    def few(v):
        return few_rows.product(few_rows.product(v, up), down)

    variants = [("matmul", plain), ("matmul_rowwise", one_row_each),
                ("qmm", quantized), ("qmm_rowwise", quantized_one_row_each)]  # fmt: skip
    if few_rows.runs_here() and few_rows.fits(rows, x, up):
        variants.append(("few_rows", few))
    times = {name: per_op_us(fn, x) / 2 for name, fn in variants}  # two products a link
    compiled = [("matmul", plain)] + [v for v in variants if v[0] == "few_rows"]
    for name, fn in compiled:
        times[f"{name}_compiled"] = per_op_us(fn, x, compiled=True) / 2
    return times


def few_rows_exact(dtype, rows: int) -> tuple[int, int, float]:
    """(rows equal bit for bit to one-row products, rows compared, max |difference|) over
    SHAPES, for `rows` rows of the few-row kernel."""
    equal = compared = 0
    worst = 0.0
    for cols, outputs in SHAPES:
        weight = mx.random.normal((outputs, cols)).astype(dtype) * 0.02
        x = mx.random.normal((rows, cols)).astype(dtype)
        few = few_rows.product(x, weight)
        alone = mx.concatenate([x[t : t + 1] @ weight.T for t in range(rows)])
        mx.eval(few, alone)
        same = mx.all(few == alone, axis=-1)
        equal += int(mx.sum(same).item())
        compared += rows
        worst = max(worst, float(mx.max(mx.abs(few - alone)).item()))
    return equal, compared, worst


def attention(dtype, rows: int) -> dict:
    keys = mx.random.normal((1, KV_HEADS, CONTEXT + rows, HEAD_DIM)).astype(dtype)
    values = mx.random.normal((1, KV_HEADS, CONTEXT + rows, HEAD_DIM)).astype(dtype)
    q = mx.random.normal((1, HEADS, rows, HEAD_DIM)).astype(dtype)
    mx.eval(keys, values, q)
    scale = HEAD_DIM**-0.5
    mask = None if rows == 1 else "causal"

    def fused(v):
        return mx.fast.scaled_dot_product_attention(v, keys, values, scale=scale, mask=mask)

    seen = mx.arange(CONTEXT + rows)[None] <= (CONTEXT + mx.arange(rows))[:, None]

    def written(v):
        g = (v * scale).reshape(1, KV_HEADS, HEADS // KV_HEADS * rows, HEAD_DIM)
        s = (g @ keys.swapaxes(-1, -2)).reshape(1, KV_HEADS, HEADS // KV_HEADS, rows, -1)
        s = mx.where(seen, s, -mx.inf)
        p = mx.softmax(s, axis=-1, precise=True).reshape(1, KV_HEADS, -1, CONTEXT + rows)
        return (p @ values).reshape(1, HEADS, rows, HEAD_DIM)

    times = {"sdpa": per_op_us(fused, q), "sdpa_written": per_op_us(written, q)}
    if row_attention.runs_here(HEAD_DIM) and row_attention.fits(q, keys, CONTEXT):

        def one_launch(v):
            return row_attention.attend(v, keys, values, scale)

        times["row_attention"] = per_op_us(one_launch, q)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    table = {}
    for rows in args.rows:
        table[rows] = products(dtype, rows) | attention(dtype, rows)
        print(
            f"{args.dtype} T={rows:>2}: "
            + "  ".join(f"{k} {v:7.1f} us" for k, v in table[rows].items())
        )
    if few_rows.runs_here():
        for rows in args.rows:
            if rows > 1:
                equal, compared, worst = few_rows_exact(dtype, rows)
                table[rows]["few_rows_equal_rows"] = [equal, compared]
                print(f"few-row kernel T={rows:>2}: {equal}/{compared} rows equal to one-row "
                      f"products bit for bit, max |difference| {worst:.3g}")  # fmt: skip
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": str(mx.default_device()), "dtype": args.dtype, "us": table}, f)


if __name__ == "__main__":
    main()
