"""Acceptance rules: which drafts the target keeps, and the token it adds."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Acceptance:
    committed: list[int]  # accepted drafts, then the recovered or bonus token; cut after EOS
    num_accepted: int  # drafts among `committed`
    finished: bool  # an EOS was committed


def accept_greedy(
    draft_ids: Sequence[int], target_ids: Sequence[int], eos_ids: Collection[int]
) -> Acceptance:
    """Temperature 0: keep drafts while they equal the target's argmax, then add its argmax.

    target_ids[i] is the target's choice after [last, d1..di]; len == len(draft_ids) + 1.
    """
    if len(target_ids) != len(draft_ids) + 1:
        raise ValueError(f"need {len(draft_ids) + 1} target ids, got {len(target_ids)}")
    accepted = 0
    while accepted < len(draft_ids) and draft_ids[accepted] == target_ids[accepted]:
        accepted += 1
    return cut_at_eos([*draft_ids[:accepted], target_ids[accepted]], accepted, eos_ids)


def cut_at_eos(committed: list[int], num_accepted: int, eos_ids: Collection[int]) -> Acceptance:
    """An EOS anywhere in the committed tokens ends generation right there."""
    for i, token in enumerate(committed):
        if token in eos_ids:
            return Acceptance(committed[: i + 1], min(num_accepted, i + 1), True)
    return Acceptance(committed, num_accepted, False)
