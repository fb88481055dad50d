"""Who leads a cluster, from what its hosts report, and whom to hand
leadership to: pure functions shared by the operator's tools (roadlog.tools.ops,
the Fabric CLI) and ``roadlog-node transfer-leader``.

A host's view is what its node serves on /readyz (node_id, role, term,
leader, commit_index, applied_index, member, ready) plus the state of its
systemd unit; a host whose node does not answer has `reachable=False`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HostView:
    host: str
    reachable: bool = False
    ready: bool = False
    member: bool = False
    node_id: int = 0
    role: str = "down"
    term: int = 0
    leader: int = 0
    commit_index: int = 0
    applied_index: int = 0
    service: str = "unknown"  # systemctl is-active

    @classmethod
    def from_readyz(cls, host: str, doc: dict[str, Any] | None, service: str) -> HostView:
        if not doc or "node_id" not in doc:
            return cls(host=host, service=service)
        return cls(
            host=host,
            reachable=True,
            ready=bool(doc.get("ready")),
            member=bool(doc.get("member")),
            node_id=int(doc["node_id"]),
            role=str(doc.get("role", "")),
            term=int(doc.get("term", 0)),
            leader=int(doc.get("leader", 0)),
            commit_index=int(doc.get("commit_index", 0)),
            applied_index=int(doc.get("applied_index", 0)),
            service=service,
        )


def leader_host(views: Sequence[HostView]) -> str | None:
    """The host whose node leads in the highest term any host reports;
    None while no host is leader in that term."""
    up = [v for v in views if v.reachable]
    if not up:
        return None
    term = max(v.term for v in up)
    leaders = [v for v in up if v.role == "leader" and v.term == term]
    return leaders[0].host if len(leaders) == 1 else None


def transfer_target(
    views: Sequence[HostView], prefer: int = 0, voters: Collection[int] | None = None
) -> int:
    """The node to hand leadership to: `prefer` if it is a ready member,
    else the ready member follower that has applied the most. 0 if none.
    ``voters`` (group 0's, as its leader says): only those may take over; a
    standby learner is a member that can never lead, however caught up."""
    lead = leader_host(views)
    candidates = [
        v
        for v in views
        if v.ready and v.member and v.host != lead and (voters is None or v.node_id in voters)
    ]
    if prefer:
        return prefer if any(v.node_id == prefer for v in candidates) else 0
    if not candidates:
        return 0
    return max(candidates, key=lambda v: (v.applied_index, -v.node_id)).node_id
