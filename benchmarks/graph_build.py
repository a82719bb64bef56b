"""Host time to build one decode step's graph: the model as mlx-lm runs it against the model
as the verifier serves it (capture wrappers, row-by-row forwards, tree RoPE), wrapper by wrapper.

On a GPU a small model's decode is launch-bound: the host builds each step's graph while the
device runs the one before, so whatever Python adds per step is added to the step whenever it
exceeds the device's time. Building needs no device work, so the figures hold on a CPU as well.
Each variant builds `--steps` one-token forwards and the greedy choice at the end of a
`--context`-token cache, timing the build alone (the evaluation that follows is not counted);
variants rotate over `--rounds` rounds; median ms per step.

    python benchmarks/graph_build.py [--dtype float32] [--context 512] [--steps 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from drafter_svc.eagle3.model import default_capture_layers
from specd.models import rowwise
from specd.models.capture import install_capture, install_tree_positions
from specd.models.load import load_target
from verifier_svc.engine import Target, _greedy_next


def plain_step(model):
    def step(token, cache):
        logits = model(token[None], cache=cache)[0]
        return _greedy_next(logits[-1:])

    return step


def served_step(target: Target, capture: tuple[int, ...] = ()):
    def step(token, cache):
        logits, rows = target.forward(token, cache, capture)
        return _greedy_next(logits) if rows is None else (_greedy_next(logits), rows)

    return step


def build_ms(step, model, context: int, steps: int) -> float:
    """Median host ms to build one step (cache filled to `context` first)."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.arange(10, 10 + context)[None], cache=cache))
    token = mx.array([11], dtype=mx.int32)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = step(token, cache)
        times.append(time.perf_counter() - start)
        mx.eval(out)
        token = out[0] if isinstance(out, tuple) else out
    return 1000 * statistics.median(times)


def variants(target_dir, dtype) -> dict:
    """name -> (step, model); each variant its own copy of the model."""

    def wrapped(*installs):
        model = load_target(target_dir, dtype).model
        for install in installs:
            install(model)
        return plain_step(model), model

    served = Target(load_target(target_dir, dtype), gemv_rows=0, row_forwards=True)
    capture = default_capture_layers(len(served.model.layers))  # what an EAGLE-3 drafter reads
    served.supports_trees(served.new_cache())  # as after a first tree verify
    return {
        "mlx-lm's model": wrapped(),
        "capture wrappers": wrapped(install_capture),
        "row-by-row wrappers": wrapped(rowwise.install),
        "capture + tree RoPE": wrapped(lambda m: install_tree_positions(m, install_capture(m))),
        "as served (MLX forwards)": (served_step(served), served.model),
        "as served, EAGLE-3's rows kept": (served_step(served, capture), served.model),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", help="model (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    built = variants(args.target, args.dtype)
    samples = {name: [] for name in built}
    names = list(built)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step, model = built[name]
            samples[name].append(build_ms(step, model, args.context, args.steps))
    base = statistics.median(samples[names[0]])
    print(f"device {mx.default_device()}, dtype {args.dtype}, context {args.context}")
    print(f"{'variant':<28}{'build ms/step':>15}{'vs mlx-lm':>11}  range")
    for name in names:
        ms = statistics.median(samples[name])
        low, high = min(samples[name]), max(samples[name])
        print(f"{name:<28}{ms:>15.3f}{ms / base:>10.2f}x  {low:.3f}-{high:.3f}")


if __name__ == "__main__":
    main()
