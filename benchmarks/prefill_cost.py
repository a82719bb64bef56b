"""A prompt's prefill as plain mlx-lm runs it against the verifier engine's, in one process.

mlx-lm's cost is the time to its first token from `generate_step`; the engine's is `prefill`
(all but the last token in chunks, then the last, the first token chosen) on the target as the
verifier serves it. The prompts are a question set's first turns in the chat template; each is
prefilled by both, `--rounds` times in alternating order, after one untimed pass over all of
them (first use of a shape compiles on a GPU). Median ms per prompt and the ratio.

    python benchmarks/prefill_cost.py [--questions input-grounded] [--every 4] [--rounds 3]
        [--dtype float32] [--verifier-args "--row-forwards off"]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import time

import mlx.core as mx
from call_overhead import as_served
from mlx_lm.generate import generate_step

from specd.datasets import load_questions
from specd.models.load import load_target
from specd.prompts import encode_chat
from verifier_svc.engine import prefill


def mlx_lm_first_token(model, prompt_ids: list[int]) -> float:
    start = time.perf_counter()
    token, _ = next(generate_step(mx.array(prompt_ids), model, max_tokens=1))
    int(token)
    return time.perf_counter() - start


def engine_first_token(target, prompt_ids: list[int]) -> float:
    start = time.perf_counter()
    prefill(target, prompt_ids)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", help="model (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--questions", default="input-grounded")
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--verifier-args", default="", help="verifier flags for the engine's target")
    args = p.parse_args()
    plain = load_target(args.target, args.dtype)
    served, _ = as_served(args.target, args.dtype, shlex.split(args.verifier_args))
    prompts = [
        encode_chat(plain.tokenizer, [{"role": "user", "content": q.turns[0]}])
        for q in load_questions(args.questions)[:: args.every]
    ]
    sides = {
        "mlx-lm": lambda ids: mlx_lm_first_token(plain.model, ids),
        "engine": lambda ids: engine_first_token(served, ids),
    }
    for ids in prompts:  # untimed: compiles every shape both meet
        for run in sides.values():
            run(ids)
    times = {name: [[] for _ in prompts] for name in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for i, ids in enumerate(prompts):
            for name in order:
                times[name][i].append(sides[name](ids))
    print(f"device {mx.default_device()}, dtype {args.dtype}, {len(prompts)} prompts")
    print(f"{'tokens':>7}{'mlx-lm ms':>11}{'engine ms':>11}{'engine/mlx-lm':>15}")
    ratios = []
    for i, ids in enumerate(prompts):
        a = 1000 * statistics.median(times["mlx-lm"][i])
        b = 1000 * statistics.median(times["engine"][i])
        ratios.append(b / a)
        print(f"{len(ids):>7}{a:>11.2f}{b:>11.2f}{b / a:>14.2f}x")
    print(f"median ratio {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
