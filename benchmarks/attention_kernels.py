"""Time the compiled attention of several sessions' new rows over their KV caches
(`attention_many`, one call a layer as the verifier's batched CPU step makes it), on the
embedded model's shapes: 9 query heads reading 3 KV heads of 64, 30 layers, each session's
cache of float32 keys and values --past tokens long. Builds of the kernels are compared in one
run by giving their shared objects (`python setup.py build_ext --inplace`, then copy
specd/cpu/_row_kernels*.so away); each build runs in its own process, alternating, --trials
times; without --kernels the installed build.

    python -m specd.platform exec -- python benchmarks/attention_kernels.py \\
        [--sessions 8] [--past 100 300] [--kernels A.so B.so] [--trials 2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from row_kernels import runs_of_builds, use_build

HEADS, GROUPS, DIM, LAYERS, CAPACITY = 9, 3, 64, 30, 512


def time_steps(sessions: int, past: int, repeats: int = 20) -> float:
    """Best ms over `repeats` of a step's attention: LAYERS calls of attention_many."""
    from specd.cpu.row_products import layer_kernels

    kernels = layer_kernels()
    if kernels is None:
        raise SystemExit("the kernels are not built here: pip install -e . with a C compiler")
    rng = np.random.default_rng(0)
    caches = [
        [
            rng.standard_normal((GROUPS, CAPACITY, DIM), dtype=np.float32)
            for _ in range(2 * sessions)
        ]
        for _ in range(LAYERS)
    ]
    queries = rng.standard_normal((HEADS, sessions, DIM), dtype=np.float32)
    new = rng.standard_normal((GROUPS, sessions, DIM), dtype=np.float32)
    sees, bounds = [np.ones((1, 1), bool)] * sessions, list(range(sessions + 1))
    out = np.empty((sessions, HEADS * DIM), np.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in caches:
            kernels.attention_many(queries, new, new, layer[:sessions], layer[sessions:],
                                   [past] * sessions, bounds, sees, 0.125, out)  # fmt: skip
        best = min(best, time.perf_counter() - start)
    return 1000 * best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--past", type=int, nargs="+", default=[100, 300])
    parser.add_argument("--kernels", nargs="+", metavar="SO", help="builds to compare")
    parser.add_argument("--trials", type=int, default=2, help="alternations of the builds")
    parser.add_argument("--one", metavar="SO", help=argparse.SUPPRESS)  # a child's build
    args = parser.parse_args()
    if args.past and max(args.past) >= CAPACITY:
        parser.error(f"--past must stay under the caches' {CAPACITY} tokens")
    if args.one is not None or not args.kernels:
        if args.one:
            use_build(args.one)
        times = {p: time_steps(args.sessions, p) for p in args.past}
        if args.one:
            print(json.dumps(times))
            return
        for past, ms in times.items():
            print(f"{args.sessions} sessions, {past} past tokens: {ms:.2f} ms a step")
        return
    sizes = ["--sessions", str(args.sessions), "--past", *map(str, args.past)]
    runs = runs_of_builds(__file__, args.kernels, args.trials, sizes)
    print(f"ms a step's attention, {args.sessions} sessions, {LAYERS} layers (each trial's best):")
    print("past  " + "  ".join(f"{Path(path).name[-24:]:>24}" for path in args.kernels))
    for past in args.past:
        cells = [" / ".join(f"{run[past]:.2f}" for run in runs[path]) for path in args.kernels]
        print(f"{past:4d}  " + "  ".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
