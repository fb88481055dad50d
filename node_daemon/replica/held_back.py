"""What a node that lost its leadership with no room to apply answers for
the proposals it still holds (``answer_held_back``: the replica asks when it
stops leading and when a write fails for want of space).

Their entries are in the log and the new leader applies them, but this node
applies nothing until it has room, and its callers would wait past their
deadlines. So they are answered now, as outcome unknown: DEADLINE_EXCEEDED,
which the queue server never hands to another node (a plain publish sent
again would be stored twice: NotLeader's UNAVAILABLE is handed on) and a
client takes as unknown (the SDK sends an idempotent publish again, and it
is answered with its first outcome)."""

from __future__ import annotations

import asyncio
from typing import Any

from node_daemon.raft.proposals import PendingProposals
from node_daemon.storage.disk import DiskGuard
from roadlog.errors import Code, RoadlogError

Pending = PendingProposals[list[asyncio.Future[Any]]]


def answer_held_back(leads: bool, disk: DiskGuard, pending: Pending, node: int, group: int) -> None:
    """Off the lead with writes failing for want of space (``disk.failing``):
    answer what ``pending`` holds as outcome unknown now, not once there is
    room. A leader, or a node with room, answers them when it applies."""
    if not leads and disk.failing:
        answer_unknown(pending, node, group)


def answer_unknown(pending: Pending, node: int, group: int) -> None:
    """Answer every proposal ``pending`` holds as outcome unknown, and forget them."""
    unknown = RoadlogError(
        Code.DEADLINE_EXCEEDED,
        f"outcome unknown: node {node} lost its leadership of group {group} with no room "
        "on its disk to apply; the new leader applies what the log holds",
    )
    for futures in pending.drain():
        for fut in futures:
            if not fut.done():
                fut.set_exception(unknown)
