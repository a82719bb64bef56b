"""What a sampled session's draw costs the verifier's step, in one process: a pooled step's
logits for N sessions (the target's forward over N prompts' last tokens), copied to the host a
row at a time and all at once (the served copy on a GPU, `verifier_svc.engine._drawn_rows`),
then per row the host's draw (`target_distribution` and `sample`: filtered sampling, verifies
with drafts, every draw on a CPU), and the step's draws made together by MLX
(`verifier_svc.device_draws`: a GPU's plain steps sampling by temperature alone), median ms a
row and a step of N rows.
--compare FILE times a second `verifier_svc/sampling.py`'s host draws beside (`git show
REV:verifier_svc/sampling.py > FILE`), on the same rows.

    python benchmarks/sampled_draws.py [--target MODEL] [--rows 64] [--temperature 0.7]
        [--top-p 0] [--repeats 5] [--compare FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from specd.argtypes import positive_float, positive_int
from specd.models.load import load_target
from verifier_svc import sampling
from verifier_svc.device_draws import draw
from verifier_svc.engine import _drawn_rows


def _module_from(path: str):
    spec = importlib.util.spec_from_file_location("sampling_compared", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def _step_logits(model, rows: int) -> mx.array:
    """[rows, V]: the last position of `rows` short prompts, evaluated on the device."""
    rng = np.random.default_rng(0)
    prompts = mx.array(rng.integers(100, 5000, size=(rows, 16)), dtype=mx.int32)
    logits = model(prompts)[:, -1, :]
    mx.eval(logits)
    return logits


def _time_copies(logits: mx.array, repeats: int) -> tuple[float, float]:
    """Median ms a row of the copy to the host: a row at a time, and the step's rows at once."""
    rows = [logits[i : i + 1] for i in range(logits.shape[0])]
    one_by_one, together = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for row in rows:
            np.array(row.astype(mx.float32))
        one_by_one.append(1e3 * (time.perf_counter() - start) / len(rows))
        start = time.perf_counter()
        on_device, to_host = _drawn_rows(rows, [False] * len(rows), join=True)
        mx.eval(on_device)
        to_host()
        together.append(1e3 * (time.perf_counter() - start) / len(rows))
    return statistics.median(one_by_one), statistics.median(together)


def _time_device_draws(logits: mx.array, temperature: float, repeats: int) -> float:
    """Median ms a row of the step's draws made together by MLX, its tokens read back."""
    rows = logits.shape[0]
    temperatures = mx.full((rows,), temperature, dtype=mx.float32)
    times = []
    for repeat in range(repeats):
        uniforms = mx.array(np.random.default_rng(repeat).random(rows), dtype=mx.float32)
        start = time.perf_counter()
        np.array(draw(logits, temperatures, uniforms))
        times.append(1e3 * (time.perf_counter() - start) / rows)
    return statistics.median(times)


def _time_draws(module, host_rows: np.ndarray, cfg, repeats: int) -> float:
    """Median ms a row of the draw, over `repeats` steps."""
    draws = []
    for repeat in range(repeats):
        generator = np.random.default_rng(repeat)
        start = time.perf_counter()
        for row in host_rows:
            module.sample(module.target_distribution(row, cfg), generator)
        draws.append(1e3 * (time.perf_counter() - start) / len(host_rows))
    return statistics.median(draws)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", type=positive_int, default=64)
    parser.add_argument("--temperature", type=positive_float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.0)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--compare", default=None, help="another sampling.py, timed beside")
    args = parser.parse_args()
    target = load_target(args.target, args.dtype)
    logits = _step_logits(target.model, args.rows)
    print(f"{args.rows} rows of {logits.shape[1]} logits on {mx.default_device()}, "
          f"temperature {args.temperature}, top-p {args.top_p}")  # fmt: skip
    by_row, at_once = _time_copies(logits, args.repeats)
    print(f"copy to the host: {by_row:.3f} ms a row one by one, {at_once:.3f} ms a row the "
          f"step at once (served on a GPU); a step {args.rows * by_row:.1f} against "
          f"{args.rows * at_once:.1f} ms")  # fmt: skip
    if args.top_p == 0:
        on_device = _time_device_draws(logits, args.temperature, args.repeats)
        print(f"drawn together by MLX (served on a GPU): {on_device:.3f} ms a row; a step of "
              f"{args.rows} rows {args.rows * on_device:.1f} ms")  # fmt: skip
    host_rows = np.array(logits.astype(mx.float32))
    modules = [("served", sampling)]
    if args.compare:
        modules.append((args.compare, _module_from(args.compare)))
    for name, module in modules:
        config = module.SamplingConfig(args.temperature, top_p=args.top_p)
        draw_ms = _time_draws(module, host_rows, config, args.repeats)
        print(f"{name}: a row's draw {draw_ms:.3f} ms; a step of {args.rows} rows "
              f"{args.rows * (at_once + draw_ms):.1f} ms with the copy at once")  # fmt: skip


if __name__ == "__main__":
    main()
