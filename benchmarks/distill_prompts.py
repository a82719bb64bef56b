"""What `specd distill` spends turning ShareGPT user turns into prompt ids: one
`apply_chat_template(tokenize=True)` call a prompt against distill's own chunks (rendered, then
one batched tokenizer call each), on the same records in the same shuffled order, with the ids
checked equal.

    python -m specd.platform exec -- python benchmarks/distill_prompts.py \
        [--target MODEL] [--prompts 4096] [--max-prompt-tokens 1024]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import drafter_svc.data as data
from drafter_svc.distill import DistillOptions, _new_prompts, user_turns
from specd.models.load import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="model (default: the embedded SmolLM2)")
    parser.add_argument("--prompts", type=int, default=4096)
    parser.add_argument("--max-prompt-tokens", type=int, default=1024)
    args = parser.parse_args()
    tokenizer = load_target(args.target, "float32").tokenizer
    records = data.read_conversations(None)

    started = time.perf_counter()
    one_by_one = []
    for chat in user_turns(records, 0, "all"):
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        if len(ids) <= args.max_prompt_tokens:
            one_by_one.append(list(ids))
            if len(one_by_one) == args.prompts:
                break
    single_s = time.perf_counter() - started

    data.read_conversations = lambda path: records  # both sides start from the records read
    opts = DistillOptions(target=args.target, out=Path("unused.jsonl"), conversations=args.prompts,
                          max_prompt_tokens=args.max_prompt_tokens)  # fmt: skip
    clock = {"prompt_seconds": 0.0}
    started = time.perf_counter()
    chunked = [ids for _, ids in _new_prompts(opts, tokenizer, set(), args.prompts, clock, None)]
    chunked_s = time.perf_counter() - started
    print(f"{len(one_by_one)} prompts of at most {args.max_prompt_tokens} tokens: one at a time "
          f"{single_s:.1f} s; in chunks {chunked_s:.1f} s (tokenizing {clock['prompt_seconds']:.1f}"
          f" s of it); same ids: {one_by_one == chunked}")  # fmt: skip


if __name__ == "__main__":
    main()
