"""What the verifier's prefix cache (`--prefix-cache`) saves a prompt's prefill, in one process.

Two targets as the verifier serves them, one keeping prompts' KV and one not, prefill the same
prompts in alternating order, `--rounds` times after an untimed pass:

  first turns   each question's first turn in the chat template, the cache holding one other
                question's prompt (what a stream of new chats shares: the template's system
                turn), so no prompt finds itself stored
  second turns  each question's second turn after its first and the target's greedy reply to
                it (`--reply-tokens`), the cache holding the first turn's session as the
                verifier keeps it when it closes (its prompt and reply), as a chat's next
                request finds it

Median ms per prompt, the tokens reused, and warm / cold. Each warm prompt's first token is
checked against the cold one's.

    python benchmarks/prefix_reuse.py [--questions mt-bench] [--every 8] [--rounds 3]
        [--reply-tokens 64] [--size 256MiB]
"""

from __future__ import annotations

import argparse
import statistics
import time

from call_overhead import as_served

from specd.datasets import load_questions
from specd.models.load import load_target
from specd.prompts import encode_chat
from verifier_svc.engine import decode, prefill

OTHER_QUESTION = "Name three rivers of Europe and the seas they flow into."


def timed(target, prompt: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    first = prefill(target, prompt).first_token
    return time.perf_counter() - start, first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", help="model (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--questions", default="mt-bench")
    p.add_argument("--every", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reply-tokens", type=int, default=64)
    p.add_argument("--size", default="256MiB", help="the warm target's --prefix-cache")
    args = p.parse_args()
    tokenizer = load_target(args.target, args.dtype).tokenizer
    cold, _ = as_served(args.target, args.dtype, ["--prefix-cache", "0"])
    warm, _ = as_served(args.target, args.dtype, ["--prefix-cache", args.size])
    print(f"prefix reuse exact here: {warm.prefix_reuse_exact}")

    def chat(*turns: str) -> list[int]:
        roles = ["user", "assistant"] * len(turns)
        messages = [{"role": roles[i], "content": t} for i, t in enumerate(turns)]
        return encode_chat(tokenizer, messages)

    other = chat(OTHER_QUESTION)
    cases = []  # (kind, the session the cache holds first: its prompt and reply, the prompt timed)
    for q in load_questions(args.questions)[:: args.every]:
        cases.append(("first turn", (other, 0), chat(q.turns[0])))
        if len(q.turns) > 1:
            opened = prefill(cold, chat(q.turns[0]))
            reply = [opened.first_token] + decode(cold, opened.session, args.reply_tokens).committed
            text = tokenizer.decode([t for t in reply if t not in warm.eos_ids])
            second = chat(q.turns[0], text, q.turns[1])
            cases.append(("second turn", (chat(q.turns[0]), args.reply_tokens), second))

    def run_warm(held, prompt):
        warm.prefix_cache.clear()
        held_prompt, reply_tokens = held
        session = prefill(warm, held_prompt).session
        if reply_tokens:
            decode(warm, session, reply_tokens)
            warm.keep_session(session)  # as CloseSession keeps it
        return timed(warm, prompt)

    sides = {"cold": lambda held, prompt: timed(cold, prompt), "warm": run_warm}
    times = {n: [[] for _ in cases] for n in sides}
    reused, differ = [0] * len(cases), 0
    for r in range(args.rounds + 1):  # the first round untimed: every shape met once
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for i, (_, held, prompt) in enumerate(cases):
            firsts = {}
            for name in order:
                seconds, firsts[name] = sides[name](held, prompt)
                if r:
                    times[name][i].append(seconds)
            reused[i] = warm.prefix_cache.stats.tokens_reused
            differ += firsts["cold"] != firsts["warm"]
    header = ("prompt", 12), ("tokens", 8), ("reused", 8), ("cold ms", 10), ("warm ms", 10)
    print("".join(f"{name:>{width}}" for name, width in header) + f"{'warm/cold':>11}")
    ratios: dict[str, list[float]] = {}
    for i, (kind, _, prompt) in enumerate(cases):
        cold_ms, warm_ms = (1000 * statistics.median(times[n][i]) for n in ("cold", "warm"))
        ratios.setdefault(kind, []).append(warm_ms / cold_ms)
        print(f"{kind:>12}{len(prompt):>8}{reused[i]:>8}{cold_ms:>10.1f}{warm_ms:>10.1f}"
              f"{warm_ms / cold_ms:>10.2f}x")  # fmt: skip
    for kind, values in ratios.items():
        print(f"median warm/cold, {kind}s: {statistics.median(values):.2f}x over {len(values)}")
    print(f"first tokens differing between cold and warm: {differ}")


if __name__ == "__main__":
    main()
