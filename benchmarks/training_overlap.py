"""Which benchmark prompts a training selection holds: the conversations `specd train` picked
before benchmark prompts were left out (shuffle by --seed, the first --conversations usable at
--max-len tokens), against MT-bench, HumanEval and the input-grounded set.

    python benchmarks/training_overlap.py [--conversations 3600] [--max-len 320] [--seed 0]
"""

from __future__ import annotations

import argparse
import random

from drafter_svc.data import _holds_benchmark_turn, _read_records, to_messages, tokenize_chat
from specd.datasets import available_builtin, benchmark_key, benchmark_keys, load_questions
from specd.models.load import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="whose tokenizer decides usability (default: embedded)")
    parser.add_argument("--data", help="ShareGPT .json/.jsonl (default: the package)")
    parser.add_argument("--conversations", type=int, default=3600)
    parser.add_argument("--max-len", type=int, default=320)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    records = _read_records(args.data)
    keys = benchmark_keys()
    holding = {i for i, r in enumerate(records) if _holds_benchmark_turn(r, keys)}
    sets = {name: {benchmark_key(t) for q in load_questions(name) for t in q.turns}
            for name in available_builtin()}  # fmt: skip
    tokenizer = load_target(args.target, "float32").tokenizer
    order = list(range(len(records)))
    random.Random(args.seed).shuffle(order)
    used, found = 0, []
    for i in order:
        messages = to_messages(records[i])
        if messages is None or tokenize_chat(tokenizer, messages, args.max_len) is None:
            continue
        used += 1
        if i in holding:
            turns = [benchmark_key(t.get("value", "")) for t in records[i]["conversations"]]
            found.append((used, [n for n, s in sets.items() if any(t in s for t in turns)]))
        if used >= args.conversations:
            break
    print(f"{len(holding)} of {len(records)} conversations hold a benchmark prompt; "
          f"{len(found)} of them among the first {used} selected")  # fmt: skip
    for rank, names in found:
        print(f"  selected #{rank}: {', '.join(names)}")


if __name__ == "__main__":
    main()
