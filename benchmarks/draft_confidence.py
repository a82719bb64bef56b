"""Whether stopping a chain where the EAGLE-3 head is unsure would pay, without a clock.

On the target's own greedy replies (every `--every`th question of `--questions`, `--tokens`
tokens each), at every position: the head's chain of `--k` drafts, the probability the head
gave each draft, and how many lead drafts the target's tokens match. Prints how often a first
draft is right by the probability the head gave it (is the head's confidence a signal?), then
replays the replies round by round under each policy (k pinned; drafting while the head's
probability stays at or above a threshold) with a round priced as this CPU prices it
(`--verify-ms`, a verify of 1, 2, 4 and 8 tokens, linear between; `--step-ms` a head step;
`--round-ms` a round's calls), against plain steps of `--plain-ms`: the drafts' share each
policy would get, and its τ.

    python -m specd.platform exec -- python benchmarks/draft_confidence.py \
        [--questions mt-bench] [--every 8] [--tokens 128] [--k 6]
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

from coordinator.bench import plain_decode
from drafter_svc.config import DrafterConfig, drafter_options
from drafter_svc.data import Example, TargetFeatures
from drafter_svc.eagle3.draft import top_probability
from drafter_svc.server import make_proposer
from specd.datasets import load_questions
from specd.models.load import load_target
from specd.prompts import encode_chat


def chain_with_probs(drafter, state, k: int) -> tuple[list[int], list[float]]:
    """The drafter's chain of k (target ids) and the head's probability of each draft."""
    levels = drafter._levels(state, k)
    position, hidden = state.entries, state.last_hidden[None]
    ids, probs = [], []
    while True:
        logits = levels.logits(hidden)[0]
        best = int(np.argmax(logits))
        ids.append(best)
        probs.append(top_probability(logits, best))
        if len(ids) == k:
            return drafter._to_target(ids), probs
        hidden = levels.forward(drafter._to_target(ids[-1:]), hidden, position, None)
        position += 1


def positions(args) -> list[list[tuple[list[float], int, int]]]:
    """Per reply, per position: (draft probabilities, lead drafts right, tokens left)."""
    loaded = load_target(None, "float32")
    proposer = make_proposer(DrafterConfig(**drafter_options("eagle3", weights=args.weights)))
    drafter, eos = proposer.drafter, set(loaded.identity.eos_token_ids)
    replies = []
    for question in load_questions(args.questions)[:: args.every]:
        ids = encode_chat(loaded.tokenizer, [{"role": "user", "content": question.turns[0]}])
        seq = np.array(ids + plain_decode(loaded.model, ids, args.tokens, eos).token_ids)
        feats = TargetFeatures(loaded.model, proposer.capture_layers)(
            Example(seq.astype(np.int32), np.ones(len(seq), bool))
        )
        start = len(ids)
        state = drafter.open(seq[: start + 1].tolist(), mx.array(feats.rows[:start]))
        reply = []
        for a in range(start, len(seq) - 1):
            if a > start:
                drafter.extend(state, [int(seq[a])], mx.array(feats.rows[a - 1 : a]))
            drafts, probs = chain_with_probs(drafter, state, args.k)
            lead = 0
            while lead < len(drafts) and a + lead < len(seq) - 1:
                if drafts[lead] != int(feats.argmax[a + lead]):
                    break
                lead += 1
            reply.append((probs, lead, len(seq) - 1 - a))
        replies.append(reply)
    return replies


def replay(replies, policy, verify_ms, args) -> tuple[float, float]:
    """(drafts' share against plain steps, τ) of a policy: probs -> (drafts sent, head steps)."""
    tokens = time = rounds = 0
    for reply in replies:
        a = 0
        while a < len(reply):
            probs, lead, left = reply[a]
            sent, steps = policy(probs)
            commit = min(min(lead, sent) + 1, left)
            time += verify_ms(sent + 1) + args.step_ms * steps + args.round_ms
            tokens, rounds, a = tokens + commit, rounds + 1, a + commit
    return tokens * args.plain_ms / time, tokens / rounds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--questions", default="mt-bench")
    p.add_argument("--every", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=6)
    p.add_argument("--weights", help="EAGLE-3 head directory (default: the shipped one)")
    p.add_argument("--verify-ms", type=float, nargs=4, default=[12.8, 14.9, 17.8, 25.2])
    p.add_argument("--step-ms", type=float, default=0.45)
    p.add_argument("--round-ms", type=float, default=1.2)
    p.add_argument("--plain-ms", type=float, default=12.9)
    args = p.parse_args()
    replies = positions(args)

    def verify_ms(n: int) -> float:
        return float(np.interp(n, [1, 2, 4, 8], args.verify_ms))

    first = np.array([r[0][0] for reply in replies for r in reply])
    right = np.array([r[1] > 0 for reply in replies for r in reply])
    print(f"{len(first)} positions; first draft right by the head's probability for it:")
    for lo, hi in ((0, 0.2), (0.2, 0.4), (0.4, 0.6), (0.6, 0.8), (0.8, 1.01)):
        inside = (first >= lo) & (first < hi)
        print(f"  [{lo:.1f}, {min(hi, 1):.1f}): {inside.sum():5d} positions, "
              f"right {right[inside].mean():.2f}")  # fmt: skip
    for k in range(1, args.k + 1):
        share, tau = replay(replies, lambda probs, k=k: (k, k), verify_ms, args)
        print(f"k = {k} pinned: share {share:.3f}, τ {tau:.2f}")
    for least in (0, 1):
        for threshold in (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8):

            def confident(probs, threshold=threshold, least=least):
                sent = 0
                while sent < args.k and (probs[sent] >= threshold or sent < least):
                    sent += 1
                return sent, min(sent + 1, args.k)

            share, tau = replay(replies, confident, verify_ms, args)
            print(f"while p >= {threshold:.1f} (at least {least}): share {share:.3f}, τ {tau:.2f}")


if __name__ == "__main__":
    main()
