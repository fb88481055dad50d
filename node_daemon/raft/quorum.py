"""Majority arithmetic over a set of voters."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import IntEnum


class VoteResult(IntEnum):
    PENDING = 0
    LOST = 1
    WON = 2


def majority(n_voters: int) -> int:
    return n_voters // 2 + 1


def committed_index(voters: Iterable[int], match: Mapping[int, int]) -> int:
    """The largest index that a majority of ``voters`` has in its log."""
    acked = sorted((match.get(v, 0) for v in voters), reverse=True)
    if not acked:
        return 0
    return acked[majority(len(acked)) - 1]


def vote_result(voters: frozenset[int], votes: Mapping[int, bool]) -> VoteResult:
    """WON once a majority granted, LOST once a majority cannot be reached."""
    granted = sum(1 for v in voters if votes.get(v) is True)
    rejected = sum(1 for v in voters if votes.get(v) is False)
    need = majority(len(voters))
    if granted >= need:
        return VoteResult.WON
    if len(voters) - rejected < need:
        return VoteResult.LOST
    return VoteResult.PENDING
