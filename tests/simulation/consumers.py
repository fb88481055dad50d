"""Consumers of the split topic, simulated (multi-raft, issue 18: "consumer
offsets never ahead of committed data").

In a seed with data groups (and clients), one or two consumers
(``Consumer``) read the split topic ``s`` (split.py), whose partitions the
split clients write in the data groups, and commit the offsets they reach
through group 0, as ``roadlog consume --group`` does:

- each is the lone member ``m<i>`` of its consumer group ``cg<i>`` (so it
  owns every partition, in generation 1); on the real state machine the
  groups are made with the real ops, ``JoinGroupOp`` with the leader's
  quotas, in group 0's first write, beside group 0's record of ``s``
  (``PlaceTopicOp`` with the split map: the simulation's group 0 does not
  create ``s``, and its first topic records one data group, so a topic it
  created would have no map);
- a read: a partition, and a node whose replica of the partition's data
  group applied the consumer's fence for that group (the highest applied
  index of that group it read at: as a fenced fetch, never behind an
  earlier read); it reads up to a few pings from its position there (the
  real state machine's ``fetch``; only what that replica applied) and
  moves on to what it reached;
- it commits that offset (now and then one past it: a consumer that
  commits ahead of what it read, which the leader must refuse unless the
  group committed that far) as a ``CommitOffsets`` write into group 0's
  queue (the real ``WorkQueues`` of group 0's ``Front``). Group 0's leader
  judges it first, as ``ConsumerGroupCoordinator._within_data_groups`` does
  (``Judging``): the partition's group (``group_of`` on group 0's record
  on the real state machine, the split map on the toy), then this node's
  replica of that group, once it applied the commit index it knows (or
  after COMMIT_CATCH_UP); past that replica's end, a ReadIndex of the data
  group (the real one, ``RaftCore.read_index`` on this node's replica,
  which asks its leader) and, once the replica applied the read's index,
  the end again: past it, refused (INVALID_ARGUMENT, for sure); the
  ReadIndex not had within COMMIT_CATCH_UP, UNAVAILABLE (tried again); a
  node that runs no replica of that group (a node group 0 added: the
  simulation's data groups keep their founding members), UNAVAILABLE.
  Then it proposes the real ``CommitOffsetsOp`` (whose apply, for a topic
  placed in data groups, checks membership and generation and leaves the
  end to the leader), or the toy's ``toy_commit_key``;
- a commit whose outcome is unknown is sent again (the same request)
  until it is answered; so is one refused NOT_FOUND ("no group") by a
  new group 0 leader whose replica has not applied the join yet (it has
  not committed in its term): the product's ``ConsumerGroupCoordinator.commit``
  reads its replica without waiting for it, so a consumer can be told
  that too (checked: only while that replica lags the join).

Checked (``offset_violations``, a pure function of the history, so that it
can be fed a history with a violation): when a commit is acknowledged, its
offset is at most the partition's end in its data group's committed state
then (the furthest replica's: every applied entry is committed); a commit
of what the consumer read is never refused as past the end (a ReadIndex
covers what any replica applied before it); and at the end, on every
converged replica of group 0, each consumer group's committed offset of a
partition is at most the partition's end on the converged data group, and
is an offset that was sent. ``ConsumerFront.judged = False`` skips the
leader's judgement, ``linearizable = False`` judges on the leader's
replica as it is (the tier shows the checks catch each).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from node_daemon.raft import ProposalDropped
from node_daemon.replica.remote import ReplicaView
from node_daemon.state.consumer_groups import default_quotas
from node_daemon.state.responses import OpResult
from node_daemon.work.consumer_group_coordinator import _end_of
from queue_server.queues import Item
from roadlog.errors import Code, RoadlogError
from roadlog.placement import group_of
from roadlog.v1 import client_pb2, command_pb2, groups_pb2, topics_pb2
from tests.simulation.split import REGION, SPLIT_PARTITIONS, SPLIT_TOPIC, drive_clients

if TYPE_CHECKING:
    from tests.simulation.harness import DataGroup, SimNode, Simulation

# As consumer_group_coordinator.COMMIT_CATCH_UP_S (1 s), in the simulation's time
# units (front.FENCE_WAIT is 1 s too).
COMMIT_CATCH_UP = 1000
GENERATION = 1  # a lone member's, after its join (``ConsumerGroupTables._rebalance`` bumps it once)
# Group 0's record of the split topic: an id no topic group 0 creates has
# (they count from 1), the split map given as is.
G0_SPLIT_TOPIC_ID = 1 << 31

CommitKey = tuple[int, int]  # (consumer, its n-th commit)


def group_name(consumer: int) -> str:
    return f"cg{consumer}"


def toy_commit_key(group: str, partition: int, offset: int) -> bytes:
    """A commit as the toy state machine stores it: ``o<group>/<partition>/<offset>``."""
    return b"o%s/%d/%d" % (group.encode(), partition, offset)


def parse_toy_commit(key: bytes) -> tuple[str, int, int]:
    group, partition, offset = key[1:].split(b"/")
    return group.decode(), int(partition), int(offset)


def partition_end(sm: object, partition: int) -> int:
    """The split topic's partition's next offset on a data group's replica
    (as the leader reads it: ``consumer_group_coordinator._end_of``)."""
    from tests.simulation.harness import RealStateMachine, StateMachine

    if isinstance(sm, StateMachine):
        return len(sm.split.get(partition, []))
    assert isinstance(sm, RealStateMachine)
    return _end_of(cast(ReplicaView, sm), SPLIT_TOPIC, partition)


def read_to(sm: object, partition: int, offset: int, max_pings: int) -> int:
    """Where a consumer at ``offset`` gets to reading up to ``max_pings``
    pings of the partition on this replica (the real state machine's
    fetch: whole batches, at least one)."""
    from tests.simulation.harness import RealStateMachine, StateMachine

    if isinstance(sm, StateMachine):
        return min(len(sm.split.get(partition, [])), offset + max_pings)
    assert isinstance(sm, RealStateMachine)
    req = client_pb2.FetchRequest(
        topic=SPLIT_TOPIC, partition=partition, offset=offset, max_pings=max_pings
    )
    try:
        return sm.sm.fetch(req).next_offset
    except RoadlogError as e:
        if e.code == Code.NOT_FOUND and offset == 0:
            return 0  # the topic is not on this replica yet
        raise


def stored_offsets(sm: object, groups: list[str]) -> dict[str, dict[int, int]]:
    """Consumer group -> partition -> offset, as a replica of group 0 holds them."""
    from tests.simulation.harness import RealStateMachine, StateMachine

    out: dict[str, dict[int, int]] = {}
    if isinstance(sm, StateMachine):
        for (g, p), offset in sm.offsets.items():
            out.setdefault(g, {})[p] = offset
        return out
    assert isinstance(sm, RealStateMachine)
    for name in groups:
        try:
            d = sm.sm.describe_group(name)
        except RoadlogError:
            continue
        for o in d.offsets:
            out.setdefault(name, {})[o.partition] = o.offset
    return out


# ----------------------------------------------------------------- the checker


@dataclass(frozen=True)
class Commit:
    group: str  # the consumer group
    partition: int
    offset: int
    honest: bool  # the offset the consumer's read reached (else past it)


@dataclass
class OffsetHistory:
    """What the consumers committed and were told."""

    groups: list[int]  # the split topic's partition -> data group map
    sent: dict[CommitKey, Commit] = field(default_factory=dict)
    # Acknowledged: the partition's end in its data group's committed state then.
    acked: dict[CommitKey, int] = field(default_factory=dict)
    refused: set[CommitKey] = field(default_factory=set)  # past the end, for sure


def offset_violations(
    h: OffsetHistory,
    stored: Mapping[str, Mapping[int, int]] | None = None,
    ends: Mapping[int, int] | None = None,
    only: CommitKey | None = None,
) -> list[str]:
    """What the history breaks of "consumer offsets never ahead of
    committed data", as messages ([] if nothing): each acknowledged commit
    against the end the history recorded for it, each refused one (``only``:
    that commit alone); with ``stored`` (consumer group -> partition ->
    offset on a replica of group 0) and ``ends`` (partition -> its end in its
    data group's committed state, at the end), every stored offset."""
    out: list[str] = []
    for k in sorted(h.acked) if only is None else [only] if only in h.acked else []:
        c, end = h.sent[k], h.acked[k]
        if c.offset > end:
            out.append(
                f"commit {k} of {c.group} acknowledged at offset {c.offset} of partition "
                f"{c.partition}, whose data group {h.groups[c.partition]} committed only "
                f"up to {end}"
            )
    for k in sorted(h.refused) if only is None else [only] if only in h.refused else []:
        c = h.sent[k]
        if c.honest:
            out.append(
                f"commit {k} of {c.group} refused as past the end of partition "
                f"{c.partition}, yet offset {c.offset} is what a replica of its group served"
            )
    if stored is None or ends is None:
        return out
    for g, parts in sorted(stored.items()):
        for p, offset in sorted(parts.items()):
            if offset > ends.get(p, 0):
                out.append(
                    f"{g}'s committed offset {offset} of partition {p} is ahead of what its "
                    f"data group {h.groups[p]} committed ({ends.get(p, 0)})"
                )
            if not any((c.group, c.partition, c.offset) == (g, p, offset) for c in h.sent.values()):
                out.append(f"{g}'s committed offset {offset} of partition {p} was never sent")
    return out


# ---------------------------------------------------------------- the consumers


@dataclass
class Consumer:
    id: int
    n: int = 0  # its commits so far; ``n`` is the one under way
    busy: bool = False
    attempt: int = 0  # which try of it an answer belongs to
    item: int | None = None
    deadline: int = 0
    retry_at: int | None = None
    request: bytes = b""
    partition: int = 0
    positions: dict[int, int] = field(default_factory=dict)  # partition -> next offset
    fences: dict[int, int] = field(default_factory=dict)  # data group -> applied index read at


@dataclass
class Judging:
    """Group 0's leader judging a commit before proposing it
    (``ConsumerGroupCoordinator._within_data_groups``), one phase at a time:
    ``catch_up`` (its replica of the data group applies the commit index
    it knows, or COMMIT_CATCH_UP passes), ``read`` (a ReadIndex of the
    data group is under way), ``apply`` (the replica applies its index)."""

    node: SimNode  # group 0's replica on the leader's node
    wid: int
    item: Item
    req: client_pb2.CommitOffsetsRequest
    replica: SimNode  # that node's replica of the partition's data group
    group: int
    phase: str
    target: int  # the index the replica must apply
    give_up: int
    ctx: bytes = b""


class ConsumerFront:
    """The consumers, over group 0's ``Front`` (their commits) and the data
    groups' replicas (their reads)."""

    # The leader's judgement of each commit (off: proposed at once, as a
    # leader that skipped ``_within_data_groups`` would).
    judged = True
    # Judged again after a ReadIndex (off: on this node's replica as it is,
    # no catch-up and no ReadIndex: a commit of what a replica ahead of this
    # one served is refused).
    linearizable = True

    def __init__(self, sim: Simulation, rng: random.Random) -> None:
        assert sim.split is not None
        self.sim = sim
        self.rng = rng
        self.history = OffsetHistory(list(sim.split.history.groups))
        self.consumers = [Consumer(i + 1) for i in range(rng.choice([1, 2]))]
        self.p_commit = rng.choice([0.02, 0.05, 0.2])
        self.p_ahead = rng.choice([0.1, 0.3])
        self.timeout = rng.choice([300, 1000, 3000])
        self.judging: list[Judging] = []
        self.next_ctx = 0
        self.read_indexes = 0  # commits judged again after a ReadIndex
        self.missing_groups = 0  # commits a leader lagging its own group 0 refused
        self.not_caught_up = 0  # commits a new leader sent back before it caught up

    def creation_ops(self) -> list[command_pb2.Op]:
        """What group 0's first write adds on the real state machine: its
        record of the split topic (the split map) and each consumer's group
        with its one member, by the real join."""
        topic = topics_pb2.Topic(
            spec=topics_pb2.TopicSpec(
                name=SPLIT_TOPIC, region_geojson=REGION.geojson, partitions=SPLIT_PARTITIONS
            ),
            id=G0_SPLIT_TOPIC_ID,
            partition_groups=self.history.groups,
        )
        ops = [command_pb2.Op(place_topic=command_pb2.PlaceTopicOp(topic=topic))]
        for c in self.consumers:
            req = client_pb2.JoinGroupRequest(
                group=group_name(c.id), topic=SPLIT_TOPIC, member_id=f"m{c.id}", client_id="k"
            )
            join = command_pb2.JoinGroupOp(request=req, quotas=default_quotas())
            ops.append(command_pb2.Op(join_group=join))
        return ops

    def _ready(self) -> bool:
        return self.sim.front.topic_ready and all(dg.front.topic_ready for dg in self.sim.data)

    def _data(self, group: int) -> DataGroup:
        return self.sim.data[group - 1]

    # -- a read and its commit -------------------------------------------------

    def _read_and_commit(self, c: Consumer) -> None:
        p = self.rng.randrange(SPLIT_PARTITIONS)
        g = self.history.groups[p]
        fence = c.fences.get(g, 0)
        live = [
            n for n in self._data(g).nodes.values() if n.core is not None and n.sm.applied >= fence
        ]
        if not live:
            return
        n = self.rng.choice(live)
        pos = c.positions.get(p, 0)
        try:
            reached = read_to(n.sm, p, pos, self.rng.randint(1, 8))
        except RoadlogError as e:
            self.sim.checker.fail(
                f"consumer {c.id} read partition {p} at {pos} on node {n.id}, fenced at "
                f"{fence} in group {g}: {e}"
            )
        if reached < pos:
            self.sim.checker.fail(
                f"consumer {c.id} read partition {p} back from {pos} to {reached}"
            )
        c.positions[p] = reached
        c.fences[g] = max(fence, n.sm.applied)
        honest = self.rng.random() >= self.p_ahead
        offset = reached if honest else reached + self.rng.randint(1, 3)
        c.n += 1
        c.busy, c.partition = True, p
        self.history.sent[(c.id, c.n)] = Commit(group_name(c.id), p, offset, honest)
        req = client_pb2.CommitOffsetsRequest(
            group=group_name(c.id), member_id=f"m{c.id}", generation=GENERATION
        )
        req.offsets.add(partition=p, offset=offset)
        c.request = req.SerializeToString()
        self._submit(c)

    def _submit(self, c: Consumer) -> None:
        now = self.sim.now
        c.attempt += 1
        c.retry_at = None
        c.deadline = now + self.timeout + 50
        c.item = self.sim.front.submit_foreign(
            "CommitOffsets",
            c.request,
            float(now + self.timeout),
            f"k{c.id}",
            functools.partial(self._answered, c, c.attempt),
            judge=self._judge,
        )

    def _failed(self, c: Consumer) -> None:
        """The outcome is unknown: send the same commit again later."""
        if c.item is not None:
            self.sim.front.cancel_foreign(c.item)
        c.item = None
        c.attempt += 1  # an answer still on its way is stale
        c.retry_at = self.sim.now + self.rng.randint(1, 30)

    def _answered(self, c: Consumer, attempt: int, r: OpResult | None) -> None:
        if attempt != c.attempt:
            return
        c.item = None
        k = (c.id, c.n)
        if r is None or r.code in (Code.UNAVAILABLE, Code.NOT_FOUND):
            self._failed(c)  # NOT_FOUND: see ``_group_missing``
            return
        h = self.history
        if r.code == Code.INVALID_ARGUMENT:
            h.refused.add(k)  # failed for sure: the consumer moves on
        elif r.code == Code.OK:
            h.acked[k] = self.committed_end(h.sent[k].partition)
        else:
            self.sim.checker.fail(f"commit {k} of consumer {c.id} answered {r}")
        for v in offset_violations(h, only=k):
            self.sim.checker.fail(v)
        c.busy = False

    def committed_end(self, partition: int) -> int:
        """The partition's end in its data group's committed state: on the
        replica that applied the furthest (what any replica applied is
        committed; its state survives a crash)."""
        dg = self._data(self.history.groups[partition])
        return max(partition_end(n.sm, partition) for n in dg.nodes.values())

    # -- group 0's leader ---------------------------------------------------------

    def _judge(self, node: SimNode, wid: int, it: Item) -> None:
        """Group 0's leader took a commit: judge it, then propose it."""
        front = self.sim.front
        req = client_pb2.CommitOffsetsRequest.FromString(it.request)
        if not self.judged:
            front.propose(node, wid, it, self._proposal(req))
            return
        if node.core is not None and not node.core.leads_caught_up(node.sm.applied):
            # As the product's WorkHandler.run: a new leader judges nothing
            # from its state before it has applied an entry of its own term
            # (it waits up to LEADER_CATCH_UP_S, then answers UNAVAILABLE;
            # here at once), so a consumer group whose join was acknowledged
            # is never missing from it.
            self.not_caught_up += 1
            front.answer_held(wid, it, OpResult(Code.UNAVAILABLE, "a new leader is catching up"))
            return
        try:
            group = self._partition_group(node, req)
        except RoadlogError as e:
            if e.code == Code.NOT_FOUND:
                self._group_missing(node, req.group)
            front.answer_held(wid, it, OpResult(e.code, e.message))
            return
        if group is None:  # not placed: the apply checks it
            front.propose(node, wid, it, self._proposal(req))
            return
        replica = self._data(group).nodes.get(node.id)
        if replica is None or replica.core is None:
            msg = "this node runs no group of that partition"
            front.answer_held(wid, it, OpResult(Code.UNAVAILABLE, msg))
            return
        j = Judging(
            node,
            wid,
            it,
            req,
            replica,
            group,
            "catch_up",
            replica.core.log.committed,
            self.sim.now + COMMIT_CATCH_UP,
        )
        if not self._advance(j):
            self.judging.append(j)

    def _group_missing(self, node: SimNode, group: str) -> None:
        """The leader's replica of group 0 has no such consumer group: only
        while it has not applied the write that made it (a new leader that
        has not yet committed in its term); the product's leader answers
        NOT_FOUND then too, and the consumer sends its commit again."""
        made = self.sim.front.acked_at.get((1, 0), 0)  # the first client's first write
        if not made or node.sm.applied >= made:
            self.sim.checker.fail(
                f"group 0's leader {node.id} (applied {node.sm.applied}) finds no {group!r}, "
                f"made at index {made}"
            )
        self.missing_groups += 1

    def _partition_group(self, node: SimNode, req: client_pb2.CommitOffsetsRequest) -> int | None:
        """The data group of the commit's partition, as the leader finds it
        in its replica of group 0 (the real one: the group's topic, its map);
        None: nothing to judge there."""
        from tests.simulation.harness import RealStateMachine

        [o] = req.offsets
        if not isinstance(node.sm, RealStateMachine):
            return self.history.groups[o.partition]
        sm = node.sm.sm
        g: groups_pb2.Group = sm.describe_group(req.group).group
        try:
            topic = sm.topic(g.topic)
        except RoadlogError:
            return None  # the apply answers as it would
        if not topic.partition_groups or o.partition >= topic.spec.partitions:
            return None
        return group_of(topic, o.partition)

    def _advance(self, j: Judging) -> bool:
        """One look at a judgement: True once it proposed or answered."""
        front, now = self.sim.front, self.sim.now
        [o] = j.req.offsets
        replica = j.replica
        if j.phase == "catch_up":
            if replica.sm.applied < j.target and now < j.give_up and self.linearizable:
                return False
            if o.offset <= partition_end(replica.sm, o.partition):
                front.propose(j.node, j.wid, j.item, self._proposal(j.req))
                return True
            if not self.linearizable:
                msg = f"offset {o.offset} is past the end of partition {o.partition}"
                front.answer_held(j.wid, j.item, OpResult(Code.INVALID_ARGUMENT, msg))
                return True
            # Past this replica's end: a ReadIndex of the data group.
            self.read_indexes += 1
            core = replica.core
            assert core is not None  # a crash of the node drops the judgement
            self.next_ctx += 1
            j.ctx = b"k%d" % self.next_ctx
            try:
                core.read_index(j.ctx)
            except ProposalDropped as e:  # no leader known: NotLeader
                msg = f"cannot tell the end of partition {o.partition} now ({e}): try again"
                front.answer_held(j.wid, j.item, OpResult(Code.UNAVAILABLE, msg))
                return True
            j.phase, j.give_up = "read", now + COMMIT_CATCH_UP
            self._data(j.group).read_waiters[j.ctx] = functools.partial(self._read_done, j)
            replica.process()
            return False
        if j.phase == "apply" and replica.sm.applied >= j.target:
            if o.offset <= partition_end(replica.sm, o.partition):
                front.propose(j.node, j.wid, j.item, self._proposal(j.req))
            else:
                msg = f"offset {o.offset} is past the end of partition {o.partition}"
                front.answer_held(j.wid, j.item, OpResult(Code.INVALID_ARGUMENT, msg))
            return True
        if now >= j.give_up:
            self._data(j.group).read_waiters.pop(j.ctx, None)
            msg = f"cannot tell the end of partition {o.partition} now (timed out): try again"
            front.answer_held(j.wid, j.item, OpResult(Code.UNAVAILABLE, msg))
            return True
        return False

    def _read_done(self, j: Judging, index: int) -> None:
        if j.phase == "read":
            j.phase, j.target = "apply", index

    def _proposal(self, req: client_pb2.CommitOffsetsRequest) -> bytes:
        """What group 0's leader proposes: the real CommitOffsetsOp, or the toy's key."""
        if self.sim.opts.real_sm:
            op = command_pb2.Op(commit_offsets=command_pb2.CommitOffsetsOp(request=req))
            return command_pb2.Command(leader_ms=self.sim.now, ops=[op]).SerializeToString()
        [o] = req.offsets
        return toy_commit_key(req.group, o.partition, o.offset)

    # -- the run --------------------------------------------------------------------

    def step(self) -> None:
        front = self.sim.front
        still = []
        for j in self.judging:
            if not front.holds(j.wid, j.item) or j.node.core is None:
                self._data(j.group).read_waiters.pop(j.ctx, None)  # handed back: dropped
            elif not self._advance(j):
                still.append(j)
        self.judging = still
        drive_clients(
            self.consumers,
            self.sim.now,
            lambda: self.sim.chaos and self._ready() and self.rng.random() < self.p_commit,
            self._failed,
            self._submit,
            self._read_and_commit,
        )

    def busy(self) -> bool:
        """A commit is under way, unless it waits for a group 0 leader that
        runs its data group (one group 0 added leads it: the simulation's
        data groups keep their founding members, and no leadership moves
        once the faults end)."""
        lead = self.sim.leader()
        return any(
            c.busy
            and not (
                lead is not None
                and lead.id not in self._data(self.history.groups[c.partition]).nodes
            )
            for c in self.consumers
        )

    def final_checks(self, members: list[SimNode]) -> None:
        """Each converged replica of group 0 against the converged data groups."""
        ends = {
            p: max(
                (partition_end(n.sm, p) for n in self._data(g)._members()),
                default=0,
            )
            for p, g in enumerate(self.history.groups)
        }
        names = [group_name(c.id) for c in self.consumers]
        for n in members:
            for v in offset_violations(self.history, stored_offsets(n.sm, names), ends):
                self.sim.checker.fail(f"node {n.id}: {v}")
