"""How much of the target's greedy replies to a question set a draft vocabulary holds: the
EAGLE-3 head's (shipped, or --weights) and the DFlash drafter's listed tokens (--dflash)
against the N tokens most frequent in the assistant turns of ShareGPT-format files (what
`specd train eagle3 --vocab-from-data` would choose from them, counted on the replies' text).
A token outside the draft vocabulary is never drafted right, so this share bounds the first
draft's agreement.

    python -m specd.platform exec -- python benchmarks/draft_vocab_coverage.py \
        --data dl.jsonl --questions mt-bench --every 4
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import numpy as np

from coordinator.bench import plain_decode
from drafter_svc.data import read_conversations, to_messages
from drafter_svc.dflash.model import load_draft_vocab
from drafter_svc.eagle3.model import load_head
from specd.datasets import load_questions
from specd.models.load import load_target
from specd.prompts import encode_chat

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "drafter_svc/eagle3/heads/smollm2-135m-instruct"
SHIPPED_DFLASH = ROOT / "drafter_svc/dflash/drafters/smollm2-135m-instruct"


def reply_token_ranking(paths: list[Path], tokenizer) -> np.ndarray:
    """Token ids of the assistant turns of `paths`, most frequent first."""
    counts: Counter[int] = Counter()
    for path in paths:
        for record in read_conversations(path):
            chat = to_messages(record) or []
            for message in chat:
                if message["role"] == "assistant":
                    counts.update(tokenizer.encode(message["content"], add_special_tokens=False))
    return np.array([token for token, _ in counts.most_common()], dtype=np.int64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, nargs="+", required=True,
                   help="ShareGPT-format .json/.jsonl files to rank tokens by")  # fmt: skip
    p.add_argument("--questions", default="mt-bench", help="the question set (first turns)")
    p.add_argument("--every", type=int, default=4, help="every Nth question")
    p.add_argument("--tokens", type=int, default=128, help="greedy reply tokens")
    p.add_argument("--weights", type=Path, default=SHIPPED, help="the head (default: shipped)")
    p.add_argument("--dflash", type=Path, default=SHIPPED_DFLASH,
                   help="a DFlash drafter's listed tokens (default: shipped)")  # fmt: skip
    p.add_argument("--sizes", type=int, nargs="+", default=[6144, 8192, 12288, 16384],
                   help="more vocabulary sizes to rank from the data")  # fmt: skip
    args = p.parse_args()

    loaded = load_target(None, "float32")
    shipped = load_head(args.weights)[0].target_ids()
    listed = load_draft_vocab(args.dflash, loaded.identity.vocab_size)
    ranked = reply_token_ranking(args.data, loaded.tokenizer)
    eos = set(loaded.identity.eos_token_ids)
    reply: list[int] = []
    for question in load_questions(args.questions)[:: args.every]:
        ids = encode_chat(loaded.tokenizer, [{"role": "user", "content": question.turns[0]}])
        reply += plain_decode(loaded.model, ids, args.tokens, eos).token_ids
    tokens = np.array(reply)
    print(f"{args.questions} every {args.every}: {len(tokens)} reply tokens; the data: "
          f"{len(ranked)} distinct reply tokens")  # fmt: skip
    print("| draft vocabulary | tokens | holds of the replies |")
    print("| --- | ---: | ---: |")
    print(f"| the head's | {len(shipped)} | {np.isin(tokens, shipped).mean():.3f} |")
    if listed is not None:
        print(
            f"| the DFlash drafter's list | {len(listed)} | {np.isin(tokens, listed).mean():.3f} |"
        )
    for size in sorted({len(shipped), *args.sizes}):
        print(
            f"| the data's most frequent | {size} | {np.isin(tokens, ranked[:size]).mean():.3f} |"
        )
    shared = np.isin(ranked[: len(shipped)], shipped).mean()
    print(f"the data's {len(shipped)} most frequent that the head holds: {shared:.3f}")


if __name__ == "__main__":
    main()
