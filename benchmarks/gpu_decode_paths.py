"""Plain decoding through each layer of the verifier, in one process, against mlx-lm's own loop.

Finds where drafting-off loses speed without gRPC in the way: mlx-lm's generate_step, then the
verifier engine's decode bursts (with and without the look-ahead), on the calling thread and on
the MLX worker thread the services use, with the model's own forwards and with row-by-row ones.

    python benchmarks/gpu_decode_paths.py [--model DIR] [--dtype float32] [--context 512]
        [--tokens 128] [--burst 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from coordinator.bench import plain_decode
from specd import mlx_settings
from specd.models.load import device_kind, load_target
from specd.service import MlxThread
from verifier_svc.engine import Target, decode, prefill


def engine_rate(target: Target, prompt: list[int], tokens: int, burst: int, ahead: bool, run):
    """tok/s of decode bursts after a prefill; run(fn) runs one burst where it should."""
    session = prefill(target, prompt).session
    done = 1
    start = time.perf_counter()
    while done < tokens:
        steps = min(burst, tokens - done)
        done += len(run(lambda s=steps: decode(target, session, s, look_ahead=ahead)).committed)
    return (tokens - 1) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="target (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--burst", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    mlx_settings.apply()  # as the services run: full float32, specd's kernel cache

    loaded = load_target(args.model, args.dtype)
    prompt = [(17 * i + 3) % 1000 + 100 for i in range(args.context)]
    eos = set()
    worker = MlxThread(inline_rounds=False)

    def on_worker(fn):
        return worker.submit(fn).result()

    def here(fn):
        return fn()

    def best(fn) -> float:
        return max(fn() for _ in range(args.repeats))

    def mlx_lm() -> float:
        base = plain_decode(loaded.model, prompt, args.tokens, eos)
        return len(base.token_ids) / base.seconds

    print(f"device {device_kind()}, {loaded.dtype}, context {args.context}, {args.tokens} "
          f"tokens, bursts of {args.burst}; best of {args.repeats}, tok/s")  # fmt: skip
    print(f"  mlx-lm generate_step (this thread)      {best(mlx_lm):8.1f}")
    print(f"  mlx-lm generate_step (MLX worker)       {on_worker(lambda: best(mlx_lm)):8.1f}")
    for rows in (False, True):
        target = Target(load_target(args.model, args.dtype), gemv_rows=0, row_forwards=rows)
        for ahead in (False, True):
            for place, run in (("this thread", here), ("MLX worker", on_worker)):
                rate = best(
                    lambda t=target, a=ahead, r=run: engine_rate(
                        t, prompt, args.tokens, args.burst, a, r
                    )
                )
                name = f"engine{' rows' if rows else ''}{' look-ahead' if ahead else ''}"
                print(f"  {name:<24} ({place:<11})  {rate:8.1f}")
        del target
        mx.clear_cache()
    worker.shutdown()


if __name__ == "__main__":
    main()
