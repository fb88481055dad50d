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

Quotas (issue 19, finding 10): a join that adds a member, or creates a
group, is refused with RESOURCE_EXHAUSTED at apply, on every replica alike,
when it would pass the limits its op carries (``GroupQuotas``: chosen by
the leader, which checks the same before proposing so that refused joins
cost no log entry). What an identity holds is counted in ``meta`` under
two prefixes: ``gowned/`` (a group it created, until the group is deleted
or expires) and ``gjoined/`` (each member it has); the cluster's groups are
the ``groups`` database's entries and its members a counter. An empty group
whose last commit and emptying are older than the retention is deleted by
the retention trim (``expire``), on the log's clock.
"""

from __future__ import annotations

import hashlib
import re
import struct
from typing import Any

from node_daemon.state.keys import count_prefix
from roadlog.errors import Code, RoadlogError
from roadlog.v1 import client_pb2, command_pb2, federation_pb2, groups_pb2

GROUP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
DEFAULT_SESSION_TIMEOUT_MS = 10_000
MIN_SESSION_TIMEOUT_MS = 1_000
MAX_SESSION_TIMEOUT_MS = 300_000
MAX_MEMBERS = 1_000  # in one group
# Quotas (the leader's; each join carries them, see GroupQuotas). The
# leader's loop looks at every group and member every 250 ms (expiring
# silent members): about 5 us of CPU a group and 2 us a member on a loaded
# 2-core machine, so the cluster's caps keep one look near 30 ms at worst.
MAX_GROUPS = 2_000  # in the cluster
MAX_GROUP_MEMBERS = 10_000  # in the cluster, all groups together
MAX_GROUPS_PER_CLIENT = 100  # that an identity created and still has
MAX_MEMBERS_PER_CLIENT = 1_000  # of an identity, in all groups (one full group)
# An empty group goes this long after its last commit and its last member
# left (Kafka's offsets.retention.minutes is 7 days too).
GROUP_RETENTION_MS = 7 * 24 * 3600 * 1000
_OFFSET_VAL = struct.Struct(">Qq")  # offset, committed ms
_U64 = struct.Struct(">Q")
_OWNED, _JOINED, _MEMBERS = b"gowned/", b"gjoined/", b"groups/members"


def default_quotas() -> command_pb2.GroupQuotas:
    """The limits a leader puts in every join it proposes."""
    return command_pb2.GroupQuotas(
        groups=MAX_GROUPS,
        members=MAX_GROUP_MEMBERS,
        groups_per_client=MAX_GROUPS_PER_CLIENT,
        members_per_client=MAX_MEMBERS_PER_CLIENT,
    )


def _client_prefix(prefix: bytes, client_id: str) -> bytes:
    raw = client_id.encode()[:255]
    return prefix + bytes([len(raw)]) + raw


def _owned_key(client_id: str, group: str) -> bytes:
    """The meta key of a group ``client_id`` created (its quota's count)."""
    return _client_prefix(_OWNED, client_id) + group.encode()


def _joined_key(client_id: str, group: str, member_id: str) -> bytes:
    """The meta key of a member ``client_id`` has in a group (a member id
    may be long: its key holds a digest)."""
    digest = hashlib.sha256(group.encode() + b"\x00" + member_id.encode()).digest()[:16]
    return _client_prefix(_JOINED, client_id) + digest


def _days(ms: int) -> str:
    return f"{ms / 86_400_000:g} days"


def no_group(name: str) -> RoadlogError:
    """The refusal for a group that is not there, word for word the same
    for one whose topic the caller may not read (issue 39, finding 5:
    ``node_daemon/work/group_access.py``), so neither tells the other."""
    return RoadlogError(Code.NOT_FOUND, f"no group {name!r}")


def name_taken(name: str, topic: str) -> RoadlogError:
    """A join naming a group of another topic: a group's name is the
    cluster's, whatever its topic. Its topic is not said (the caller may not
    be allowed to read it), only that the name is taken."""
    return RoadlogError(
        Code.FAILED_PRECONDITION,
        f"group {name!r} reads another topic than {topic!r}: a group's name is the "
        "whole cluster's, choose another",
    )


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


class ConsumerGroupTables:
    """The ``groups`` (name -> Group) and ``offsets`` (name, partition ->
    offset, ms) databases."""

    def __init__(self, groups_db: Any, offsets_db: Any, meta_db: Any = None) -> None:
        """``meta_db``: where the quotas' counts are kept (None: counted nowhere)."""
        self.groups = groups_db
        self.offsets = offsets_db
        self.meta = meta_db

    # ------------------------------------------------------------- reading

    def get(self, txn: Any, name: str) -> groups_pb2.Group | None:
        check_group_name(name)  # also keeps LMDB from an empty or oversized key
        raw = txn.get(name.encode(), db=self.groups)
        return groups_pb2.Group.FromString(raw) if raw is not None else None

    def describe(self, txn: Any, name: str) -> groups_pb2.GroupDescription:
        g = self.get(txn, name)
        if g is None:
            raise no_group(name)
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

    def records(self, txn: Any) -> list[groups_pb2.Group]:
        """Every group, without its offsets (what the leader's scan needs)."""
        return [groups_pb2.Group.FromString(v) for _, v in txn.cursor(db=self.groups)]

    # -------------------------------------------------------------- quotas

    def _count(self, txn: Any, prefix: bytes, limit: int) -> int:
        """Meta keys under ``prefix``, counted up to ``limit``."""
        return count_prefix(txn, self.meta, prefix, limit)

    def owned(self, txn: Any, client_id: str, limit: int = MAX_GROUPS_PER_CLIENT) -> int:
        """Groups ``client_id`` created and still has (counted up to ``limit``)."""
        return self._count(txn, _client_prefix(_OWNED, client_id), limit)

    def joined(self, txn: Any, client_id: str, limit: int = MAX_MEMBERS_PER_CLIENT) -> int:
        """Members ``client_id`` has in all groups (counted up to ``limit``)."""
        return self._count(txn, _client_prefix(_JOINED, client_id), limit)

    def group_count(self, txn: Any) -> int:
        return int(txn.stat(self.groups)["entries"])

    def member_count(self, txn: Any) -> int:
        """Members of all groups: the counter, or (a state from before it)
        counted once from the groups."""
        raw = txn.get(_MEMBERS, db=self.meta) if self.meta is not None else None
        if raw is not None:
            return int(_U64.unpack(raw)[0])
        return sum(len(g.members) for g in self.records(txn))

    def _members_changed(self, txn: Any, before: int, delta: int) -> None:
        """Record the cluster's member count: ``before`` (``member_count``
        read before the change) plus ``delta``."""
        if self.meta is not None:
            txn.put(_MEMBERS, _U64.pack(max(before + delta, 0)), db=self.meta)

    def quota_refusal(self, txn: Any, op: command_pb2.JoinGroupOp) -> RoadlogError | None:
        """Why the join ``op`` passes a limit it carries (None: it does not,
        or it adds no member). The leader asks before proposing; the apply
        refuses the same, so a join proposed beside others still holds."""
        if self.meta is None or not op.HasField("quotas"):
            return None  # an entry from before quotas
        req, q = op.request, op.quotas
        g = self.get(txn, req.group)
        if g is not None and any(m.member_id == req.member_id for m in g.members):
            return None  # a member again: nothing new held
        client = req.client_id if op.bound else ""
        if g is None and client and q.groups_per_client:
            n = self.owned(txn, client, q.groups_per_client)
            if n >= q.groups_per_client:
                return RoadlogError(
                    Code.RESOURCE_EXHAUSTED,
                    f"group quota: this identity has created {n} consumer groups, the most "
                    f"one may: join one of them, or leave the ones it no longer uses (an empty "
                    f"group is deleted {_days(GROUP_RETENTION_MS)} after its last commit; "
                    f"an admin may delete it at once)",
                )
        if client and q.members_per_client:
            n = self.joined(txn, client, q.members_per_client)
            if n >= q.members_per_client:
                return RoadlogError(
                    Code.RESOURCE_EXHAUSTED,
                    f"group quota: this identity has {n} members in consumer groups, the most "
                    f"one may: leave with the members it no longer uses (a member that stops "
                    f"heartbeating is removed after its session timeout)",
                )
        if g is None and q.groups:
            n = self.group_count(txn)
            if n >= q.groups:
                return RoadlogError(
                    Code.RESOURCE_EXHAUSTED,
                    f"group quota: the cluster holds {n} consumer groups, the most it may: "
                    f"join an existing group (an empty group is deleted "
                    f"{_days(GROUP_RETENTION_MS)} after its last commit; an admin may "
                    f"delete unused ones)",
                )
        if q.members:
            n = self.member_count(txn)
            if n >= q.members:
                return RoadlogError(
                    Code.RESOURCE_EXHAUSTED,
                    f"group quota: the cluster's consumer groups have {n} members, the most "
                    f"they may: try again once members have left",
                )
        return None

    # ------------------------------------------------------------ applying

    def join(
        self,
        txn: Any,
        req: client_pb2.JoinGroupRequest,
        partitions: int,
        leader_ms: int,
        index: int,
        op: command_pb2.JoinGroupOp | None = None,
    ) -> client_pb2.JoinGroupResponse:
        """``op``: the join's op, with its quotas (None: none checked)."""
        check_group_name(req.group)
        if not req.member_id:
            raise RoadlogError(Code.INVALID_ARGUMENT, "a join without a member id")
        timeout = session_timeout(req.session_timeout_ms)
        g = self.get(txn, req.group)
        bound = op is not None and op.bound and bool(req.client_id)
        created = g is None
        if g is None:
            g = groups_pb2.Group(
                name=req.group,
                topic=req.topic,
                session_timeout_ms=timeout,
                owner=req.client_id if bound else "",
            )
        elif g.topic != req.topic:
            raise name_taken(req.group, req.topic)
        if not any(m.member_id == req.member_id for m in g.members):
            if len(g.members) >= MAX_MEMBERS:
                raise RoadlogError(Code.RESOURCE_EXHAUSTED, "the group is full")
            refused = self.quota_refusal(txn, op) if op is not None else None
            if refused is not None:
                raise refused
            before = self.member_count(txn)
            g.members.add(member_id=req.member_id, client_id=req.client_id, joined_ms=leader_ms)
            g.session_timeout_ms = timeout
            g.empty_since_ms = 0
            self._rebalance(g, partitions)
            txn.put(req.group.encode(), g.SerializeToString(), db=self.groups)
            self._members_changed(txn, before, 1)
            if bound:
                txn.put(_joined_key(req.client_id, req.group, req.member_id), b"", db=self.meta)
                if created:
                    txn.put(_owned_key(req.client_id, req.group), b"", db=self.meta)
        me = next(m for m in g.members if m.member_id == req.member_id)
        return client_pb2.JoinGroupResponse(
            member_id=me.member_id,
            generation=g.generation,
            partitions=me.partitions,
            heartbeat_interval_ms=g.session_timeout_ms // 3,
            applied_index=index,
            revoking=me.revoking,
        )

    def leave(
        self, txn: Any, group: str, member_ids: list[str], partitions: int, log_ms: int = 0
    ) -> int:
        """Remove the members (those still there); the generation after.
        ``log_ms``: the log's clock, recorded when the group empties."""
        g = self.get(txn, group)
        if g is None:
            raise no_group(group)
        gone = set(member_ids)
        keep = [m for m in g.members if m.member_id not in gone]
        if len(keep) != len(g.members):
            before = self.member_count(txn)
            self._forget_members(txn, g, [m for m in g.members if m.member_id in gone])
            self._members_changed(txn, before, len(keep) - len(g.members))
            del g.members[:]
            g.members.extend(keep)
            if not keep:
                g.empty_since_ms = max(log_ms, 0)
            self._rebalance(g, partitions)
            txn.put(group.encode(), g.SerializeToString(), db=self.groups)
        return g.generation

    def _forget_members(self, txn: Any, g: groups_pb2.Group, members: Any) -> None:
        """Drop the members' counts against their identities' quotas."""
        if self.meta is None:
            return
        for m in members:
            if m.client_id:
                txn.delete(_joined_key(m.client_id, g.name, m.member_id), db=self.meta)

    def commit(
        self,
        txn: Any,
        req: client_pb2.CommitOffsetsRequest,
        ends: dict[int, int] | None,
        leader_ms: int,
        partitions: int,
    ) -> None:
        """Store offsets (``ends`` maps each partition to its next offset;
        None: checked by the leader, a topic placed in data groups), then
        release the revoking partitions the request gives up."""
        g = self.get(txn, req.group)
        if g is None:
            raise no_group(req.group)
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
            if ends is not None and o.offset > ends.get(o.partition, 0):
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
        for g in self.records(txn):
            if g.topic == topic:
                self._drop(txn, g)

    def export_topic(self, txn: Any, topic: str) -> list[federation_pb2.MovedGroup]:
        """The topic's groups and their committed offsets, for a move."""
        out = []
        for g in self.records(txn):
            if g.topic == topic:
                d = self.describe(txn, g.name)
                out.append(federation_pb2.MovedGroup(group=d.group, offsets=d.offsets))
        return out

    def import_group(self, txn: Any, mg: federation_pb2.MovedGroup, log_ms: int) -> None:
        """A moved group: its committed offsets, its record without members
        (they join again here) and without an owner (it counts against no
        identity's quota here); a group of that name here keeps its record."""
        name = mg.group.name
        if self.get(txn, name) is None:
            g = groups_pb2.Group(
                name=name,
                topic=mg.group.topic,
                generation=mg.group.generation,
                session_timeout_ms=mg.group.session_timeout_ms,
                empty_since_ms=log_ms,
            )
            txn.put(name.encode(), g.SerializeToString(), db=self.groups)
        for o in mg.offsets:
            txn.put(
                _offset_key(name, o.partition),
                _OFFSET_VAL.pack(o.offset, o.committed_ms),
                db=self.offsets,
            )

    def delete(self, txn: Any, name: str) -> None:
        """Delete a group that no member is in any more, with its offsets."""
        g = self.get(txn, name)
        if g is None:
            raise no_group(name)
        if g.members:
            raise RoadlogError(
                Code.FAILED_PRECONDITION,
                f"group {name!r} has {len(g.members)} members; they must leave (or expire) first",
            )
        self._drop(txn, g)

    def expire(self, txn: Any, cutoff_ms: int) -> list[str]:
        """Delete every group with no member whose last commit and emptying
        are both before ``cutoff_ms`` (the log's clock minus the retention),
        with its offsets; their names. A group emptied before group expiry
        (no emptying time) goes by its last commit alone."""
        doomed = []
        for g in self.records(txn):
            if not g.members and max(g.empty_since_ms, self._last_commit(txn, g.name)) < cutoff_ms:
                doomed.append(g)
        for g in doomed:
            self._drop(txn, g)
        return [g.name for g in doomed]

    def _last_commit(self, txn: Any, name: str) -> int:
        """When an offset of the group was last committed (0: never)."""
        last = 0
        prefix = name.encode() + b"\x00"
        cur = txn.cursor(db=self.offsets)
        if cur.set_range(prefix):
            for k, v in cur:
                if not k.startswith(prefix):
                    break
                last = max(last, _OFFSET_VAL.unpack(v)[1])
        return last

    def _drop(self, txn: Any, g: groups_pb2.Group) -> None:
        """Forget a group, its offsets and what it counted against quotas."""
        name = g.name
        if g.members:
            before = self.member_count(txn)
            self._forget_members(txn, g, g.members)
            self._members_changed(txn, before, -len(g.members))
        if g.owner and self.meta is not None:
            txn.delete(_owned_key(g.owner, name), db=self.meta)
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
