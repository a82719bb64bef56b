"""Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) and the target's own
sampling distribution. Pure numpy; float64 so that tiny probabilities keep their meaning."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np

from verifier_svc.accept import Acceptance, cut_at_eos


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0: greedy, handled by accept_greedy
    top_k: int = 0  # 0: off
    top_p: float = 0.0  # 0 or 1: off
    min_p: float = 0.0  # 0: off

    @classmethod
    def from_proto(cls, params) -> SamplingConfig:
        return cls(params.temperature, params.top_k, params.top_p, params.min_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_distribution(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """logits [V] -> p [V], as mlx-lm's make_sampler samples: top-p, min-p and top-k filter
    the model's own probabilities, then the temperature applies to what is left."""
    logprobs = logits.astype(np.float64)
    logprobs = logprobs - logprobs.max()
    logprobs -= np.log(np.exp(logprobs).sum())
    keep = np.ones(logprobs.shape, dtype=bool)
    if 0 < cfg.top_p < 1:
        order = np.argsort(-logprobs, kind="stable")
        probs = np.exp(logprobs[order])
        mass_before = np.cumsum(probs) - probs  # mass of strictly more likely tokens
        keep[order[mass_before >= cfg.top_p]] = False
    if cfg.min_p > 0:
        keep &= logprobs >= logprobs.max() + np.log(cfg.min_p)
    if 0 < cfg.top_k < logprobs.shape[0]:
        top = np.argpartition(-logprobs, cfg.top_k - 1)[: cfg.top_k]
        in_top = np.zeros_like(keep)
        in_top[top] = True
        keep &= in_top
    scaled = np.where(keep, logprobs / cfg.temperature, -np.inf)
    p = np.exp(scaled - scaled.max())
    return p / p.sum()


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.cumsum(p)
    index = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(index, len(p) - 1)


def accept_sampled(
    draft_ids: Sequence[int],
    draft_probs: np.ndarray | None,  # [k, V]; None: one-hot drafts (n-gram, argmax drafting)
    target_row: Callable[[int], np.ndarray],  # i -> p [V] after [last, d1..di]; lazy
    rng: np.random.Generator,
    eos_ids: Collection[int],
) -> Acceptance:
    """Accept d_i with probability min(1, p(d_i)/q(d_i)); on the first rejection emit a token
    from normalize(max(0, p - q)); after a fully accepted block, a bonus token from p."""
    committed: list[int] = []
    for i, token in enumerate(draft_ids):
        p = target_row(i)
        q_token = 1.0 if draft_probs is None else float(draft_probs[i, token])
        if q_token <= 0:
            raise ValueError(f"draft {i} has probability {q_token} under its own drafter")
        # q >= p: accept with chance p/q; q < p: always accept
        if rng.random() * q_token < p[token]:
            committed.append(token)
            continue
        if draft_probs is None:
            residual = p.copy()
            residual[token] = 0.0  # max(0, p - onehot(token))
        else:
            residual = np.maximum(p - draft_probs[i], 0.0)
        # the residual is empty only if p == q, where rejection has probability 0
        committed.append(sample(residual if residual.sum() > 0 else p, rng))
        break
    else:
        committed.append(sample(target_row(len(draft_ids)), rng))
    return cut_at_eos(committed, len(committed) - 1, eos_ids)
