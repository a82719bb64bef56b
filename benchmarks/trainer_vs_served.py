"""Whether an EAGLE-3 head's agreement in training carries to serving: on the target's own
greedy replies to benchmark questions, the trainer's held-out agreement computation (every
pass of the training-time test) against the served drafter's first draft on each prefix of the
same sequences. Equal numbers mean the serving path is what the trainer measures, and a gap
between held-out training data and a benchmark is the data's, not the path's.

    python benchmarks/trainer_vs_served.py [--questions mt-bench] [--every 8] [--tokens 64]
        [--weights DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from coordinator.bench import plain_decode
from drafter_svc.config import DrafterConfig, drafter_options
from drafter_svc.data import Example, TargetFeatures
from drafter_svc.eagle3.train import Trainer, TrainOptions
from drafter_svc.server import make_proposer
from specd.datasets import load_questions
from specd.models.load import load_target
from specd.prompts import encode_chat

SHIPPED = Path(__file__).resolve().parents[1] / "drafter_svc/eagle3/heads/smollm2-135m-instruct"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--questions", default="mt-bench", help="a question set (first turns)")
    p.add_argument("--every", type=int, default=8, help="every Nth question")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per question")
    p.add_argument("--weights", type=Path, default=SHIPPED, help="the head (default: shipped)")
    p.add_argument("--ttt-steps", type=int, default=6, help="passes the trainer unrolls")
    args = p.parse_args()
    from drafter_agreement import first_draft_agreement  # this directory is on the path

    loaded = load_target(None, "float32")
    proposer = make_proposer(DrafterConfig(**drafter_options("eagle3", weights=args.weights)))
    features = TargetFeatures(loaded.model, proposer.capture_layers)
    eos = set(loaded.identity.eos_token_ids)
    feats, served, positions = [], 0.0, 0
    for question in load_questions(args.questions)[:: args.every]:
        ids = encode_chat(loaded.tokenizer, [{"role": "user", "content": question.turns[0]}])
        out = plain_decode(loaded.model, ids, args.tokens, eos).token_ids
        seq = np.array(ids + out, np.int32)
        reply = np.zeros(len(seq), bool)
        reply[len(ids) :] = True
        f = features(Example(seq, reply))
        feats.append(f)
        served += first_draft_agreement(proposer, seq, f.rows, f.argmax, len(ids)) * (len(out) - 1)
        positions += len(out) - 1
    opts = TrainOptions(target=None, out=Path("/dev/null"), ttt_steps=args.ttt_steps,
                        batch_size=4, init_from=args.weights)  # fmt: skip
    trained = Trainer(opts, loaded, feats).agreement(feats)
    print(f"served first draft: {served / positions:.3f} over {positions} positions")
    print("trainer's agreement per pass: " + " ".join(f"{a:.3f}" for a in trained))


if __name__ == "__main__":
    main()
