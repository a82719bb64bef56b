"""The EAGLE-3 head's drafting in MLX against its forwards on the host (numpy and the compiled
kernels), same head, same state, alternated call by call in one process.

    python -m specd.platform exec -- python benchmarks/eagle3_forwards.py \
        [--target MODEL] [--weights HEAD_DIR] [--context 300] [--repeats 30] [--cold-caches MB]

The state is opened on `--context` random tokens and target rows (what the drafter holds after
a prompt); then: a chain of 1, 2, 4 and 6 drafts, an extend of 1 and 3 committed tokens with
their rows (what each round sends), and a tree of 16 tokens (depth 5, top 4). Both paths must
draft the same chains, which the script checks before it times anything; on random rows a tree's
deep nodes are near-tied, so it prints the share of tree paths both drafted instead. On a GPU
"MLX" is the device: the script then says what drafting on the host saves there.
--cold-caches MB writes over MB of memory before each timed call (not timed), as a served
round finds the host's caches after the verifier's and coordinator's work: back to back, the
head's ~14 MB of weights may stay in a large last-level cache, which a service cannot count on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np

from drafter_svc.checkpoints import shipped_or_given
from drafter_svc.config import DrafterConfig
from drafter_svc.eagle3.cpu_head import CpuHead
from drafter_svc.eagle3.draft import Eagle3Drafter
from drafter_svc.eagle3.model import load_head
from drafter_svc.eagle3.proposer import SHIPPED_DIR, head_config, target_embedding
from drafter_svc.proposal import TreeShape
from drafter_svc.server import describe_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="model (default: the embedded SmolLM2)")
    parser.add_argument("--weights", help="head directory (default: the shipped one)")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument(
        "--cold-caches",
        type=int,
        default=0,
        metavar="MB",
        help="write over this much memory before each timed call (0: off)",
    )
    args = parser.parse_args()
    target_dir, identity = describe_target(DrafterConfig(kind="eagle3", target=args.target))
    weights = shipped_or_given(args.weights, SHIPPED_DIR, head_config, identity, "EAGLE-3 head",
                               "eagle3")  # fmt: skip
    head, _ = load_head(weights)
    embedding = target_embedding(target_dir)
    host = CpuHead.attach(head, embedding)
    if host is None:
        raise SystemExit("the head cannot run on the host here (no compiled kernels?)")
    drafters = {"mlx": Eagle3Drafter(head, embedding), "host": Eagle3Drafter(head, embedding, host)}
    rng = np.random.default_rng(0)
    width = len(head.config.capture_layers) * head.config.feature_size
    vocab = head.config.vocab_size
    rows = mx.array(rng.normal(size=(args.context, width)).astype(np.float32) * 0.5)
    tokens = rng.integers(0, vocab, size=args.context + 1).tolist()
    states = {name: d.open(tokens, rows) for name, d in drafters.items()}
    shape = TreeShape(total_tokens=16, depth=5, top_k=4)

    def paths(proposal) -> set[tuple[int, ...]]:
        out = set()
        for i in range(len(proposal.ids)):
            path, j = [], i
            while j >= 0:
                path.append(proposal.ids[j])
                j = proposal.parents[j] if proposal.parents else j - 1
            out.add(tuple(path))
        return out

    def same(call) -> bool:
        """The same drafts (a tree's siblings of near-equal score may come in either order)."""
        a, b = (call(drafters[n], states[n]) for n in ("mlx", "host"))
        return paths(a) == paths(b)

    def tree_overlap() -> float:
        """Share of the tree's paths both draft: on random rows the deep nodes' scores are
        near-flat, so the two paths' roundings may pick different siblings there."""
        a, b = (paths(drafters[n].tree(states[n], shape)) for n in ("mlx", "host"))
        return len(a & b) / max(len(a), 1)

    jobs = {f"chain {k}": (lambda d, s, k=k: d.chain(s, k)) for k in (1, 2, 4, 6)}
    jobs["tree 16 (depth 5, top 4)"] = lambda d, s: d.tree(s, shape)
    assert all(same(jobs[f"chain {k}"]) for k in (1, 2, 4, 6)), "the two paths' chains differ"
    print(f"tree paths drafted by both: {tree_overlap():.0%}")
    sweep = np.zeros((args.cold_caches << 20) // 8)

    def chill() -> None:
        if sweep.size:
            np.add(sweep, 1.0, out=sweep)  # every line read and written: the weights leave

    times: dict[str, dict[str, list[float]]] = {}
    for label, job in jobs.items():
        for _ in range(args.repeats):
            for name, drafter in drafters.items():
                chill()
                start = time.perf_counter()
                job(drafter, states[name])
                times.setdefault(label, {}).setdefault(name, []).append(time.perf_counter() - start)
    # extends grow both states alike; each is timed on fresh tokens and rows
    for n in (1, 3):
        label = f"extend {n}"
        for _ in range(args.repeats):
            ids = rng.integers(0, vocab, size=n).tolist()
            # numpy, as the service hands them over (the MLX head makes its own array)
            new_rows = rng.normal(size=(n, width)).astype(np.float32) * 0.5
            for name, drafter in drafters.items():
                chill()
                start = time.perf_counter()
                drafter.extend(states[name], ids, new_rows)
                times.setdefault(label, {}).setdefault(name, []).append(time.perf_counter() - start)
    assert same(jobs["chain 6"]), "the states drifted apart"
    print(f"tree paths drafted by both after the extends: {tree_overlap():.0%}")
    out = []
    for label, by in times.items():
        mlx_ms, host_ms = (1000 * statistics.median(by[n]) for n in ("mlx", "host"))
        out.append({"call": label, "mlx_ms": round(mlx_ms, 3), "host_ms": round(host_ms, 3),
                    "mlx_over_host": round(mlx_ms / host_ms, 2)})  # fmt: skip
        print(
            f"{label:<26} MLX {mlx_ms:7.2f} ms   host {host_ms:7.2f} ms   {mlx_ms / host_ms:5.1f}x"
        )
    print(json.dumps({"context": args.context, "repeats": args.repeats,
                      "cold_caches_mb": args.cold_caches, "calls": out}))  # fmt: skip


if __name__ == "__main__":
    main()
