"""Choose the n-gram drafter's defaults by measurement: k, min_n, max_n swept in one process.

Runs the round loop in-process (no RPC) on the embedded target, every configuration on the
same prompts, next to k=0 (plain decoding through the same engine), and prints tok/s ratios.

    python benchmarks/sweep_ngram.py --questions mt-bench --limit 16 --max-tokens 96
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time

from coordinator.local import LocalDrafter, LocalVerifier
from coordinator.rounds import Plan, RoundStats, run_rounds
from drafter_svc.ngram import NgramConfig, NgramProposer
from specd.datasets import load_questions
from specd.models.load import load_target
from specd.prompts import encode_chat
from verifier_svc.engine import Target, half_weights_pay


async def generate(verifier, drafter, prompt, plan):
    stats = RoundStats()
    async for _ in run_rounds(verifier, drafter, prompt, plan, stats):
        pass
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", action="append", required=True)
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", default="4,8,12")
    parser.add_argument("--max-n", default="3,4")
    parser.add_argument("--min-n", default="1,2")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()

    target = Target(load_target(None, "auto", half_weights=half_weights_pay("auto", None)))
    prompts = []
    for spec in args.questions:
        questions = load_questions(spec)
        step = max(1, len(questions) // args.limit)  # evenly spaced: every category gets a say
        for q in questions[::step][: args.limit]:
            prompts.append(
                encode_chat(target.loaded.tokenizer, [{"role": "user", "content": q.turns[0]}])
            )
    verifier = LocalVerifier(target)
    configs = [(0, 1, 1)] + [  # (k, min_n, max_n); k=0 is plain decoding
        (k, min_n, max_n)
        for k, min_n, max_n in itertools.product(
            *(map(int, s.split(",")) for s in (args.k, args.min_n, args.max_n))
        )
        if min_n <= max_n
    ]
    asyncio.run(generate(verifier, None, prompts[0], Plan(8, 0)))  # warm-up
    totals = {c: [0, 0, 0, 0.0] for c in configs}  # tokens, rounds, accepted, seconds
    drafters = {c: LocalDrafter(NgramProposer(NgramConfig(*c))) if c[0] else None for c in configs}
    # every prompt runs under every configuration back to back, so machine noise hits all alike
    for i, prompt in enumerate(prompts):
        for config in configs:
            start = time.perf_counter()
            s = asyncio.run(
                generate(verifier, drafters[config], prompt, Plan(args.max_tokens, config[0]))
            )
            t = totals[config]
            t[0], t[1], t[2] = t[0] + s.generated_tokens, t[1] + s.rounds, t[2] + s.accepted
            t[3] += time.perf_counter() - start
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    results = []
    base = totals[configs[0]][0] / totals[configs[0]][3]
    for (k, min_n, max_n), (tokens, rounds, accepted, seconds) in totals.items():
        results.append(
            {
                "k": k,
                "min_n": min_n,
                "max_n": max_n,
                "tok_s": tokens / seconds,
                "ratio": tokens / seconds / base,
                "tau": 1 + accepted / max(rounds, 1),
            }
        )
        print(
            f"k={k:<3} min_n={min_n} max_n={max_n}  {tokens / seconds:6.2f} tok/s  "
            f"{tokens / seconds / base:5.2f}x  tau {results[-1]['tau']:.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "questions": args.questions,
                    "limit": args.limit,
                    "max_tokens": args.max_tokens,
                    "results": results,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
