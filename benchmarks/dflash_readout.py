"""What a DFlash draft costs with the whole-vocabulary readout against its draft vocabulary
list, the same drafter and context, calls alternating so noise hits both alike.

    python -m specd.platform exec -- python benchmarks/dflash_readout.py [--weights DIR]
        [--target MODEL] [--context 300] [--repeats 15] [--ks 1,3,7,15]

Prints the median milliseconds per propose for each k, and whether both give the same drafts
(they differ only where the whole head's first choice is outside the list).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from drafter_svc.config import DrafterConfig, drafter_options
from drafter_svc.server import make_proposer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", type=Path, help="drafter directory (default: the shipped one)")
    parser.add_argument(
        "--context", type=int, default=300, help="committed tokens before the block"
    )
    parser.add_argument("--target", help="the drafter's target (default: the embedded model)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--ks", default="1,3,7,15", help="drafts per block")
    args = parser.parse_args()
    proposers = {
        name: make_proposer(
            DrafterConfig(
                target=args.target,
                **drafter_options("dflash", weights=args.weights, draft_vocab=n),
            )
        )
        for name, n in (("whole vocabulary", 0), ("listed", None))
    }
    listed = proposers["listed"].params()["draft_vocab"]
    drafter = proposers["listed"].drafter
    rng = np.random.default_rng(0)
    ids = rng.integers(100, 20000, size=args.context).tolist()
    rows = rng.normal(size=(args.context - 1, drafter.row_width)).astype(np.float32)
    states = {name: p.open(ids, rows) for name, p in proposers.items()}
    print(f"context {args.context} tokens; list of {listed} tokens; median of {args.repeats}")
    for k in (int(x) for x in args.ks.split(",")):
        times: dict[str, list[float]] = {name: [] for name in proposers}
        drafts = {name: p.propose(states[name], k).ids for name, p in proposers.items()}  # warm
        for _ in range(args.repeats):
            for name, p in proposers.items():
                start = time.perf_counter()
                p.propose(states[name], k)
                times[name].append(time.perf_counter() - start)
        whole, part = (1000 * statistics.median(times[n]) for n in proposers)
        same = drafts["whole vocabulary"] == drafts["listed"]
        print(
            f"k {k:>2}: whole vocabulary {whole:6.1f} ms, listed {part:6.1f} ms, "
            f"ratio {whole / part:4.1f}x, same drafts {same}"
        )


if __name__ == "__main__":
    main()
