"""How often a model drafter's first draft is the target's next token, and the tau it gets when
served in-process with a pinned k: tells a weak drafter from a broken serving path. For EAGLE-3
also how often the next token is among the head's top 2-4 (what a tree's extra branches can
catch), how often a chain's second draft is right after a right first one, and how many of the
target's tokens its draft vocabulary holds at all.

    python benchmarks/drafter_agreement.py --kind eagle3 --k 1 [--weights DIR] [--prompts 3]
    python benchmarks/drafter_agreement.py --kind dflash --k 3
    python benchmarks/drafter_agreement.py --kind eagle3 --questions mt-bench --every 8
    python benchmarks/drafter_agreement.py --kind eagle3 --sharegpt 20 --tokens 128 --by-position

The prompts are written here, in none of the training data or benchmark sets; `--questions`
takes the first turns of a benchmark set instead (MT-bench and HumanEval are not in the
ShareGPT training data either), for a larger sample.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from pathlib import Path

import mlx.core as mx
import numpy as np

from coordinator.bench import plain_decode
from coordinator.local import LocalDrafter, LocalVerifier
from coordinator.rounds import Plan, RoundStats, run_rounds
from drafter_svc.config import DrafterConfig, drafter_options
from drafter_svc.data import Example, TargetFeatures, read_conversations
from drafter_svc.server import make_proposer
from specd.datasets import load_questions
from specd.models.load import load_target
from specd.prompts import encode_chat
from verifier_svc.engine import Target, half_weights_pay

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "Tell me about the history of the bicycle in a few paragraphs.",
    "Give me five tips for keeping houseplants alive in winter.",
    "Explain the difference between a list and a tuple in Python, with examples.",
]


def first_draft_hits(proposer, seq, rows, argmax, start) -> list[bool]:
    """Open the drafter on every prefix of the target's output; is its first draft the target's
    next token there? One entry per position of the reply but its last."""
    hits = []
    for a in range(start, len(seq) - 1):
        state = proposer.open([int(x) for x in seq[: a + 1]], mx.array(rows[:a]))
        drafts = proposer.propose(state, 1).ids
        hits.append(bool(drafts) and drafts[0] == argmax[a])
    return hits


def first_draft_agreement(proposer, seq, rows, argmax, start) -> float:
    return float(np.mean(first_draft_hits(proposer, seq, rows, argmax, start)))


# reply positions the first-draft agreement is broken down by (--by-position)
POSITION_SPANS = ((0, 8), (8, 32), (32, 64), (64, 128), (128, None))


def by_position(hits_per_reply: list[list[bool]]) -> list[tuple[str, float, int]]:
    """(span, agreement, positions) over the spans of POSITION_SPANS the replies reach."""
    out = []
    for lo, hi in POSITION_SPANS:
        span = [x for hits in hits_per_reply for x in hits[lo:hi]]
        if span:
            out.append((f"{lo}-{hi - 1}" if hi else f"{lo}-", float(np.mean(span)), len(span)))
    return out


def sharegpt_openings(count: int, seed: int = 5) -> list[str]:
    """The first human turns of `count` ShareGPT conversations (benchmark prompts left out), in
    a seeded shuffle: the kind of request the training data's earlier stages held (so some
    may have been trained on)."""
    conversations = read_conversations(None)
    random.Random(seed).shuffle(conversations)
    openings = []
    for record in conversations:
        turns = record.get("conversations") or []
        if turns and turns[0].get("from") == "human" and 20 < len(turns[0]["value"]) < 1500:
            openings.append(turns[0]["value"])
        if len(openings) == count:
            break
    return openings


def eagle3_depth_profile(drafter, seq, rows, argmax, start, top: int = 4):
    """Per position: is the target's next token among the head's top-1..`top` first drafts, and
    is a 2-chain's second draft right when its first is? (What a tree or a longer chain adds.)"""
    covered = np.zeros(top)
    positions = first_right = second_right = 0
    for a in range(start, len(seq) - 2):
        state = drafter.open([int(x) for x in seq[: a + 1]], mx.array(rows[:a]))
        logits = np.array(drafter.head.logits(mx.array(state.last_hidden)))
        best = drafter._to_target(np.argsort(-logits)[:top])
        covered += [int(argmax[a]) in best[: j + 1] for j in range(top)]
        positions += 1
        chain = drafter.chain(state, 2).ids
        if chain[0] == argmax[a]:
            first_right += 1
            second_right += chain[1] == argmax[a + 1]
    return covered, positions, first_right, second_right


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--kind", choices=["eagle3", "dflash"], required=True)
    p.add_argument("--weights", type=Path, help="the model to measure (default: the shipped one)")
    p.add_argument("--k", type=int, default=1, help="pinned draft length when served")
    p.add_argument(
        "--draft-vocab", type=int, help="DFlash: tokens read out (0: all; default: its list)"
    )
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--prompts", type=int, default=1, help=f"how many of the {len(PROMPTS)} prompts")
    p.add_argument("--questions", help="a question set (mt-bench, humaneval, a .jsonl) instead")
    p.add_argument(
        "--sharegpt",
        type=int,
        metavar="N",
        help="the first human turns of N ShareGPT conversations instead (seeded shuffle)",
    )
    p.add_argument(
        "--by-position",
        action="store_true",
        help="also break the first-draft agreement down by position in the reply",
    )
    p.add_argument("--every", type=int, default=1, help="with --questions: every Nth question")
    args = p.parse_args()
    prompts = PROMPTS[: args.prompts]
    if args.questions:
        prompts = [q.turns[0] for q in load_questions(args.questions)[:: args.every]]
    elif args.sharegpt:
        prompts = sharegpt_openings(args.sharegpt)
    loaded = load_target(None, "float32")
    options = drafter_options(args.kind, weights=args.weights, draft_vocab=args.draft_vocab)
    proposer = make_proposer(DrafterConfig(**options))
    verifier = LocalVerifier(
        Target(load_target(None, "float32", half_weights=half_weights_pay("float32", None)))
    )
    drafter = LocalDrafter(proposer)
    eos = set(loaded.identity.eos_token_ids)
    hits, positions, rounds, accepted, identical = 0.0, 0, 0, 0, True
    covered, depth_positions, first_right, second_right = np.zeros(4), 0, 0, 0
    in_vocab, out_tokens = 0, 0
    hits_per_reply = []
    for prompt in prompts:
        ids = encode_chat(loaded.tokenizer, [{"role": "user", "content": prompt}])
        out = plain_decode(loaded.model, ids, args.tokens, eos).token_ids
        seq = np.array(ids + out, dtype=np.int32)
        feats = TargetFeatures(loaded.model, proposer.capture_layers)(
            Example(seq, np.ones(len(seq), bool))
        )
        reply_hits = first_draft_hits(proposer, seq, feats.rows, feats.argmax, len(ids))
        hits_per_reply.append(reply_hits)
        hits += sum(reply_hits)
        out_tokens += len(out)
        positions += len(out) - 1
        if args.kind == "eagle3":
            c, n, f, sr = eagle3_depth_profile(
                proposer.drafter, seq, feats.rows, feats.argmax, len(ids)
            )
            covered, depth_positions = covered + c, depth_positions + n
            first_right, second_right = first_right + f, second_right + sr
            # which of the target's tokens the head can draft at all
            in_vocab += int((proposer.drafter.t2d[np.array(out, dtype=np.int64)] >= 0).sum())

        async def serve(ids=ids):
            stats, tokens = RoundStats(), []
            plan = Plan(args.tokens, args.k)
            async for new, _ in run_rounds(verifier, drafter, ids, plan, stats):
                tokens += new
            return stats, tokens

        stats, tokens = asyncio.run(serve())
        rounds, accepted = rounds + stats.rounds, accepted + stats.accepted
        identical = identical and tokens == out
    print(f"{args.kind}: first-draft agreement with the target's next token "
          f"{hits / positions:.3f} over {positions} positions of its greedy output")  # fmt: skip
    if args.by_position:
        for span, agreement, count in by_position(hits_per_reply):
            print(f"{args.kind}: first-draft agreement at reply positions {span}: "
                  f"{agreement:.3f} over {count}")  # fmt: skip
    if depth_positions:
        shares = " / ".join(f"{x:.3f}" for x in covered / depth_positions)
        print(f"eagle3: target's next token among the head's top 1 / 2 / 3 / 4: {shares}")
        print(f"eagle3: target's tokens in the head's draft vocabulary "
              f"({len(proposer.drafter.d2t)}): {in_vocab / out_tokens:.3f}")  # fmt: skip
        print(f"eagle3: second draft of a 2-chain right when the first is: "
              f"{second_right / max(first_right, 1):.3f} ({first_right} cases)")  # fmt: skip
    print(f"{args.kind}: served in-process, k = {args.k} pinned: tau {1 + accepted / rounds:.2f}, "
          f"identical to plain decoding: {identical}")  # fmt: skip


if __name__ == "__main__":
    main()
