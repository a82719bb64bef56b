"""The records a `specd train` run did not train on, for the next run to go on with, its held-out
records kept held out: the run's selection is replayed (shuffle by --seed, the first
--conversations usable at --max-len tokens, the last --held-out of them held out), and the
records it never reached are written with the held-out ones where the next run's shuffle (same
seed, every record usable) puts its last --held-out examples.

    python benchmarks/unseen_records.py --data dd.jsonl --out dn.jsonl [--conversations 14000]
        [--held-out 200] [--max-len 1024] [--seed 0]

Then: `specd train eagle3 --data dn.jsonl --conversations N --held-out 200 ...` with N at least
the records written; its held-out agreement is measured on the same records as the first run's.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from drafter_svc.data import read_conversations, to_messages, tokenize_chat
from specd.models.load import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="whose tokenizer decides usability (default: embedded)")
    parser.add_argument("--data", type=Path, required=True, help="the first run's --data")
    parser.add_argument("--out", type=Path, required=True, help="ShareGPT .jsonl to write")
    parser.add_argument("--conversations", type=int, default=14000)
    parser.add_argument("--held-out", type=int, default=200)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    tokenizer = load_target(args.target).tokenizer
    records = read_conversations(args.data)

    def usable(record) -> bool:
        messages = to_messages(record)
        return messages is not None and tokenize_chat(tokenizer, messages, args.max_len) is not None

    order = list(range(len(records)))
    random.Random(args.seed).shuffle(order)  # as build_examples shuffles
    taken, walked = [], 0
    for i in order:
        walked += 1
        if usable(records[i]):
            taken.append(i)
            if len(taken) >= args.conversations:
                break
    held = taken[len(taken) - args.held_out :]
    unseen = [i for i in order[walked:] if usable(records[i])]
    slots: list[int | None] = [None] * (len(unseen) + len(held))
    placed = list(range(len(slots)))
    random.Random(args.seed).shuffle(placed)
    for position, i in zip(placed[len(unseen) :], held, strict=True):
        slots[position] = i
    rest = iter(unseen)
    with args.out.open("w", encoding="utf-8") as out:
        for slot in slots:
            record = records[next(rest) if slot is None else slot]
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"{len(taken) - len(held)} trained on, {len(held)} held out, {len(unseen)} never "
          f"reached; wrote {len(slots)} records to {args.out}")  # fmt: skip


if __name__ == "__main__":
    main()
