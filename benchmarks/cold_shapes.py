"""What a forward of a shape never seen before costs, in a fresh process.

Times the first and the second forward of each size (tokens per forward) at the end of a cache,
in the order given, and counts the files MLX's kernel cache (MLX_PTX_CACHE_DIR, else
/tmp/mlx/<version>/ptx on Linux) gained during each first call. Run it twice with the same cache
to see what the on-disk cache saves a second process.

    python benchmarks/cold_shapes.py [--model DIR] [--dtype auto] [--sizes 1 2 3 ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from specd.models.load import load_target


def kernel_cache_dir() -> Path:
    return Path(
        os.environ.get("MLX_PTX_CACHE_DIR")
        or Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--sizes", type=int, nargs="+",
        default=[1, 1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 37, 61, 100, 137, 211, 300, 512],
    )  # fmt: skip
    parser.add_argument("--context", type=int, default=64, help="tokens in the cache first")
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args()
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    start = time.perf_counter()
    loaded = load_target(args.model, args.dtype)
    model = loaded.model
    print(f"load {time.perf_counter() - start:.2f} s ({loaded.dtype})")
    cache_dir = kernel_cache_dir()
    files = lambda: len(list(cache_dir.glob("*.ptx"))) if cache_dir.is_dir() else 0  # noqa: E731
    cache = make_prompt_cache(model)
    rows = []
    for i, n in enumerate([args.context, *args.sizes]):
        block = mx.array([(37 * j + 11) % 2000 + 50 for j in range(n)])
        times = []
        before = files()
        for _ in range(2):
            t = time.perf_counter()
            mx.eval(mx.argmax(model(block[None], cache=cache)[0], axis=-1))
            times.append(time.perf_counter() - t)
            if i:  # the first block is the context: keep it
                trim_prompt_cache(cache, n)
        row = {"tokens": n, "first_ms": 1000 * times[0], "second_ms": 1000 * times[1],
               "new_kernel_files": files() - before}  # fmt: skip
        rows.append(row)
        print(
            f"{'context' if i == 0 else 'tokens':>8} {n:>4}: first {row['first_ms']:9.1f} ms, "
            f"second {row['second_ms']:7.2f} ms, new kernel files {row['new_kernel_files']}"
        )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"cache_dir": str(cache_dir), "rows": rows}))


if __name__ == "__main__":
    main()
