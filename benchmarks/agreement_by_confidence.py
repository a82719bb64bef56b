"""Where an EAGLE-3 head's first draft misses, on a benchmark's prompts against the prompts of
its training kind: the trainer's pass-1 agreement with the target's greedy token, split by how
sure the target is of that token (its top-1 probability), by the token's place in the
reply, and by whether it copies the prompt (the token and the one before it occur together in
the prompt). If the two sets agree bucket by bucket, a benchmark's lower agreement is the target's
own doubt on its questions, which more data of the training kind cannot remove; if they part
within a bucket, the data misses what the benchmark asks.

    python -m specd.platform exec -- python benchmarks/agreement_by_confidence.py \
        [--questions mt-bench] [--every 8] [--sharegpt 20] [--tokens 128] [--weights DIR]
        [--read-out head|target] [--chats FILE ...]

The ShareGPT prompts are opening messages of the conversations `specd distill` reaches last
(the end of its seed-0 shuffle, past every distilled record the shipped drafters trained on;
none holding a benchmark question), at most --max-prompt-tokens long; the target answers each
greedily. --chats adds a set per ShareGPT-format file (e.g. `specd distill` records: their
first user messages, answered afresh).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx.core as mx
import numpy as np

from coordinator.bench import plain_decode
from drafter_svc.config import DrafterConfig, drafter_options
from drafter_svc.data import Example, TargetFeatures, head_matrix, read_conversations, to_messages
from drafter_svc.distill import user_turns
from drafter_svc.eagle3.train import Trainer, TrainOptions, ttt_forward
from drafter_svc.server import make_proposer
from specd.datasets import benchmark_key, benchmark_keys, load_questions, sharegpt_conversations
from specd.models.load import load_target
from specd.prompts import encode_chat

SHIPPED = Path(__file__).resolve().parents[1] / "drafter_svc/eagle3/heads/smollm2-135m-instruct"
CONFIDENCE_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.01)
PLACE_EDGES = (0, 16, 64, 10**9)


def sharegpt_chats(count: int, max_prompt_tokens: int, tokenizer, seed: int) -> list[list[dict]]:
    excluded = benchmark_keys()
    chosen = []
    for chat in reversed(user_turns(sharegpt_conversations(), seed, "first")):
        text = chat[-1]["content"]
        if not text or benchmark_key(text) in excluded:
            continue
        if len(encode_chat(tokenizer, chat)) <= max_prompt_tokens:
            chosen.append(chat)
        if len(chosen) == count:
            break
    return chosen


def first_messages(path: Path) -> list[list[dict]]:
    """The first user message of every record of a ShareGPT-format file, as a chat."""
    chats = (to_messages(record) for record in read_conversations(path))
    return [[chat[0]] for chat in chats if chat is not None]


def replies(loaded, chats, tokens: int, capture) -> list:
    """The target's greedy reply to each chat, as the trainer's features (loss on the reply)."""
    features = TargetFeatures(loaded.model, capture)
    eos = set(loaded.identity.eos_token_ids)
    out = []
    for chat in chats:
        ids = encode_chat(loaded.tokenizer, chat)
        reply = plain_decode(loaded.model, ids, tokens, eos).token_ids
        seq = np.array(ids + reply, np.int32)
        mask = np.zeros(len(seq), bool)
        mask[len(ids) :] = True
        out.append(features(Example(seq, mask)))
    return out


def first_draft_table(trainer: Trainer, feats) -> dict:
    """Per position of every reply: the target's top-1 probability, the place in the reply,
    whether the head's pass-1 argmax is the target's token."""
    read_out = np.array(head_matrix(trainer.loaded.model).astype(mx.float32))
    sure, place, right, drawable, copied = [], [], [], [], []
    for f in feats:
        emb_next, rows, _, _, target_next, base = trainer.batch([f])
        logits = ttt_forward(trainer.head, emb_next, rows, 1)
        predicted = trainer.draft_ids[np.array(logits.argmax(-1))][0, 0]
        # the target's probability of its own greedy token (batch's rows i: f's i + 1)
        n = len(f.ids) - 2
        final = f.final[1 : n + 1].astype(np.float32)
        chosen = (final * read_out[f.argmax[1 : n + 1]]).sum(-1)
        top = np.exp(chosen - f.lse[1 : n + 1])
        sel = base[0]
        start = int(np.argmax(sel))
        sure.append(top[sel])
        place.append(np.nonzero(sel)[0] - start)
        right.append(predicted[sel] == target_next[0][sel])
        drawable.append(np.isin(target_next[0][sel], trainer.draft_ids))
        # row i drafts f.ids[i + 2] after f.ids[i + 1]
        prompt = f.ids[: int(np.argmax(f.loss_mask))].tolist()
        pairs = set(zip(prompt, prompt[1:], strict=False))
        rows_at = np.nonzero(sel)[0]
        copied.append(np.array([(int(f.ids[i + 1]), int(f.ids[i + 2])) in pairs for i in rows_at]))
    columns = {"sure": sure, "place": place, "right": right, "drawable": drawable,
               "copied": copied}  # fmt: skip
    return {k: np.concatenate(v) for k, v in columns.items()}


def _right(table: dict, sel: np.ndarray) -> str:
    """First draft right over the selection, and over its tokens the draft vocabulary holds."""
    drawable = sel & table["drawable"]
    right, among = table["right"][sel].mean(), table["right"][drawable].mean()
    return (f"first draft right {right:.3f} ({among:.3f} of the {drawable.sum() / sel.sum():.3f} "
            f"in the draft vocabulary)")  # fmt: skip


def report(name: str, table: dict) -> None:
    n = len(table["right"])
    everything = np.ones(n, bool)
    print(f"{name}: {n} positions, {_right(table, everything)}, the target's top-1 "
          f"probability {table['sure'].mean():.3f} on average")  # fmt: skip
    for lo, hi in zip(CONFIDENCE_EDGES, CONFIDENCE_EDGES[1:], strict=False):
        sel = (table["sure"] >= lo) & (table["sure"] < hi)
        if sel.any():
            print(f"  target sure {lo:.1f}-{min(hi, 1.0):.1f}: {sel.mean():.3f} of positions, "
                  f"{_right(table, sel)}")  # fmt: skip
    for lo, hi in zip(PLACE_EDGES, PLACE_EDGES[1:], strict=False):
        sel = (table["place"] >= lo) & (table["place"] < hi)
        if sel.any():
            label = f"{lo}-{hi - 1}" if hi < 10**9 else f"{lo}+"
            print(f"  reply tokens {label}: {sel.mean():.3f} of positions, {_right(table, sel)}, "
                  f"target sure {table['sure'][sel].mean():.3f}")  # fmt: skip
    for label, sel in (("copies the prompt", table["copied"]), ("does not", ~table["copied"])):
        if sel.any():
            print(f"  {label}: {sel.mean():.3f} of positions, {_right(table, sel)}, "
                  f"target sure {table['sure'][sel].mean():.3f}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--questions", default="mt-bench", help="a question set (first turns)")
    p.add_argument("--every", type=int, default=8, help="every Nth question")
    p.add_argument("--sharegpt", type=int, default=20, help="ShareGPT opening messages")
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument(
        "--seed", type=int, default=0, help="the ShareGPT shuffle (distill's: its last are taken)"
    )
    p.add_argument("--tokens", type=int, default=128, help="greedy reply tokens")
    p.add_argument("--weights", type=Path, default=SHIPPED, help="the head (default: shipped)")
    p.add_argument("--read-out", choices=("head", "target"), default="head",
                   help="head: its own draft vocabulary's rows; target: the target's read-out "
                   "over the whole vocabulary")  # fmt: skip
    p.add_argument("--chats", type=Path, nargs="*", default=[],
                   help="ShareGPT-format .jsonl files: their first user messages, a set "
                   "each")  # fmt: skip
    args = p.parse_args()

    loaded = load_target(None, "float32")
    proposer = make_proposer(DrafterConfig(**drafter_options("eagle3", weights=args.weights)))
    capture = proposer.capture_layers
    questions = load_questions(args.questions)[:: args.every]
    sets = {
        args.questions: [[{"role": "user", "content": q.turns[0]}] for q in questions],
        "sharegpt": sharegpt_chats(
            args.sharegpt, args.max_prompt_tokens, loaded.tokenizer, args.seed
        ),
    }
    for path in args.chats:
        sets[path.name] = first_messages(path)
    feats = {name: replies(loaded, chats, args.tokens, capture) for name, chats in sets.items()}
    opts = TrainOptions(target=None, out=Path("/dev/null"), ttt_steps=1, batch_size=1,
                        init_from=args.weights)  # fmt: skip
    trainer = Trainer(opts, loaded, [f for fs in feats.values() for f in fs])
    if args.read_out == "target":
        # the head's state through the target's own read-out over every token: what a draft
        # vocabulary of the whole vocabulary, untrained, would draft
        head, rows = trainer.head, head_matrix(loaded.model).astype(mx.float32)
        head.logits = lambda hidden: head.norm(hidden) @ rows.T
        trainer.draft_ids = np.arange(rows.shape[0])
    for name, fs in feats.items():
        report(f"{name} ({len(fs)} prompts)", first_draft_table(trainer, fs))


if __name__ == "__main__":
    main()
