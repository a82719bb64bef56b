"""Time the compiled row kernels on the embedded model's weight shapes, streamed from memory.

One pass multiplies N input rows with every weight of a 30-layer SmolLM2-135M-shaped stack
(q, k, v, o, gate, up, down) and its 49,152-row output head, float16 as the verifier holds them:
~270 MB, far past the caches, so each pass reads the weights from memory as a verify does. The
best of --passes per row count. Builds of the kernels are compared in one run by giving their
shared objects (build one with `python setup.py build_ext --inplace` and copy
specd/cpu/_row_kernels*.so away); each build runs in its own process, alternating, --trials
times.

Without --kernels it times the installed build twice in one process, passes alternating:
the weights as stored and paired (specd.cpu.row_products.pair_rows, where the CPU has
AVX2 and F16C), and prints both.

    python benchmarks/row_kernels.py [--rows 1 2 4 8 16] [--kernels A.so B.so] [--trials 3]
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HIDDEN, KV, MLP, LAYERS, VOCAB = 576, 192, 1536, 30, 49152


def weights(rng) -> list[np.ndarray]:
    layer = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (MLP, HIDDEN),
             (MLP, HIDDEN), (HIDDEN, MLP)]  # fmt: skip
    shapes = layer * LAYERS + [(VOCAB, HIDDEN)]
    return [(rng.standard_normal(s, dtype=np.float32) * 0.02).astype(np.float16) for s in shapes]


def use_build(path: str) -> None:
    """Load the kernels from `path` in place of the installed ones."""
    import specd.cpu.row_products as row_products

    name = "specd.cpu._row_kernels"
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    row_products._row_kernels = module


def runs_of_builds(
    script: str, builds: list[str], trials: int, args: list[str]
) -> dict[str, list[dict[int, float]]]:
    """Each build timed by `script --one BUILD ARGS` in a process of its own, the builds
    alternating, `trials` times: per build, each trial's {size: ms} (the child's JSON)."""
    runs: dict[str, list[dict[int, float]]] = {path: [] for path in builds}
    for _ in range(trials):
        for path in builds:
            child = [sys.executable, script, "--one", path, *args]
            out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
            runs[path].append({int(k): v for k, v in json.loads(out).items()})
    return runs


def time_rows(rows: list[int], passes: int, layouts=("stored",)) -> dict[str, dict[int, float]]:
    """Best ms per pass over the stack for each row count, per layout ("stored", "paired"),
    the layouts' passes alternating."""
    from specd.cpu.row_products import compiled, pair_rows, row_products

    if not compiled():
        raise SystemExit("the row kernels are not built here: pip install -e . with a C compiler")
    rng = np.random.default_rng(0)
    stack = weights(rng)
    pairs = {"stored": [None] * len(stack)}
    if "paired" in layouts:
        pairs["paired"] = [pair_rows(w) for w in stack]
    best: dict[str, dict[int, float]] = {layout: {} for layout in pairs}
    for n in rows:
        inputs = {w: rng.standard_normal((n, w), dtype=np.float32) for w in (HIDDEN, MLP)}
        times: dict[str, list[float]] = {layout: [] for layout in pairs}
        for _ in range(passes):
            for layout, paired in pairs.items():
                start = time.perf_counter()
                for weight, pair in zip(stack, paired, strict=True):
                    row_products(weight, inputs[weight.shape[1]], pair)
                times[layout].append(time.perf_counter() - start)
        for layout in pairs:
            best[layout][n] = 1000 * min(times[layout])
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--passes", type=int, default=7, help="passes per row count; the best")
    parser.add_argument("--kernels", nargs="+", metavar="SO", help="builds to compare")
    parser.add_argument("--trials", type=int, default=3, help="alternations of the builds")
    parser.add_argument("--one", metavar="SO", help=argparse.SUPPRESS)  # a child's build
    args = parser.parse_args()
    if args.one:
        use_build(args.one)
        print(json.dumps(time_rows(args.rows, args.passes)["stored"]))
        return
    if not args.kernels:
        from specd.cpu.row_products import pairs_supported

        layouts = ("stored", "paired") if pairs_supported() else ("stored",)
        best = time_rows(args.rows, args.passes, layouts)
        print("ms per pass over the weights (best of the passes): " + ", ".join(layouts))
        for n in args.rows:
            print(f"{n:4d}  " + "  ".join(f"{best[layout][n]:8.1f}" for layout in layouts))
        return
    sizes = ["--passes", str(args.passes), "--rows", *map(str, args.rows)]
    runs = runs_of_builds(__file__, args.kernels, args.trials, sizes)
    print("ms per pass over the weights (median of the trials' best):")
    print("rows  " + "  ".join(f"{Path(path).name[-24:]:>24}" for path in args.kernels))
    for n in args.rows:
        cells = [float(np.median([run[n] for run in runs[path]])) for path in args.kernels]
        print(f"{n:4d}  " + "  ".join(f"{c:24.1f}" for c in cells))


if __name__ == "__main__":
    main()
