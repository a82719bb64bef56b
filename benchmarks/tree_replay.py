"""Replay greedy draft-tree rounds (EAGLE-3 or DFlash) against the target's own greedy replies,
without a verifier: the tau of many tree shapes over the same questions in minutes, and how well
the drafter's probabilities predict which nodes the target keeps.

A round opens where the last one ended, builds a tree from the head's state there, keeps the
longest root path that the target's greedy reply follows, and commits it with the target's next
token, as a served greedy round does; the head's state then takes those tokens and the target's
rows for them. The target's replies and rows are computed once and cached (`--cache`).

    python -m specd.platform exec -- python benchmarks/tree_replay.py --questions mt-bench \
        --tokens 128 --shapes 16:5:4 16:6:4 16:8:3 [--calibration] [--weights DIR]
    python -m specd.platform exec -- python benchmarks/tree_replay.py --kind dflash \
        --shapes 15:15:1 16:15:4

A shape is total:depth:top_k (the drafter's --tree-total-tokens, --tree-depth, --tree-top-k);
a top_k of 1 is a chain (15:15:1: DFlash's block of 16). The drafting time a round is the tree
and the round's tokens taken in, as a served draft call does both; `--flush-mb 300` writes over
300 MB before each, so the drafter's weights are out of the caches as after a target forward.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coordinator.bench import plain_decode
from coordinator.rounds import Drafted, cut_at_prices
from drafter_svc.config import DrafterConfig, drafter_options
from drafter_svc.data import Example, TargetFeatures
from drafter_svc.proposal import TreeShape
from drafter_svc.server import make_proposer
from specd.argtypes import positive_int
from specd.datasets import load_questions
from specd.models.load import load_target
from specd.prompts import encode_chat
from verifier_svc.tree import accept_tree_greedy, depths


def parse_shape(text: str) -> TreeShape:
    try:
        total, depth, top_k = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a shape is total:depth:top_k") from None
    if min(total, depth, top_k) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every part must be at least 1")
    return TreeShape(total, depth, top_k)


def target_replies(questions: list[str], tokens: int, capture, cache: Path | None):
    """[(prompt length, prompt + greedy reply ids, the target's rows)] for each question."""
    replies = None  # (prompt length, prompt + reply) of each question
    if cache is not None and cache.exists():
        saved = np.load(cache, allow_pickle=False)
        n = int(saved["count"])
        same = "prompts" in saved.files and str(saved["prompts"]) == _digest(questions)
        if same and int(saved["tokens"]) == tokens:
            replies = [(int(saved[f"p{i}"]), saved[f"s{i}"]) for i in range(n)]
            if saved["capture"].tolist() == list(capture):
                return [(p, s, saved[f"r{i}"]) for i, (p, s) in enumerate(replies)]
            print(f"{cache}: rows of other layers; the replies kept, their rows made again")
        else:
            print(f"{cache}: made for other questions or lengths; computing again")
    loaded = load_target(None, "float32")
    if replies is None:
        eos = set(loaded.identity.eos_token_ids)
        replies = []
        for question in questions:
            ids = encode_chat(loaded.tokenizer, [{"role": "user", "content": question}])
            reply = plain_decode(loaded.model, ids, tokens, eos).token_ids
            replies.append((len(ids), np.array(ids + reply, dtype=np.int32)))
    features = TargetFeatures(loaded.model, capture)
    out = []
    for prompt_len, seq in replies:
        rows = features(Example(seq, np.ones(len(seq), bool))).rows.astype(np.float32)
        out.append((prompt_len, seq, rows))
    if cache is not None:
        arrays = {"count": len(out), "tokens": tokens, "capture": np.array(capture),
                  "prompts": _digest(questions)}  # fmt: skip
        for i, (p, s, r) in enumerate(out):
            arrays.update({f"p{i}": p, f"s{i}": s, f"r{i}": r})
        np.savez(cache, **arrays)
    return out


def _digest(questions: list[str]) -> str:
    return hashlib.sha256("\0".join(questions).encode()).hexdigest()


def kept_path(tokens: list[int], parents: list[int], reply: np.ndarray) -> list[int]:
    """Node indices of the root path the verifier keeps when the target's greedy choices are
    the reply's: after the root and each node, the reply's token at that depth."""
    after = [int(reply[d]) if d < len(reply) else -1 for d in [0, *depths(parents)]]
    return accept_tree_greedy(tokens, parents, after, eos_ids=())[1]


@dataclass
class Prices:
    verify_ms: list[float]  # a verify of 1, 2, ... tokens
    draft_ms: float  # a round's drafting
    cut: bool  # trees cut at these prices (`priced_cut`)


class _Table:
    """Verify prices by token count, where the coordinator has its measured ones."""

    def __init__(self, verify_ms: list[float]):
        self.verify_ms = verify_ms

    def predict(self, tokens: int) -> float:
        return self.verify_ms[tokens - 1]


def cut_tree(proposal, prices: Prices) -> tuple[list[int], list[int]]:
    """The proposal cut as the coordinator cuts a served tree (`cut_at_prices`)."""
    tree = Drafted(proposal.ids, None, 0.0, proposal.parents, proposal.scores)
    cut = cut_at_prices(tree, _Table(prices.verify_ms), prices.draft_ms)
    return cut.ids, cut.parents


def replay(proposer, replies, shape: TreeShape, calibration: dict | None, flush=None,
           prices=None):  # fmt: skip
    """(tau, drafting ms a round, drafts a round, rounds that kept a draft, of them those
    whose kept path must move in the verifier's cache) of greedy tree rounds over the replies.
    The drafting time covers the tree and taking the round's tokens in (as a served draft call
    does both); `flush`, an array, is written over before each, as a served round's target
    forward streams its weights through the caches between two draft calls. A kept path stays
    in place when it is the tree's first drafts, 0, 1, ... (the likeliest line, listed first)."""
    committed = rounds = drafts = kept_any = moved = 0
    seconds = priced = 0.0
    for prompt_len, seq, rows in replies:
        n = prompt_len
        state = proposer.open(seq[:n].tolist(), rows[: n - 1])
        while n < len(seq):
            if flush is not None:
                flush += 1.0
            start = time.perf_counter()
            # as the drafter service serves a request's tree (a top-k of 1: a chain)
            proposal = proposer.propose(state, shape.depth, tree=shape)
            if proposal.parents is None:
                proposal.parents = list(range(-1, len(proposal.ids) - 1))
            seconds += time.perf_counter() - start
            ids, parents = proposal.ids, proposal.parents
            if prices is not None and prices.cut and proposal.scores is not None:
                ids, parents = cut_tree(proposal, prices)
            drafts += len(ids)
            if prices is not None:
                priced += prices.draft_ms + prices.verify_ms[len(ids)]
            path = kept_path(ids, parents, seq[n:])
            kept_any += bool(path)
            moved += path != list(range(len(path)))
            if calibration is not None:
                record_nodes(calibration, proposal, path)
            new = min(len(path) + 1, len(seq) - n)
            if flush is not None:
                flush += 1.0
            start = time.perf_counter()
            proposer.extend(state, seq[n : n + new].tolist(), rows[n - 1 : n - 1 + new])
            seconds += time.perf_counter() - start
            n += new
            committed += new
            rounds += 1
    share = None if prices is None else committed * prices.verify_ms[0] / priced
    return committed / rounds, 1000 * seconds / rounds, drafts / rounds, kept_any, moved, share


P_BINS = (0.0, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.01)


def record_nodes(calibration: dict, proposal, path: list[int]) -> None:
    """Per depth and band of the head's probability for a node given its parent: nodes sent
    whose parent the target kept, how many of them it kept, and their summed probabilities."""
    kept, sent_scores = set(path), proposal.scores
    if sent_scores is None:  # a chain's drafts carry no scores
        return
    depth = depths(proposal.parents)
    for i, parent in enumerate(proposal.parents):
        if parent < 0 or parent in kept:
            base = 0.0 if parent < 0 else sent_scores[parent]
            prob = float(np.exp(sent_scores[i] - base))
            band = int(np.searchsorted(P_BINS, prob, side="right")) - 1
            offered, hits, total = calibration.get((depth[i], band), (0, 0, 0.0))
            calibration[(depth[i], band)] = (offered + 1, hits + (i in kept), total + prob)


def print_calibration(calibration: dict) -> None:
    for depth in sorted({d for d, _ in calibration}):
        cells = []
        for band in range(len(P_BINS) - 1):
            offered, hits, total = calibration.get((depth, band), (0, 0, 0.0))
            if offered:
                cells.append(f"p {total / offered:.2f}: {hits}/{offered} = {hits / offered:.2f}")
        print(f"  depth {depth}: " + "; ".join(cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--questions", default="mt-bench", help="a question set or a .jsonl")
    p.add_argument("--every", type=positive_int, default=1, help="every Nth question")
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens a question")
    p.add_argument("--kind", choices=["eagle3", "dflash"], default="eagle3")
    p.add_argument("--weights", type=Path, help="the drafter (default: the shipped one)")
    p.add_argument(
        "--shapes", type=parse_shape, nargs="+", default=[TreeShape()], help="total:depth:top_k"
    )
    p.add_argument(
        "--calibration", action="store_true", help="per depth: nodes offered whose parent was kept"
    )
    p.add_argument(
        "--min-probs", type=float, nargs="+", default=[0.0],
        help="each shape at each --tree-min-prob: no node below that path probability",
    )  # fmt: skip
    p.add_argument(
        "--verify-ms", type=float, nargs="+", metavar="MS",
        help="a verify's price for 1, 2, ... tokens (benchmarks/verify_cost.py); prints each "
        "run's share (drafting off's time for its tokens against its rounds' at these prices)",
    )  # fmt: skip
    p.add_argument(
        "--draft-ms", type=float, default=0.0,
        help="with --verify-ms: a round's drafting price (the replay's own time varies)",
    )  # fmt: skip
    p.add_argument(
        "--priced-cut", action="store_true",
        help="with --verify-ms: also each tree cut at these prices by its node scores (the "
        "n likeliest nodes, n maximizing expected tokens per ms)",
    )  # fmt: skip
    p.add_argument("--cache", type=Path, help="where the target's replies and rows are kept")
    p.add_argument(
        "--flush-mb", type=positive_int, metavar="MB",
        help="write MB of memory before each drafting step, as the target's forward evicts the "
        "drafter's weights between two served draft calls (the embedded target reads ~270)",
    )  # fmt: skip
    args = p.parse_args()
    if args.calibration and args.kind != "eagle3":
        p.error("--calibration reads EAGLE-3's node scores; DFlash's are per position")
    questions = [q.turns[0] for q in load_questions(args.questions)[:: args.every]]
    proposer = make_proposer(DrafterConfig(**drafter_options(args.kind, weights=args.weights)))
    replies = target_replies(questions, args.tokens, proposer.capture_layers, args.cache)
    print(f"{len(replies)} questions, {sum(len(s) - n for n, s, _ in replies)} reply tokens")
    flush = None if args.flush_mb is None else np.zeros(args.flush_mb * 2**20 // 4, np.float32)
    if args.priced_cut and not args.verify_ms:
        p.error("--priced-cut needs --verify-ms")
    most = max(shape.total_tokens for shape in args.shapes) + 1
    if args.verify_ms and len(args.verify_ms) < most:
        p.error(f"--verify-ms needs a price for each verify of 1 to {most} tokens")
    cuts = [False, True] if args.priced_cut else [False]
    for shape, min_prob, cut in itertools.product(args.shapes, args.min_probs, cuts):
        calibration = {} if args.calibration and not cut else None  # scores of the uncut
        proposer.tree_min_prob = min_prob
        prices = None
        if args.verify_ms:
            prices = Prices(args.verify_ms, args.draft_ms, cut)
        tau, ms, nodes, kept_any, moved, share = replay(proposer, replies, shape, calibration,
                                                        flush, prices)  # fmt: skip
        label = f"{shape.total_tokens}:{shape.depth}:{shape.top_k}"
        floor = f" min-prob {min_prob:g}" if min_prob else ""
        floor += " priced cut" if cut else ""
        priced = "" if share is None else f", share {share:.3f} at the prices"
        print(f"tree {label}{floor}: tau {tau:.3f}, {nodes:.2f} drafts a round, drafting "
              f"{ms:.1f} ms a round; a kept path moved in {moved} of the {kept_any} rounds "
              f"that kept a draft{priced}", flush=True)  # fmt: skip
        if calibration:
            print_calibration(calibration)


if __name__ == "__main__":
    main()
