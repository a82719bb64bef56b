"""Decode step and k-token verify step of the target against the memory floor of this machine.

floor = bytes of weights read per step / measured memory bandwidth (a large numpy copy).

    python benchmarks/step_floor.py [--model MODEL] [--dtype auto] [--context 300]
        [--k 0 1 3 7 15] [--gemv-rows N [N ...]] [--weights half float32]

Each setting (gemv rows x weight storage) has its own floor: half-stored weights are half the
bytes. The float32 floor is printed too, the one a float32 copy of the model would have.
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


def step_times(targets: list, sessions: list, sizes: list[int], repeats: int = 15) -> dict:
    """Median ms per (setting, tokens); settings alternate step by step, so a slow spell of
    the host lands on all of them."""
    times: dict = {}
    for _ in range(repeats):
        for n in sizes:
            for i, (target, session) in enumerate(zip(targets, sessions, strict=True)):
                base = session.cache[0].offset
                start = time.perf_counter()
                logits, _ = target.forward(mx.array([7] * n), session.cache)
                mx.eval(logits)
                times.setdefault((i, n), []).append(time.perf_counter() - start)
                _rollback(session.cache, base)
    return {key: 1000 * sorted(v)[len(v) // 2] for key, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--context", type=int, default=300, help="tokens already in the cache")
    parser.add_argument("--k", type=int, nargs="+", default=[0, 1, 3, 7, 15])
    parser.add_argument(
        "--gemv-rows",
        type=int,
        nargs="+",
        default=[None],
        help="forwards of <= N tokens on numpy (0: all MLX); several: compared step by step",
    )
    parser.add_argument(
        "--weights",
        nargs="+",
        choices=["half", "float32"],
        default=["half"],
        help="weight storage with numpy forwards: half where float16 holds them exactly "
        "(the verifier's default) or float32 (its --float32-weights); several: compared",
    )
    args = parser.parse_args()
    targets = [
        Target(load_target(args.model, args.dtype, half_weights=storage == "half"), rows)
        for rows in args.gemv_rows
        for storage in (args.weights if rows != 0 else ["float32"])
    ]
    prompt = list(range(100, 100 + args.context))
    sessions = [prefill(target, prompt).session for target in targets]
    gbs = bandwidth_gbs()
    float32_bytes = sum(v.size * 4 for _, v in tree_flatten(targets[0].model.parameters()))
    sizes = [k + 1 for k in args.k]
    medians = step_times(targets, sessions, sizes)
    settings = []
    for i, target in enumerate(targets):
        weights = sum(v.nbytes for _, v in tree_flatten(target.model.parameters()))
        floor_ms = weights / (gbs * 1e9) * 1000
        rows = [
            {"tokens": n, "ms": medians[i, n], "floor_ratio": medians[i, n] / floor_ms}
            for n in sizes
        ]
        settings.append(
            {
                "gemv_rows": target.gemv_rows,
                "half_weights": target.half_weights,
                "weight_bytes": weights,
                "floor_ms": floor_ms,
                "steps": rows,
            }
        )
    result = {
        "model": targets[0].identity.name,
        "dtype": targets[0].loaded.dtype,
        "bandwidth_gbs": gbs,
        "float32_floor_ms": float32_bytes / (gbs * 1e9) * 1000,
        "context": args.context,
        "settings": settings,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
