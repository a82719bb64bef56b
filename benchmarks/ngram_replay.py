"""The n-gram drafter's matching rules replayed on the target's own greedy replies, no clock.

Decodes each prompt's greedy reply once with the verifier's engine (kept in --replies, reused
when it holds the same prompts), then walks every reply as the round loop does for each rule:
draft k tokens from the context so far, keep the longest prefix the reply agrees with, then the
target's own next token. Prints per question set and rule: τ (tokens per round), the share of
rounds that drafted anything, and rejected draft tokens per generated token (rows a verify
computes for nothing). The same replies for every rule: the differences are the rules', not
the machine's.

    python benchmarks/ngram_replay.py --questions input-grounded --questions mt-bench:2
        [--max-tokens 128] [--k 8] [--replies /tmp/replies.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from drafter_svc.ngram import PICKS, propose_ngram
from specd.datasets import load_questions
from specd.models.load import load_target
from specd.prompts import encode_chat
from verifier_svc.engine import Target, decode, half_weights_pay, prefill

# (name, pick, min_n, max_n); the first is the drafter's default
RULES = [
    ("earliest 2-4 (default)", "earliest", 2, 4),
    ("latest 2-4", "latest", 2, 4),
    ("earliest 2-8", "earliest", 2, 8),
    ("latest 2-8", "latest", 2, 8),
    ("earliest 3-8", "earliest", 3, 8),
    ("latest 3-8", "latest", 3, 8),
]


def replies_for(specs: list[str], max_tokens: int, path: Path | None) -> dict:
    """{spec: [(prompt ids, greedy reply ids), ...]}, from `path` when it holds them."""
    if path is not None and path.exists():
        cached = json.loads(path.read_text())
        if cached.get("specs") == specs and cached.get("max_tokens") == max_tokens:
            return cached["replies"]
    target = Target(load_target(None, "auto", half_weights=half_weights_pay("auto", None)))
    out = {}
    for spec in specs:
        name, _, every = spec.partition(":")
        questions = load_questions(name)[:: int(every or 1)]
        pairs = []
        for q in questions:
            messages = [{"role": "user", "content": q.turns[0]}]
            prompt = encode_chat(target.loaded.tokenizer, messages)
            started = prefill(target, prompt)
            reply = [started.first_token]
            if not started.session.finished:
                reply += decode(target, started.session, max_tokens - 1).committed
            pairs.append((prompt, reply[:max_tokens]))
        out[spec] = pairs
        print(f"{spec}: {len(pairs)} replies", flush=True)
    if path is not None:
        path.write_text(json.dumps({"specs": specs, "max_tokens": max_tokens, "replies": out}))
    return out


def replay(pairs, k: int, pick: str, min_n: int, max_n: int) -> dict:
    tokens = rounds = drafting = rejected = 0
    for prompt, reply in pairs:
        done = 0
        while done < len(reply):
            drafts = propose_ngram(prompt + reply[:done], k, min_n, max_n, pick=pick)
            drafts = drafts[: len(reply) - done - 1]
            kept = 0
            while kept < len(drafts) and drafts[kept] == reply[done + kept]:
                kept += 1
            rounds += 1
            drafting += bool(drafts)
            rejected += len(drafts) - kept
            done += kept + 1
        tokens += len(reply)
    return {
        "tau": tokens / rounds,
        "drafting_rounds": drafting / rounds,
        "rejected_per_token": rejected / tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", action="append", required=True, help="SET[:EVERY]")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--replies", type=Path, help="keep the decoded replies here")
    args = parser.parse_args()
    assert {pick for _, pick, _, _ in RULES} <= set(PICKS)
    replies = replies_for(args.questions, args.max_tokens, args.replies)
    for spec, pairs in replies.items():
        print(f"{spec} ({len(pairs)} replies, k = {args.k}): tau, rounds drafting, "
              "rejected drafts per token")  # fmt: skip
        for name, pick, min_n, max_n in RULES:
            r = replay(pairs, args.k, pick, min_n, max_n)
            print(f"  {name:<24} {r['tau']:.3f}  {r['drafting_rounds']:.2f}  "
                  f"{r['rejected_per_token']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
