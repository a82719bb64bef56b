"""The pooled batch's forward (`MlxForward.forward_pooled`, a GPU's path) when its sessions ask
for different numbers of new tokens: N sessions' plain steps, then the same beside one verify
of K drafts, timed in one process, the caches trimmed back after each forward a token further
each time (each forward meets new offsets, as in serving). A batch padded to its longest
session would compute 16 x 16 rows for one verify of 15 beside 15 plain steps; a ragged one
(`verifier_svc.kv_pool.RaggedRows`) computes the products of 31. The GPU is what this is for:
on a CPU a product of 2-16 rows runs as that many matrix-vector products
(specd.models.rowwise), each reading the weights, so there a few ragged rows can cost more than
a padded batch past 16 rows that one matrix product takes.

`--variants own compiled kernel` times the batch through the model's own modules, through the
compiled pooled forward (the verifier's --compiled-pooled) with the pool's masked attention, and
through it with each row's attention in one CUDA launch reading the pool in place (the
verifier's --pool-kernel; CUDA only), each mix one variant after the other on the same
sessions. Each line also gives the host's time to build the forward's graph
before MLX evaluates it: on a GPU, where a small model's step is bound by the host, the part
the compiled forward is meant to cut.

    python benchmarks/pooled_mix.py [--target DIR] [--dtype float32] [--sessions 8]
        [--drafts 0 3 15] [--calls 10] [--context 64] [--variants own compiled kernel]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from specd.cpu.llama import Segment
from specd.models.load import load_target
from verifier_svc.engine import Target, _rollback, prefill

VARIANTS = ("own", "compiled", "kernel")


def pooled_target(path: str | None, dtype: str) -> Target:
    """The target with its sessions in a KV pool and the compiled pooled forward built, with
    the pool kernel where it runs (`use_variant` chooses)."""
    target = Target(load_target(path, dtype), gemv_rows=0, row_forwards=True, kv_pool=True,
                    compiled_pooled=True, pool_kernel="auto")  # fmt: skip
    if target.kv_pool is None:
        raise SystemExit("this target's forward takes no pooled sessions (mlx-lm Llama only)")
    return target


def pooled_sessions(target: Target, count: int, context: int, rng: np.random.Generator) -> list:
    """`count` pooled sessions of random prompts, `context` tokens and 3 more for each next one:
    contexts of different lengths, as a batch's sessions have."""
    vocab = target.identity.vocab_size
    return [
        prefill(target, rng.integers(100, vocab - 1, context + 3 * n).tolist()).session
        for n in range(count)
    ]


def variant_switch(target: Target, variants: list[str]):
    """A function that sets the pooled forward's path to one of `variants`; exits where the
    target or device lacks one."""
    compiled = target._mlx.compiled_pooled
    kernel = compiled is not None and compiled.pool_kernel
    if {"compiled", "kernel"} & set(variants) and compiled is None:
        raise SystemExit("this target's architecture has no compiled pooled forward")
    if "kernel" in variants and not kernel:
        raise SystemExit("the pool kernel does not run here (CUDA, float32, checked at first use)")

    def use(variant: str) -> None:
        target._mlx.compiled_pooled = None if variant == "own" else compiled
        if compiled is not None:
            compiled.pool_kernel = variant == "kernel"

    return use


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="model (default: the embedded SmolLM2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--drafts", type=int, nargs="+", default=[0, 3, 15])
    parser.add_argument("--calls", type=int, default=10, help="timed forwards per mix")
    parser.add_argument("--context", type=int, default=64, help="the shortest prompt's tokens")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["own"],
                        help="the pooled forward's paths to time: the model's own modules, "
                        "the compiled one (--compiled-pooled), the compiled one with the "
                        "pool kernel (--pool-kernel)")  # fmt: skip
    args = parser.parse_args()
    target = pooled_target(args.target, args.dtype)
    use_variant = variant_switch(target, args.variants)
    vocab = target.identity.vocab_size
    rng = np.random.default_rng(0)
    sessions = pooled_sessions(target, args.sessions, args.context, rng)
    forward = target._mlx.forward_pooled
    print(f"device {mx.default_device()}, {args.sessions} pooled sessions, {args.context}+ tokens "
          f"of context each; ms per forward, median of {args.calls}")  # fmt: skip
    base: dict[str, float] = {}
    for drafts in args.drafts:
        lengths = [1] * (args.sessions - 1) + [1 + drafts]
        for variant in args.variants:
            use_variant(variant)
            times, builds = [], []
            for call in range(args.calls + 2):  # the first two compile the shapes
                segments = [
                    Segment(rng.integers(100, vocab - 1, n), s.cache)
                    for n, s in zip(lengths, sessions, strict=True)
                ]
                start = time.perf_counter()
                outs = forward(segments, frozenset())
                built = time.perf_counter()
                mx.eval([logits for logits, _ in outs])
                if call >= 2:
                    times.append(time.perf_counter() - start)
                    builds.append(built - start)
                for s in sessions:
                    _rollback(s.cache, max(1, s.position - 2 - call))
            ms = 1000 * statistics.median(times)
            first = base.setdefault(variant, ms)
            build_ms = 1000 * statistics.median(builds)
            print(
                f"{variant:8s} {args.sessions - 1} plain steps + a verify of {drafts:2d}: "
                f"{ms:8.1f} ms ({ms / first:.2f}x the first mix; {sum(lengths)} real rows), "
                f"{build_ms:.2f} ms of it building the graph"
            )


if __name__ == "__main__":
    main()
