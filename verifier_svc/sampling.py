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
    the model's own probabilities, then the temperature applies to what is left. A served
    step may draw for many sampled sessions on the host (filtered sampling, verifies with
    drafts, every draw on a CPU), so each pass over the vocabulary counts: shifted logits
    stand for the log-probabilities (the normalisation cancels), and top-p sorts only the
    tokens it may keep."""
    shifted = np.array(logits, dtype=np.float64)
    shifted -= shifted.max()
    if 0 < cfg.top_p < 1 or cfg.min_p > 0 or 0 < cfg.top_k < len(shifted):
        shifted[~_kept_by_filters(shifted, cfg)] = -np.inf
    shifted /= cfg.temperature
    p = np.exp(shifted, out=shifted)
    p /= p.sum()
    return p


def _kept_by_filters(shifted: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """Which tokens top-p, min-p and top-k keep, given logits less their maximum."""
    keep = np.ones(shifted.shape, dtype=bool)
    if 0 < cfg.top_p < 1:
        probs = np.exp(shifted)
        probs /= probs.sum()
        keep[_cut_by_top_p(probs, cfg.top_p)] = False
    if cfg.min_p > 0:
        keep &= shifted >= np.log(cfg.min_p)  # p >= min_p * max p
    if 0 < cfg.top_k < len(shifted):
        keep &= _in_top_k(shifted, cfg.top_k)
    return keep


def _in_top_k(shifted: np.ndarray, k: int) -> np.ndarray:
    """The k most likely tokens, ties at the k-th taken in index order (as top-p takes them,
    so the two filters never leave nothing), looked for among the tokens near the top where k
    of them are."""
    for margin in (8.0, 32.0, np.inf):
        near = np.flatnonzero(shifted >= -margin)
        if len(near) >= k:
            break
    values = shifted[near]
    kth = -np.partition(-values, k - 1)[k - 1]
    above = near[values > kth]
    tied = near[values == kth][: k - len(above)]  # near is in index order
    in_top = np.zeros(shifted.shape, dtype=bool)
    in_top[above] = in_top[tied] = True
    return in_top


def _cut_by_top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The tokens top-p drops: those whose strictly more likely tokens (ties in index order)
    already hold top_p. Where the tokens of at least `floor` hold top_p, every token below it
    is dropped and only those above are sorted; the order among them, and so each one's mass
    before it, is the whole vocabulary's."""
    for floor in (1e-3, 1e-6, 0.0):
        likely = np.flatnonzero(probs >= floor)
        if floor == 0.0 or probs[likely].sum() >= top_p:
            break
    order = likely[np.argsort(-probs[likely], kind="stable")]
    ranked = probs[order]
    mass_before = np.cumsum(ranked) - ranked
    dropped = np.ones(probs.shape, dtype=bool)
    dropped[order[mass_before < top_p]] = False
    return dropped


# sample() sums the distribution in blocks: one pass for the block sums, then a running sum
# over the blocks and over one block, in place of a running sum over the whole vocabulary
SAMPLE_BLOCK = 256


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """A token drawn from p (unnormalised is fine): the first whose running sum passes a
    uniform draw times the total."""
    blocks = -(-len(p) // SAMPLE_BLOCK)
    whole = p
    if len(p) % SAMPLE_BLOCK:  # the last block padded with zeros
        whole = np.zeros(blocks * SAMPLE_BLOCK)
        whole[: len(p)] = p
    block_totals = np.cumsum(whole.reshape(blocks, -1).sum(axis=1))
    target = rng.random() * block_totals[-1]
    block = min(int(np.searchsorted(block_totals, target, side="right")), blocks - 1)
    start = block * SAMPLE_BLOCK
    before = block_totals[block - 1] if block else 0.0
    running = before + np.cumsum(p[start : start + SAMPLE_BLOCK])
    offset = min(int(np.searchsorted(running, target, side="right")), len(running) - 1)
    index = start + offset
    if p[index] <= 0:  # the sums' rounding left the draw past its block's last token
        positive = np.flatnonzero(p[: index + 1] > 0)
        if len(positive):
            index = int(positive[-1])
    return index


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
