"""The leader's side of consumer groups: joins, leaves and commits go
through the log; heartbeats do not (they only say "still here"), the leader
keeps them in memory and expires a silent member through the log.

After a change of leader nobody's heartbeat is known, so every member gets
a full session timeout of grace from the moment the new leader first looks.
The same holds for a member's revoking partitions: one that has not
released them a session timeout after the leader first saw them revoking
has them taken away (through the log), so a member that stopped reading
but still heartbeats cannot hold partitions forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from node_daemon.replica.remote import ReplicaView
from node_daemon.replica.replica import NotLeader, Replica
from node_daemon.state.consumer_groups import check_group_name, default_quotas, session_timeout
from node_daemon.state.responses import OpResult
from roadlog.errors import Code, RoadlogError
from roadlog.placement import group_of
from roadlog.v1 import client_pb2, command_pb2, groups_pb2

log = logging.getLogger("roadlog.groups")

EXPIRY_CHECK_S = 0.25
COMMIT_CATCH_UP_S = 1.0  # how long a commit waits for a data group's replica here


def _end_of(data: ReplicaView, topic: str, partition: int) -> int:
    """The partition's next offset in ``data``'s replica (0: not placed
    there yet, nothing stored); UNAVAILABLE while the replica (run by
    another process) cannot be read."""
    state = data.sm
    try:
        return state.describe(topic).partitions[partition].next_offset
    except RoadlogError as e:
        if e.code != Code.NOT_FOUND:
            raise
        return 0


class ConsumerGroupCoordinator:
    def __init__(self, node: Replica) -> None:
        self.node = node
        self.last_seen: dict[tuple[str, str], float] = {}
        # (group, member) -> (its revoking partitions, when first seen so)
        self.revoking_since: dict[tuple[str, str], tuple[tuple[int, ...], float]] = {}
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

    async def join(self, request: bytes, principal: str = "") -> OpResult:
        """``principal``: the caller's authenticated identity (the request's
        client id then): the member, and a group the join creates, count
        against its quotas. A join past a quota is refused here, before it
        costs a log entry, and again where it is applied (joins proposed
        side by side)."""
        req = client_pb2.JoinGroupRequest.FromString(request)
        check_group_name(req.group)
        session_timeout(req.session_timeout_ms)
        self.node.sm.topic(req.topic)  # NOT_FOUND before proposing
        if not req.member_id:
            prefix = (req.client_id or "member")[:40]
            req.member_id = f"{prefix}-{uuid.uuid4().hex[:12]}"
        op = command_pb2.JoinGroupOp(
            request=req, bound=bool(principal) and req.client_id == principal
        )
        op.quotas.CopyFrom(default_quotas())
        refused = self.node.sm.group_join_refusal(op)
        if refused is not None:
            raise refused
        res = await self.node.propose_op(command_pb2.Op(join_group=op))
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
            revoking=me.revoking,
        )
        return OpResult(response=resp.SerializeToString())

    async def commit(self, request: bytes) -> OpResult:
        req = client_pb2.CommitOffsetsRequest.FromString(request)
        self._require_leader()
        await self._within_data_groups(req)
        res = await self.node.propose_op(
            command_pb2.Op(commit_offsets=command_pb2.CommitOffsetsOp(request=req))
        )
        if res.code == Code.OK:
            self._seen(req.group, req.member_id)
        return res

    async def _within_data_groups(self, req: client_pb2.CommitOffsetsRequest) -> None:
        """A topic placed in data groups: each offset at most its partition's
        end in its group. A consumer commits what a node served it, which
        that group committed, but this node's replica may lag that node:
        an offset past this replica's end (once it applied what it knows
        committed) is judged again after a linearizable read of the group
        (ReadIndex: every commit before it is applied here), and refused
        only then; UNAVAILABLE (tried again) when that read cannot be had."""
        sm = self.node.sm
        g = sm.describe_group(req.group).group if req.offsets else None
        if g is None or not g.topic:
            return
        try:
            topic = sm.topic(g.topic)
        except RoadlogError:
            return  # the apply answers as it would
        if not topic.partition_groups:
            return
        for o in req.offsets:
            if o.partition >= topic.spec.partitions:
                continue  # refused at apply (not assigned)
            data = self.node.raft_groups.get(group_of(topic, o.partition))
            if data is None:
                raise RoadlogError(Code.UNAVAILABLE, "this node runs no group of that partition")
            with contextlib.suppress(TimeoutError):
                await data.wait_applied(data.committed_index(), COMMIT_CATCH_UP_S)
            end = _end_of(data, g.topic, o.partition)
            if o.offset > end:
                try:
                    await asyncio.wait_for(data.read_barrier(), COMMIT_CATCH_UP_S)
                except (TimeoutError, NotLeader, RoadlogError) as e:
                    raise RoadlogError(
                        Code.UNAVAILABLE,
                        f"cannot tell the end of partition {o.partition} now ({e}): try again",
                    ) from None
                end = _end_of(data, g.topic, o.partition)
            if o.offset > end:
                raise RoadlogError(
                    Code.INVALID_ARGUMENT,
                    f"offset {o.offset} is past the end of partition {o.partition}",
                )

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
                self.revoking_since.clear()
            except Exception:
                log.exception("expiring group members failed")

    async def expire_silent(self) -> None:
        """Propose the removal of every member silent for longer than its
        group's session timeout (leader only)."""
        if not self.node.is_leader:
            self.last_seen.clear()
            self.revoking_since.clear()
            return
        now = time.monotonic()
        groups = self.node.sm.group_records()  # offsets not needed: about half the cost
        live = {(g.name, m.member_id) for g in groups for m in g.members}
        for key in self.revoking_since.keys() - live:
            del self.revoking_since[key]
        for g in groups:
            if not g.members:
                continue
            timeout = g.session_timeout_ms / 1000
            await self._take_held_partitions(g, now, timeout)
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

    async def _take_held_partitions(self, g: groups_pb2.Group, now: float, timeout: float) -> None:
        """Release, without a commit, the revoking partitions of members that
        have held them for longer than the session timeout."""
        for m in g.members:
            key = (g.name, m.member_id)
            parts = tuple(m.revoking)
            if not parts:
                self.revoking_since.pop(key, None)
                continue
            seen, since = self.revoking_since.get(key, ((), now))
            if seen != parts:
                since = now  # a new set to give up: a new grace
            self.revoking_since[key] = (parts, since)
            if now - since <= timeout:
                continue
            log.info(
                "taking back partitions not released in time",
                extra={"group": g.name, "member": m.member_id, "partitions": list(parts)},
            )
            op = command_pb2.ReleasePartitionsOp(
                group=g.name, member_id=m.member_id, partitions=parts
            )
            await self.node.propose_op(command_pb2.Op(release_partitions=op))
            self.revoking_since.pop(key, None)
