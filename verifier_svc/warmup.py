"""Run every forward a round can ask of the verifier before it reports SERVING.

On a GPU, MLX compiles a kernel the first time a forward meets a new class of shapes (on an H200
with MLX's CUDA build: about 15 s per kernel module; a 4-bit SmolLM2 met new ones at 1, 8 and
17 tokens per forward and at its first long prefill). Without a warm-up the first client pays
for all of them. The full warm-up runs, at a short and at a long context: verifies of every size
up to max_draft_tokens + 1, draft trees of every size, a decode burst, a sampled verify, with and
without hidden-row capture. The compiled kernels are kept on disk (specd.mlx_settings), so a
restart on the same machine spends seconds here, not minutes. On a CPU nothing is compiled per
shape and a token's round trip is all a warm-up needs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from specd.models.load import warmup_mode
from verifier_svc.engine import PREFILL_CHUNK, Target, decode, prefill, verify, verify_tree
from verifier_svc.sampling import SamplingConfig


@dataclass
class WarmupReport:
    mode: str
    calls: int  # prefills, verifies and decode bursts run
    seconds: float


def _prompt(target: Target, length: int, seed: int) -> list[int]:
    """Token ids without an EOS, so nothing stops early."""
    vocab = target.identity.vocab_size
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=length).tolist()
    return [t if t not in target.eos_ids else (t + 1) % vocab for t in ids]


def _capture_layers(target: Target) -> tuple[int, ...]:
    layers = target.identity.num_layers
    return tuple(sorted({0, layers // 2, layers - 1}))


def full_warmup(target: Target, max_draft_tokens: int, long_context: int = PREFILL_CHUNK + 64):
    """The forwards of every round shape; returns how many engine calls ran. The long context
    stays clear of the model's limit by what the rounds below can commit (drafts are random
    tokens: a verify commits about one)."""
    calls = 0
    sizes = range(1, max_draft_tokens + 2)
    long_context = min(long_context, target.loaded.max_context - 4 * len(sizes) - 8)
    contexts = [(64, (), 1)] + [(long_context, _capture_layers(target), 2)] * (long_context > 64)
    for context, capture, seed in contexts:
        session = prefill(target, _prompt(target, context, seed), capture).session
        drafts = _prompt(target, max_draft_tokens, seed + 10)
        for n in sizes:
            verify(target, session, drafts[: n - 1])
        trees = sizes[1:] if target.supports_trees(session.cache) else ()
        for n in trees:
            verify_tree(target, session, drafts[: n - 1], list(range(-1, n - 2)))
        decode(target, session, 4)
        calls += 2 + len(sizes) + len(trees)
    sampled = SamplingConfig(temperature=1.0)
    session = prefill(target, _prompt(target, 64, 3), (), sampling=sampled, seed=0).session
    vocab = target.identity.vocab_size
    for n in (1, 2, max_draft_tokens + 1):
        verify(target, session, _prompt(target, n - 1, 4), np.full((n - 1, vocab), 1 / vocab))
    return calls + 4


def warm_up(target: Target, max_draft_tokens: int, mode: str = "auto") -> WarmupReport:
    """mode auto: full on a GPU, minimal on a CPU."""
    mode = warmup_mode(mode)
    start = time.perf_counter()
    if mode == "full":
        calls = full_warmup(target, max_draft_tokens)
    else:
        verify(target, prefill(target, _prompt(target, 3, 0)).session, _prompt(target, 2, 1))
        calls = 2
    return WarmupReport(mode, calls, time.perf_counter() - start)
