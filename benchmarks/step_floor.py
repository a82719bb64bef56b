"""Decode step and k-token verify step of the target against the memory floor of this machine.

floor = bytes of weights read per step / measured memory bandwidth (a large numpy copy).

    python benchmarks/step_floor.py [--model MODEL] [--dtype auto] [--context 300]
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from specd.models.load import load_target
from verifier_svc.engine import Target, _rollback, prefill


def bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """Read + write bandwidth of a large copy, best of `repeats`."""
    src = np.ones(megabytes * 2**20 // 8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9


def step_ms(target: Target, session, n: int, repeats: int = 15) -> float:
    base = session.cache[0].offset
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        logits, _ = target.forward(mx.array([7] * n), session.cache)
        mx.eval(logits)
        times.append(time.perf_counter() - start)
        _rollback(session.cache, base)
    return 1000 * sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--context", type=int, default=300, help="tokens already in the cache")
    parser.add_argument("--k", type=int, nargs="+", default=[0, 1, 3, 7, 15])
    parser.add_argument(
        "--gemv-rows", type=int, help="numpy gemv for forwards of <= N tokens (0: all MLX)"
    )
    args = parser.parse_args()
    target = Target(load_target(args.model, args.dtype), args.gemv_rows)
    weights = sum(v.nbytes for _, v in tree_flatten(target.model.parameters()))
    session = prefill(target, list(range(100, 100 + args.context))).session
    gbs = bandwidth_gbs()
    floor_ms = weights / (gbs * 1e9) * 1000
    rows = [{"tokens": k + 1, "ms": step_ms(target, session, k + 1)} for k in args.k]
    for row in rows:
        row["floor_ratio"] = row["ms"] / floor_ms
    result = {
        "model": target.identity.name,
        "dtype": target.loaded.dtype,
        "weight_bytes": weights,
        "bandwidth_gbs": gbs,
        "floor_ms": floor_ms,
        "context": args.context,
        "gemv_rows": target.gemv_rows,
        "steps": rows,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
