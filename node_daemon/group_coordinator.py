"""The leader's side of consumer groups: joins, leaves and commits go
through the log; heartbeats do not (they only say "still here"), the leader
keeps them in memory and expires a silent member through the log.

After a change of leader nobody's heartbeat is known, so every member gets
a full session timeout of grace from the moment the new leader first looks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from node_daemon.node import NotLeader, RaftNode
from node_daemon.state.groups import check_group_name, session_timeout
from node_daemon.state.machine import OpResult
from roadlog.errors import Code, RoadlogError
from roadlog.v1 import client_pb2, command_pb2

log = logging.getLogger("roadlog.groups")

EXPIRY_CHECK_S = 0.25


class GroupCoordinator:
    def __init__(self, node: RaftNode) -> None:
        self.node = node
        self.last_seen: dict[tuple[str, str], float] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start expiring silent members (does something only while leader)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._expiry_loop())

    def _seen(self, group: str, member: str) -> None:
        self.last_seen[(group, member)] = time.monotonic()

    def _require_leader(self) -> None:
        if not self.node.is_leader:
            raise NotLeader(self.node.core.lead)

    async def join(self, request: bytes) -> OpResult:
        req = client_pb2.JoinGroupRequest.FromString(request)
        check_group_name(req.group)
        session_timeout(req.session_timeout_ms)
        self.node.sm.topic(req.topic)  # NOT_FOUND before proposing
        if not req.member_id:
            prefix = (req.client_id or "member")[:40]
            req.member_id = f"{prefix}-{uuid.uuid4().hex[:12]}"
        res = await self.node.propose_op(
            command_pb2.Op(join_group=command_pb2.JoinGroupOp(request=req))
        )
        if res.code == Code.OK:
            self._seen(req.group, req.member_id)
        return res

    async def heartbeat(self, request: bytes) -> OpResult:
        req = client_pb2.HeartbeatRequest.FromString(request)
        self._require_leader()
        g = self.node.sm.describe_group(req.group).group
        me = next((m for m in g.members if m.member_id == req.member_id), None)
        if me is None:
            raise RoadlogError(
                Code.FAILED_PRECONDITION,
                f"{req.member_id!r} is not a member of {req.group!r} (expired?): join again",
            )
        self._seen(req.group, req.member_id)
        resp = client_pb2.HeartbeatResponse(
            generation=g.generation,
            partitions=me.partitions,
            applied_index=self.node.sm.applied_index,
        )
        return OpResult(response=resp.SerializeToString())

    async def commit(self, request: bytes) -> OpResult:
        req = client_pb2.CommitOffsetsRequest.FromString(request)
        self._require_leader()
        res = await self.node.propose_op(
            command_pb2.Op(commit_offsets=command_pb2.CommitOffsetsOp(request=req))
        )
        if res.code == Code.OK:
            self._seen(req.group, req.member_id)
        return res

    async def leave(self, request: bytes) -> OpResult:
        req = client_pb2.LeaveGroupRequest.FromString(request)
        self.node.sm.describe_group(req.group)  # NOT_FOUND before proposing
        res = await self.node.propose_op(
            command_pb2.Op(
                leave_group=command_pb2.LeaveGroupOp(
                    group=req.group, member_ids=[req.member_id], reason="left"
                )
            )
        )
        self.last_seen.pop((req.group, req.member_id), None)
        return res

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_CHECK_S)
            try:
                await self.expire_silent()
            except NotLeader:
                self.last_seen.clear()
            except Exception:
                log.exception("expiring group members failed")

    async def expire_silent(self) -> None:
        """Propose the removal of every member silent for longer than its
        group's session timeout (leader only)."""
        if not self.node.is_leader:
            self.last_seen.clear()
            return
        now = time.monotonic()
        for d in self.node.sm.list_groups():
            g = d.group
            timeout = g.session_timeout_ms / 1000
            expired = []
            for m in g.members:
                key = (g.name, m.member_id)
                seen = self.last_seen.setdefault(key, now)  # grace after a new leader
                if now - seen > timeout:
                    expired.append(m.member_id)
            if not expired:
                continue
            log.info("expiring silent members", extra={"group": g.name, "members": expired})
            op = command_pb2.LeaveGroupOp(group=g.name, member_ids=expired, reason="expired")
            await self.node.propose_op(command_pb2.Op(leave_group=op))
            for member_id in expired:
                self.last_seen.pop((g.name, member_id), None)
