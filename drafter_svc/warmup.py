"""Run a model drafter's forwards of every size before the drafter reports SERVING.

A GPU compiles kernels per class of shapes at first use (verifier_svc.warmup says what that
costs); a model drafter's shapes vary with k, with the rows a round brings (1 to k + 1 accepted
positions), with tree sizes and with drafting past speculative ids. The full warm-up meets each
once, at a short and at a long context, on a session it then drops. n-gram drafting computes
nothing on a device and needs none.
"""

from __future__ import annotations

import time

import numpy as np

from drafter_svc.proposal import TreeShape
from specd.v1 import common_pb2


def _row_width(proposer) -> int:
    cfg = proposer.drafter.cfg
    return len(proposer.capture_layers) * int(getattr(cfg, "feature_size", 0) or cfg.hidden_size)


def full_warmup(proposer, vocab_size: int, contexts=(64, 2112)) -> int:
    """Every draft shape once; returns the drafts proposed."""
    import mlx.core as mx

    rng = np.random.default_rng(0)
    width = _row_width(proposer)

    def rows(n: int):
        return mx.array(rng.standard_normal((n, width)).astype(np.float16))

    def ids(n: int) -> list[int]:
        return rng.integers(0, vocab_size, size=n).tolist()

    top = proposer.max_draft_tokens
    sampled = common_pb2.SamplingParams(temperature=1.0)
    tree = proposer.default_tree
    calls = 0
    for context in contexts:
        state = proposer.open(ids(context), rows(context - 1))  # the last row comes later
        for k in range(1, top + 1):
            proposer.propose(state, k)
            proposer.extend(state, ids(k + 1), rows(k + 1))  # what a round of k brings back
        proposer.propose(state, proposer.default_draft_tokens, sampled)
        calls += top + 1
        if proposer.accepts_speculative_ids:
            for s in range(1, top + 1):
                proposer.propose(state, proposer.default_draft_tokens, None, ids(s))
            calls += top
        if tree is not None:  # a chain-default tree drafter still takes the trees asked of it
            most = tree.total_tokens if tree.total_tokens > 0 else TreeShape.total_tokens
            for total in range(2, most + 1):
                proposer.propose(state, top, None, (), TreeShape(total, tree.depth, tree.top_k))
            calls += most - 1
    return calls


def warm_up_drafter(proposer, vocab_size: int, mode: str = "auto") -> tuple[str, int, float]:
    """(mode run, calls, seconds); auto: full for model drafters on a GPU, else nothing."""
    from specd.models.load import warmup_mode

    mode = warmup_mode(mode)
    if mode == "minimal" or not proposer.capture_layers:
        return "minimal", 0, 0.0
    start = time.perf_counter()
    calls = full_warmup(proposer, vocab_size)
    return mode, calls, time.perf_counter() - start
