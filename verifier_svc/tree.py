"""Draft trees: validation, the ancestor-only attention mask, and which path the target keeps.

Forward index 0 is the last committed token (the root); draft i is forward index i + 1.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import numpy as np

from verifier_svc.accept import Acceptance, cut_at_eos
from verifier_svc.sampling import sample


def check_parents(parents: Sequence[int], num_drafts: int) -> list[int]:
    """Parents must precede children; any such order (drafters list the likeliest line
    first, depth-first, so that the target keeping it leaves its KV rows in place)."""
    if len(parents) != num_drafts:
        raise ValueError(f"draft_parents has {len(parents)} entries for {num_drafts} drafts")
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(
                f"draft_parents[{i}] = {p}: a parent is -1 (the last committed token) or an "
                "earlier draft"
            )
    return list(parents)


def depths(parents: Sequence[int]) -> list[int]:
    out: list[int] = []
    for i, p in enumerate(parents):
        out.append(1 if p < 0 or p >= i else out[p] + 1)
    return out


def ancestor_mask(parents: Sequence[int]) -> np.ndarray:
    """bool [N+1, N+1]: forward index a sees b iff b is a or one of its ancestors."""
    n = len(parents) + 1
    mask = np.zeros((n, n), dtype=bool)
    mask[:, 0] = True
    for i, p in enumerate(parents, start=1):
        mask[i] = mask[p + 1] if p >= 0 else mask[0]
        mask[i, i] = True
    return mask


def _children(parents: Sequence[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        out.setdefault(p, []).append(i)
    return out


def accept_tree_greedy(
    draft_ids: Sequence[int],
    parents: Sequence[int],
    target_ids: Sequence[int],  # argmax at every forward index, len N + 1
    eos_ids: Collection[int],
) -> tuple[Acceptance, list[int]]:
    """Follow the child equal to the target's argmax from the root; return the acceptance and
    the accepted drafts' indices (root-to-leaf)."""
    children = _children(parents)
    path: list[int] = []
    node = -1
    while True:
        want = target_ids[node + 1]
        nxt = next((c for c in children.get(node, ()) if draft_ids[c] == want), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    committed = [draft_ids[i] for i in path] + [target_ids[node + 1]]
    acceptance = cut_at_eos(committed, len(path), eos_ids)
    return acceptance, path[: acceptance.num_accepted]


def accept_tree_sampled(
    draft_ids: Sequence[int],
    parents: Sequence[int],
    target_row: Callable[[int], np.ndarray],  # forward index -> p [V]; lazy
    rng: np.random.Generator,
    eos_ids: Collection[int],
) -> tuple[Acceptance, list[int]]:
    """Speculative sampling over one-hot sibling candidates: at a node, try its children in
    order, accepting child c with probability p(c) and otherwise removing c from p
    (p <- normalize(max(0, p - onehot(c)))); descend into the accepted child, or emit a token
    from what is left of p. The emitted sequence is distributed exactly as the target's."""
    children = _children(parents)
    path: list[int] = []
    node = -1
    while True:
        p = target_row(node + 1).astype(np.float64)
        accepted = None
        for c in children.get(node, ()):
            token = draft_ids[c]
            mass = p.sum()
            if mass <= 0:
                break
            if rng.random() * mass < p[token]:
                accepted = c
                break
            p[token] = 0.0
        if accepted is None:
            committed = [draft_ids[i] for i in path]
            committed.append(sample(p if p.sum() > 0 else target_row(node + 1), rng))
            acceptance = cut_at_eos(committed, len(path), eos_ids)
            return acceptance, path[: acceptance.num_accepted]
        path.append(accepted)
        node = accepted
