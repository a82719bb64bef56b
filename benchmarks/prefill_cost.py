"""A prompt's prefill as plain mlx-lm runs it against the verifier engine's, in one process.

mlx-lm's cost is the time to its first token from `generate_step`; the engine's is `prefill`
(all but the last token in chunks, then the last, the first token chosen) on the target as the
verifier serves it. The prompts are a question set's first turns in the chat template; each is
prefilled by both, `--rounds` times in alternating order, after one untimed pass over all of
them (first use of a shape compiles on a GPU). Median ms per prompt and the ratio.

With `--group N`, consecutive prompts in groups of N as a verifier meets prompts that arrive
together: the engine's `prefill_many` of the group in one job (its pooled sessions' shared
forwards, where the target pools them) against the same prompts' prefills one by one and
mlx-lm's first tokens one by one; median ms per group.

    python benchmarks/prefill_cost.py [--questions input-grounded] [--every 4] [--rounds 3]
        [--dtype float32] [--verifier-args "--row-forwards off"] [--group 5]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import time

import mlx.core as mx
from call_overhead import as_served
from mlx_lm.generate import generate_step

from specd.argtypes import positive_int
from specd.datasets import load_questions
from specd.models.load import load_target
from specd.prompts import encode_chat
from verifier_svc.engine import PromptToPrefill, prefill, prefill_many


def mlx_lm_first_token(model, prompt_ids: list[int]) -> float:
    start = time.perf_counter()
    token, _ = next(generate_step(mx.array(prompt_ids), model, max_tokens=1))
    int(token)
    return time.perf_counter() - start


def engine_first_token(target, prompt_ids: list[int]) -> float:
    start = time.perf_counter()
    prefill(target, prompt_ids)
    return time.perf_counter() - start


def engine_together(target, group: list[list[int]]) -> float:
    start = time.perf_counter()
    for result in prefill_many(target, [PromptToPrefill(ids) for ids in group]):
        if isinstance(result, Exception):
            raise result
    return time.perf_counter() - start


def one_by_one(run):
    """A side that takes a group of prompts as `run` takes each, one after the other."""
    return lambda group: sum(run(ids) for ids in group)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", help="model (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--questions", default="input-grounded")
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--verifier-args", default="", help="verifier flags for the engine's target")
    p.add_argument("--group", type=positive_int, default=1,
                   help="prompts arriving together (default 1: each alone)")  # fmt: skip
    args = p.parse_args()
    plain = load_target(args.target, args.dtype)
    served, _ = as_served(args.target, args.dtype, shlex.split(args.verifier_args))
    prompts = [
        encode_chat(plain.tokenizer, [{"role": "user", "content": q.turns[0]}])
        for q in load_questions(args.questions)[:: args.every]
    ]
    if args.group == 1:
        units = [[ids] for ids in prompts]
        sides = {
            "mlx-lm": lambda group: mlx_lm_first_token(plain.model, group[0]),
            "engine": lambda group: engine_first_token(served, group[0]),
        }
    else:
        units = [prompts[i : i + args.group] for i in range(0, len(prompts), args.group)]
        sides = {
            "mlx-lm": one_by_one(lambda ids: mlx_lm_first_token(plain.model, ids)),
            "engine": one_by_one(lambda ids: engine_first_token(served, ids)),
            "together": lambda group: engine_together(served, group),
        }
    for unit in units:  # untimed: compiles every shape the sides meet
        for run in sides.values():
            run(unit)
    times = {name: [[] for _ in units] for name in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for i, unit in enumerate(units):
            for name in order:
                times[name][i].append(sides[name](unit))
    grouped = ""
    if args.group > 1:
        grouped = f" in groups of {args.group} (sessions pooled: {served.kv_pool is not None})"
    print(f"device {mx.default_device()}, dtype {args.dtype}, {len(prompts)} prompts{grouped}")
    names = list(sides)
    header = f"{'prompts':>8}{'tokens':>8}" + "".join(f"{n + ' ms':>13}" for n in names)
    header += f"{'engine/mlx-lm':>15}" + (f"{'together/engine':>17}" if "together" in sides else "")
    print(header)
    ratios: dict[str, list[float]] = {"engine": [], "together": []}
    for i, unit in enumerate(units):
        ms = {n: 1000 * statistics.median(times[n][i]) for n in names}
        ratios["engine"].append(ms["engine"] / ms["mlx-lm"])
        line = f"{len(unit):>8}{sum(map(len, unit)):>8}" + "".join(f"{ms[n]:>13.2f}" for n in names)
        line += f"{ratios['engine'][-1]:>14.2f}x"
        if "together" in ms:
            ratios["together"].append(ms["together"] / ms["engine"])
            line += f"{ratios['together'][-1]:>16.2f}x"
        print(line)
    print(f"median engine/mlx-lm {statistics.median(ratios['engine']):.2f}x"
          + (f", together/engine {statistics.median(ratios['together']):.2f}x"
             if ratios["together"] else ""))  # fmt: skip


if __name__ == "__main__":
    main()
