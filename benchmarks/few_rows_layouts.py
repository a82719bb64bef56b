"""The few-row kernel's layouts (specd.models.few_rows.LAYOUTS) against each other on a CUDA GPU.

For each layout and row count: microseconds a product in compiled chains (no Python a product)
of a decoder layer's four products at the embedded model's sizes (q/k/v joined 576 -> 960, o
576 -> 576, gate/up joined 576 -> 3072, down 1536 -> 576; the slices between them are copies,
the same for every layout), of the up and down pair alone (run AG's figure), and of the logits
(576 -> 49152); MLX's own product (cuBLAS) of the same rows and one row's matrix-vector product
beside them. Then whether every row equals one-row products bit for bit at each shape: a layout
that does not is not one the verifier may use (its verifies would not be decode steps).

    python benchmarks/few_rows_layouts.py [--dtype float32] [--rows 2 3 4 8 16]
        [--layouts auto whole t2 ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
from gpu_ops import per_op_us  # this directory

from specd.models import few_rows

HIDDEN, MLP, QKV, VOCAB = 576, 1536, 960, 49152
# (in, out) of each product
SHAPES = {
    "qkv": (HIDDEN, QKV),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (HIDDEN, 2 * MLP),
    "down": (MLP, HIDDEN),
    "logits": (HIDDEN, VOCAB),
}


def weights(dtype) -> dict[str, mx.array]:
    made = {
        name: (mx.random.normal((outputs, cols)) * 0.02).astype(dtype)
        for name, (cols, outputs) in SHAPES.items()
    }
    made["up"] = (mx.random.normal((MLP, HIDDEN)) * 0.02).astype(dtype)
    mx.eval(list(made.values()))
    return made


def timings(w: dict[str, mx.array], rows: int, multiply) -> dict[str, float]:
    """µs a product: a layer's four (the mean), the up/down pair's two, the logits."""

    def layer(v):
        qkv = multiply(v, w["qkv"])
        h = multiply(qkv[:, :HIDDEN], w["o"])
        gate_up = multiply(h, w["gate_up"])
        return multiply(gate_up[:, :MLP], w["down"])

    def pair(v):
        return multiply(multiply(v, w["up"]), w["down"])

    def logits(v):
        return multiply(v, w["logits"])[:, :HIDDEN]

    x = mx.random.normal((rows, HIDDEN)).astype(w["o"].dtype)
    return {
        "layer": per_op_us(layer, x, compiled=True) / 4,
        "pair": per_op_us(pair, x, compiled=True) / 2,
        "logits": per_op_us(logits, x, compiled=True),
    }


def exact(w: dict[str, mx.array], rows: int) -> tuple[int, int, float]:
    """(rows equal to one-row products bit for bit, rows compared, max |difference|)."""
    equal = compared = 0
    worst = 0.0
    for name, weight in w.items():
        if name == "up":
            continue  # the pair's; the shapes are the layer's and the logits'
        x = mx.random.normal((rows, weight.shape[1])).astype(weight.dtype)
        few = few_rows.product(x, weight)
        alone = mx.concatenate([x[t : t + 1] @ weight.T for t in range(rows)])
        mx.eval(few, alone)
        equal += int(mx.sum(mx.all(few == alone, axis=-1)).item())
        compared += rows
        worst = max(worst, float(mx.max(mx.abs(few - alone)).item()))
    return equal, compared, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 3, 4, 8, 16])
    parser.add_argument("--layouts", nargs="+", default=["auto", *few_rows.LAYOUTS])
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args()
    if not few_rows.runs_here():
        raise SystemExit("the few-row kernel runs on MLX's CUDA backend only")
    w = weights(getattr(mx, args.dtype))
    table: dict = {"one_row": timings(w, 1, lambda v, m: v @ m.T)}
    print(f"{args.dtype}, µs a product (a layer's four / the up-down pair / the logits)")
    print(f"  one row, MLX        {_cells(table['one_row'])}")
    for rows in args.rows:
        table[rows] = {"matmul": timings(w, rows, lambda v, m: v @ m.T)}
        print(f"{rows:>2} rows, MLX (cuBLAS) {_cells(table[rows]['matmul'])}")
        for name in args.layouts:
            layout = few_rows.LAYOUTS.get(name)
            if layout is not None and not layout.row_tile and rows > few_rows.MAX_ROWS:
                continue
            few_rows.use(name)
            equal, compared, worst = exact(w, rows)
            times = timings(w, rows, few_rows.product)
            table[rows][name] = times | {"equal_rows": [equal, compared], "worst": worst}
            print(f"   {name:<17} {_cells(times)}   {equal}/{compared} rows equal to one-row "
                  f"products, max |difference| {worst:.3g}")  # fmt: skip
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": str(mx.default_device()), "dtype": args.dtype, "us": table}, f)


def _cells(times: dict[str, float]) -> str:
    return " / ".join(f"{times[k]:6.1f}" for k in ("layer", "pair", "logits"))


if __name__ == "__main__":
    main()
