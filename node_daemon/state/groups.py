"""Consumer groups in the state machine (applied from the log, so every
replica holds the same groups, assignments and committed offsets).

Rebalancing is cooperative. The target assignment is round robin over the
members sorted by id (every replica computes the same). A partition whose
owner stays goes on being read by it; one whose owner left goes to its
target at once; one that must move stays with its owner, marked revoking,
until the owner commits and releases it (or holds it past its session
timeout and has it taken away), and only then goes to its target. So a
member joining or leaving in good order makes nobody re-read anything.

Invariants: each partition is owned by at most one member, and by exactly
one while the group has members and no move is under way; ``revoking`` is a
subset of ``partitions``; every change of membership bumps the generation;
an offset commit is accepted only from a current member, in the current
generation, for partitions it owns.
"""

from __future__ import annotations

import re
import struct
from typing import Any

from roadlog.errors import Code, RoadlogError
from roadlog.v1 import client_pb2, groups_pb2

GROUP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
DEFAULT_SESSION_TIMEOUT_MS = 10_000
MIN_SESSION_TIMEOUT_MS = 1_000
MAX_SESSION_TIMEOUT_MS = 300_000
MAX_MEMBERS = 1_000
_OFFSET_VAL = struct.Struct(">Qq")  # offset, committed ms


def check_group_name(name: str) -> None:
    if not GROUP_NAME.match(name):
        raise RoadlogError(
            Code.INVALID_ARGUMENT,
            f"bad group name {name!r}: letters, digits, '.', '_' or '-', 1..128 characters",
        )


def session_timeout(requested: int) -> int:
    t = requested or DEFAULT_SESSION_TIMEOUT_MS
    if not MIN_SESSION_TIMEOUT_MS <= t <= MAX_SESSION_TIMEOUT_MS:
        raise RoadlogError(
            Code.INVALID_ARGUMENT,
            f"session timeout must be in {MIN_SESSION_TIMEOUT_MS}..{MAX_SESSION_TIMEOUT_MS} ms",
        )
    return t


def _offset_key(group: str, partition: int) -> bytes:
    return group.encode() + b"\x00" + struct.pack(">I", partition)


class GroupTables:
    """The ``groups`` (name -> Group) and ``offsets`` (name, partition ->
    offset, ms) databases."""

    def __init__(self, groups_db: Any, offsets_db: Any) -> None:
        self.groups = groups_db
        self.offsets = offsets_db

    # ------------------------------------------------------------- reading

    def get(self, txn: Any, name: str) -> groups_pb2.Group | None:
        check_group_name(name)  # also keeps LMDB from an empty or oversized key
        raw = txn.get(name.encode(), db=self.groups)
        return groups_pb2.Group.FromString(raw) if raw is not None else None

    def describe(self, txn: Any, name: str) -> groups_pb2.GroupDescription:
        g = self.get(txn, name)
        if g is None:
            raise RoadlogError(Code.NOT_FOUND, f"no group {name!r}")
        d = groups_pb2.GroupDescription(group=g)
        prefix = name.encode() + b"\x00"
        cur = txn.cursor(db=self.offsets)
        if cur.set_range(prefix):
            for k, v in cur:
                if not k.startswith(prefix):
                    break
                (p,) = struct.unpack(">I", k[len(prefix) :])
                off, ms = _OFFSET_VAL.unpack(v)
                d.offsets.add(partition=p, offset=off, committed_ms=ms)
        return d

    def names(self, txn: Any) -> list[str]:
        return [bytes(k).decode() for k, _ in txn.cursor(db=self.groups)]

    # ------------------------------------------------------------ applying

    def join(
        self,
        txn: Any,
        req: client_pb2.JoinGroupRequest,
        partitions: int,
        leader_ms: int,
        index: int,
    ) -> client_pb2.JoinGroupResponse:
        check_group_name(req.group)
        if not req.member_id:
            raise RoadlogError(Code.INVALID_ARGUMENT, "a join without a member id")
        timeout = session_timeout(req.session_timeout_ms)
        g = self.get(txn, req.group)
        if g is None:
            g = groups_pb2.Group(name=req.group, topic=req.topic, session_timeout_ms=timeout)
        elif g.topic != req.topic:
            raise RoadlogError(
                Code.FAILED_PRECONDITION,
                f"group {req.group!r} reads topic {g.topic!r}, not {req.topic!r}",
            )
        if not any(m.member_id == req.member_id for m in g.members):
            if len(g.members) >= MAX_MEMBERS:
                raise RoadlogError(Code.RESOURCE_EXHAUSTED, "the group is full")
            g.members.add(member_id=req.member_id, client_id=req.client_id, joined_ms=leader_ms)
            g.session_timeout_ms = timeout
            self._rebalance(g, partitions)
            txn.put(req.group.encode(), g.SerializeToString(), db=self.groups)
        me = next(m for m in g.members if m.member_id == req.member_id)
        return client_pb2.JoinGroupResponse(
            member_id=me.member_id,
            generation=g.generation,
            partitions=me.partitions,
            heartbeat_interval_ms=g.session_timeout_ms // 3,
            applied_index=index,
            revoking=me.revoking,
        )

    def leave(self, txn: Any, group: str, member_ids: list[str], partitions: int) -> int:
        """Remove the members (those still there); the generation after."""
        g = self.get(txn, group)
        if g is None:
            raise RoadlogError(Code.NOT_FOUND, f"no group {group!r}")
        gone = set(member_ids)
        keep = [m for m in g.members if m.member_id not in gone]
        if len(keep) != len(g.members):
            del g.members[:]
            g.members.extend(keep)
            self._rebalance(g, partitions)
            txn.put(group.encode(), g.SerializeToString(), db=self.groups)
        return g.generation

    def commit(
        self,
        txn: Any,
        req: client_pb2.CommitOffsetsRequest,
        ends: dict[int, int],
        leader_ms: int,
        partitions: int,
    ) -> None:
        """Store offsets (``ends`` maps each partition to its next offset),
        then release the revoking partitions the request gives up."""
        g = self.get(txn, req.group)
        if g is None:
            raise RoadlogError(Code.NOT_FOUND, f"no group {req.group!r}")
        me = next((m for m in g.members if m.member_id == req.member_id), None)
        if me is None:
            raise RoadlogError(
                Code.FAILED_PRECONDITION,
                f"{req.member_id!r} is not a member of {req.group!r} (expired?): join again",
            )
        if req.generation != g.generation:
            raise RoadlogError(
                Code.FAILED_PRECONDITION,
                f"stale generation {req.generation}: the group is at {g.generation}",
            )
        owned = set(me.partitions)
        for o in req.offsets:
            if o.partition not in owned:
                raise RoadlogError(
                    Code.FAILED_PRECONDITION,
                    f"partition {o.partition} is not assigned to {req.member_id!r}",
                )
            if o.offset > ends.get(o.partition, 0):
                raise RoadlogError(
                    Code.INVALID_ARGUMENT,
                    f"offset {o.offset} is past the end of partition {o.partition}",
                )
        for o in req.offsets:
            txn.put(
                _offset_key(req.group, o.partition),
                _OFFSET_VAL.pack(o.offset, leader_ms),
                db=self.offsets,
            )
        if req.release:
            self._release(g, me, req.release, partitions)
            txn.put(req.group.encode(), g.SerializeToString(), db=self.groups)

    def release(
        self, txn: Any, group: str, member_id: str, parts: list[int], partitions: int
    ) -> None:
        """Take revoking partitions away from a member without a commit (it
        held them too long); a member or partition gone meanwhile is no
        error: the op may have been proposed before it left."""
        g = self.get(txn, group)
        if g is None:
            return
        me = next((m for m in g.members if m.member_id == member_id), None)
        if me is None:
            return
        self._release(g, me, parts, partitions)
        txn.put(group.encode(), g.SerializeToString(), db=self.groups)

    def drop_topic(self, txn: Any, topic: str) -> None:
        """Forget the groups of a deleted topic, with their offsets."""
        for name in self.names(txn):
            g = self.get(txn, name)
            if g is not None and g.topic == topic:
                self._drop(txn, name)

    def delete(self, txn: Any, name: str) -> None:
        """Delete a group that no member is in any more, with its offsets."""
        g = self.get(txn, name)
        if g is None:
            raise RoadlogError(Code.NOT_FOUND, f"no group {name!r}")
        if g.members:
            raise RoadlogError(
                Code.FAILED_PRECONDITION,
                f"group {name!r} has {len(g.members)} members; they must leave (or expire) first",
            )
        self._drop(txn, name)

    def _drop(self, txn: Any, name: str) -> None:
        txn.delete(name.encode(), db=self.groups)
        cur = txn.cursor(db=self.offsets)
        prefix = name.encode() + b"\x00"
        if cur.set_range(prefix):
            while cur.key().startswith(prefix):
                if not cur.delete():
                    break

    @staticmethod
    def _targets(g: groups_pb2.Group, partitions: int) -> dict[int, str]:
        """Partition -> member id: round robin over the members sorted by id
        (the members are kept sorted)."""
        ids = [m.member_id for m in g.members]
        return {p: ids[p % len(ids)] for p in range(partitions)} if ids else {}

    @classmethod
    def _rebalance(cls, g: groups_pb2.Group, partitions: int) -> None:
        """After a change of membership: sort the members, keep what each
        owns, mark what must move as revoking, hand free partitions to their
        targets at once; bump the generation."""
        members = sorted(g.members, key=lambda m: m.member_id)
        del g.members[:]
        g.members.extend(members)
        targets = cls._targets(g, partitions)
        owned = {p for m in g.members for p in m.partitions if p < partitions}
        for m in g.members:
            keep = [p for p in m.partitions if p < partitions]
            free = [p for p, t in targets.items() if t == m.member_id and p not in owned]
            _set(m.partitions, sorted({*keep, *free}))
            _set(m.revoking, sorted(p for p in keep if targets[p] != m.member_id))
        g.generation += 1

    @classmethod
    def _release(
        cls, g: groups_pb2.Group, me: groups_pb2.GroupMember, parts: Any, partitions: int
    ) -> None:
        """Move ``me``'s revoking partitions among ``parts`` to their targets;
        others in ``parts`` (no longer revoking) stay with ``me``."""
        revoking = set(me.revoking)
        moving = {p for p in parts if p in revoking}
        if not moving:
            return
        targets = cls._targets(g, partitions)
        _set(me.partitions, [p for p in me.partitions if p not in moving])
        _set(me.revoking, [p for p in me.revoking if p not in moving])
        by_id = {m.member_id: m for m in g.members}
        for p in sorted(moving):
            t = by_id.get(targets.get(p, ""))
            if t is not None and t.member_id != me.member_id:
                _set(t.partitions, sorted({*t.partitions, p}))


def _set(field: Any, values: list[int]) -> None:
    """Replace a repeated scalar field's values."""
    del field[:]
    field.extend(values)
