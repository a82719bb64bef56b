"""Time only the weight products of one target forward (every 2-D parameter, M input rows),
to see how much of a decode or verify step is BLAS; MLX's products (`ms`) beside the
numpy gemv products the verifier uses for few-row forwards (`gemv_ms`).

    python -m specd.platform exec -- python benchmarks/matmul_chain.py [--rows 1 2 4 8 16]
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from specd.cpu.gemv import GemvWeights
from specd.models.load import load_target


def median_ms(fn, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[repeats // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    weights = [w for _, w in tree_flatten(load_target(args.model, "float32").model.parameters())
               if w.ndim == 2]  # fmt: skip
    views = [GemvWeights(np.asarray(w), None, 1 << 30) for w in weights]
    result = {"products": len(weights), "ms": {}, "gemv_ms": {}}
    for rows in args.rows:
        inputs = {w.shape[1]: mx.ones((rows, w.shape[1])) for w in weights}

        def products(inputs=inputs):
            for w in weights:
                mx.eval(inputs[w.shape[1]] @ w.T)  # one at a time, as a forward issues them

        def gemv_products(inputs=inputs):  # the verifier's --gemv-rows path, any row count
            for view in views:
                mx.eval(view.products(inputs[view.weight.shape[1]]))

        result["ms"][rows] = round(median_ms(products), 1)
        result["gemv_ms"][rows] = round(median_ms(gemv_products), 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
