"""The split publish, simulated (multi-raft, docs/multiraft.md, "The split,
built and measured"): publishes whose pings span several data groups.

In a seed with data groups, a few clients (``SplitClient``) publish to a
topic ``s`` of SPLIT_PARTITIONS partitions placed in the data groups by the
product's map (``roadlog.placement.partition_groups``). As in the product:

- the publish goes into group 0's queue (the real ``WorkQueues`` of group
  0's ``Front``) as a ``Publish`` write; group 0's leader takes it (a
  follower answers UNAVAILABLE and the queue hands it on), validates it
  (``roadlog.validation.check_batch``: a ping outside the region refuses
  it whole, INVALID_ARGUMENT), splits it by partition and regroups the
  partitions by group (``roadlog.partitioning.split_by_partition``, then
  ``node_daemon.work.appends.split_by_group``) and answers at once with the
  parts (``WorkResult.parts``), proposing nothing itself;
- the queue server hands each part to its group's leader as an internal
  ``AppendPart`` write (the parent's deadline; the item goes into that
  data group's real ``WorkQueues``, which decides, as in the product,
  whether a part may be handed out again after its node left:
  ``queue_server.parts.replayable_part``), the data group's leader proposes
  it (the real state machine stores the AppendOp; the toy one a key naming
  its producer, sequence and partitions) and answers once it applied it;
- once every part is answered the client's answer is the product's merge
  (``queue_server.parts.merge``): OK only if every part stored its pings,
  else the first refusal.

A client retries a publish whose outcome is unknown (the call failed: its
deadline passed, group 0 or a part answered a failure, a part was lost
with a leader change) with the same producer id and sequence, until it is
acknowledged; a publish refused by validation (failed for sure) is not
retried. Group 0's check of producer ids is not simulated: a data group
issues the split producers' ids itself (real state machine) when its
topics are created.

Checked, when a publish is acknowledged: it was not one that must be
refused; its answer gives an offset for every partition it has pings in;
and each part is stored, at that offset, on a replica of its group (the
proposer applied it: committed). Checked at the end, on every converged
replica of every data group (``split_violations``, a pure function of the
history, so that it can be fed a history with a violation): (1) each
acknowledged publish is stored exactly once in each of its partitions, at
the offset its answer gave, and nowhere else; (2) no publish, retried or
not, is stored more than once in any partition; (3) nothing of a publish
refused for sure is stored; and nothing is stored that was never sent.

Consumers read what these clients store and commit their offsets through
group 0 (consumers.py): issue 18's third client-level check, a consumer
offset never ahead of what the partition's data group committed.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from node_daemon.state.machine import append_op
from node_daemon.state.responses import OpResult
from node_daemon.work.appends import split_by_group
from queue_server import parts as queue_parts
from roadlog import columnar, validation
from roadlog.columnar import PingColumns
from roadlog.errors import Code, RoadlogError
from roadlog.geo import bbox_region
from roadlog.partitioning import partition_of, split_by_partition
from roadlog.placement import partition_groups
from roadlog.v1 import client_pb2, command_pb2, topics_pb2, work_pb2

if TYPE_CHECKING:
    from tests.simulation.front import Front
    from tests.simulation.harness import Simulation

SPLIT_TOPIC = "s"
SPLIT_PARTITIONS = 4
# Its id in group 0, for the map. A data group here creates the topic
# itself (its id there depends on the topics its proposals made before), so
# the parts carry no ``topic_id`` (the check of a topic made again is not
# simulated).
SPLIT_TOPIC_ID = 2
SPLIT_PRODUCER_BASE = 1000  # split clients' producer ids: 1001, 1002 (the groups' own: 1..3)
TS0 = 1_600_000_000_000  # a split ping's ts_ms: TS0 + producer * TS_BASE + sequence
TS_BASE = 1 << 20
NOW_MS = TS0 + (1 << 40)  # what validation takes for now: every ping is in the past
REGION = bbox_region(11.4, 48.05, 11.75, 48.25)
OUTSIDE = (40.0, 2.0)  # (lat, lon) of a ping outside the region: its publish is refused
# Devices, each on a partition: a publish picks one device per partition it writes.
DEVICES: dict[int, list[str]] = {}
for _k in range(64):
    DEVICES.setdefault(partition_of(f"v{_k}", SPLIT_PARTITIONS), []).append(f"v{_k}")

Key = tuple[int, int]  # (producer, sequence)
Rows = Mapping[int, Mapping[int, list[Key]]]  # group -> partition -> keys in offset order


def split_map(data_groups: int) -> list[int]:
    """The split topic's partition -> group map (``data_groups`` data groups)."""
    return partition_groups(SPLIT_TOPIC_ID, SPLIT_PARTITIONS, data_groups)


def creation_ops(producers: Iterable[int]) -> list[command_pb2.Op]:
    """What a data group's first write adds on the real state machine: the
    split topic and the split clients' producer ids (group 0's issuance is
    not simulated)."""
    spec = topics_pb2.TopicSpec(
        name=SPLIT_TOPIC, region_geojson=REGION.geojson, partitions=SPLIT_PARTITIONS
    )
    ops = [command_pb2.Op(create_topic=command_pb2.CreateTopicOp(spec=spec))]
    ops += [
        command_pb2.Op(init_producer=command_pb2.InitProducerOp(client_id=f"c{p}", producer_id=p))
        for p in producers
    ]
    return ops


# ------------------------------------------------------- the toy's form of a part


def toy_part_key(op: command_pb2.AppendOp) -> bytes:
    """A part as the toy state machine stores it: ``s<producer>.<sequence>/<partitions>``."""
    [span] = op.spans  # a lone publish: one span
    ps = b",".join(b"%d" % part.partition for part in op.parts)
    return b"s%d.%d/%s" % (span.producer_id, span.sequence, ps)


def parse_toy_part(key: bytes) -> tuple[int, int, list[int]]:
    """(producer, sequence, partitions) of ``toy_part_key``'s key."""
    head, _, ps = key[1:].partition(b"/")
    producer, _, seq = head.partition(b".")
    return int(producer), int(seq), [int(p) for p in ps.split(b",")]


def part_proposal(op_bytes: bytes, real: bool, leader_ms: int) -> bytes:
    """What a data group's leader proposes for an ``AppendPart``: the real
    state machine's Command, or the toy's key."""
    op = command_pb2.AppendOp.FromString(op_bytes)
    if real:
        ops = [command_pb2.Op(append=op)]
        return command_pb2.Command(leader_ms=leader_ms, ops=ops).SerializeToString()
    return toy_part_key(op)


def stored_split_rows(sm: object) -> dict[int, list[Key]]:
    """Partition -> (producer, sequence) of each split ping a replica
    stored there, in offset order."""
    from tests.simulation.harness import RealStateMachine, StateMachine

    if isinstance(sm, StateMachine):
        return {p: list(rows) for p, rows in sm.split.items()}
    assert isinstance(sm, RealStateMachine)
    out: dict[int, list[Key]] = {}
    for p in range(SPLIT_PARTITIONS):
        try:
            batches, _ = sm.sm.read_range(SPLIT_TOPIC, p, 0, 1 << 40)
        except RoadlogError:
            return {}  # no topic yet
        rows = [
            divmod(ts - TS0, TS_BASE)
            for b in batches
            for ts in columnar.decode(b.batch).ts_ms.tolist()
        ]
        if rows:
            out[p] = rows
    return out


# ----------------------------------------------------------------- the checker


def drive_clients(
    clients: Iterable[Any],
    now: int,
    start: Callable[[], bool],
    failed: Callable[[Any], None],
    submit: Callable[[Any], None],
    begin: Callable[[Any], None],
) -> None:
    """One step of simulated clients that retry (split publishers,
    consumers): a try past its deadline has failed (``failed``), one due
    again is sent again (``submit``), and an idle client begins anew
    (``begin``) when ``start()`` says so (asked of idle clients only, in
    order, so that seeds draw their random numbers as before)."""
    for c in clients:
        if c.busy and c.retry_at is None and now >= c.deadline:
            failed(c)  # it gives up waiting on this try
        if c.busy and c.retry_at is not None:
            if now >= c.retry_at:
                submit(c)
        elif not c.busy and start():
            begin(c)


@dataclass
class SplitHistory:
    """What the split clients did and were told."""

    groups: list[int]  # the partition -> group map
    sent: dict[Key, list[int]] = field(default_factory=dict)  # each publish's partitions
    bad: set[Key] = field(default_factory=set)  # publishes with a ping to refuse
    acked: dict[Key, dict[int, int]] = field(default_factory=dict)  # partition -> offset
    refused: set[Key] = field(default_factory=set)  # refused for sure (not retried)


def split_violations(h: SplitHistory, stored: Rows) -> list[str]:
    """What ``stored`` (each data group's rows, from one replica of each)
    breaks of the split publish's guarantees, as messages ([] if nothing)."""
    out: list[str] = []
    where: dict[Key, dict[int, list[tuple[int, int]]]] = {}  # key -> partition -> (group, offset)
    for g, parts in sorted(stored.items()):
        for p, rows in sorted(parts.items()):
            for offset, k in enumerate(rows):
                where.setdefault(k, {}).setdefault(p, []).append((g, offset))
                if h.groups[p] != g:
                    out.append(f"split publish {k}: partition {p} stored in group {g}")
    for k, found in sorted(where.items()):
        if k not in h.sent:
            out.append(f"split publish {k} stored but never sent")
            continue
        for p, at in sorted(found.items()):
            if len(at) > 1:
                out.append(f"split publish {k} stored more than once in partition {p}: at {at}")
            if p not in h.sent[k]:
                out.append(f"split publish {k} stored in partition {p}, where it has no ping")
        if k in h.refused or k in h.bad:
            out.append(f"split publish {k} was refused for sure, yet {sorted(found)} stored it")
    for k, offsets in sorted(h.acked.items()):
        if k in h.bad:
            out.append(f"split publish {k} acknowledged, yet it has a ping to refuse")
        for p in h.sent[k]:
            g = h.groups[p]
            at = where.get(k, {}).get(p, [])
            if not at:
                out.append(
                    f"acknowledged split publish {k} lacks its part in group {g} partition {p}"
                )
            elif offsets.get(p) not in [o for _, o in at]:
                out.append(
                    f"acknowledged split publish {k}: partition {p} (group {g}) holds it at "
                    f"{at}, its answer said {offsets.get(p)}"
                )
    return out


# ------------------------------------------------------------------ the clients


@dataclass
class SplitClient:
    producer: int
    seq: int = 0
    busy: bool = False  # a publish (``seq``) is under way or to be retried
    attempt: int = 0  # which try of it the answers in flight belong to
    items: list[tuple[Front, int]] = field(default_factory=list)  # what it waits on
    deadline: int = 0
    retry_at: int | None = None
    sent: int = 0
    # The parts of the try under way and their answers (None: not yet in).
    parts: list[work_pb2.WorkPart] = field(default_factory=list)
    results: list[work_pb2.WorkResult | None] = field(default_factory=list)


class SplitFront:
    """The split clients and the queue server's split path, over group 0's
    and the data groups' ``Front``s (their real ``WorkQueues``)."""

    def __init__(self, sim: Simulation, rng: random.Random) -> None:
        self.sim = sim
        self.rng = rng
        self.history = SplitHistory(split_map(len(sim.data)))
        n = rng.choice([1, 2])
        self.clients = [SplitClient(SPLIT_PRODUCER_BASE + i + 1) for i in range(n)]
        self.p_submit = rng.choice([0.05, 0.1, 0.3])
        self.p_bad = rng.choice([0.0, 0.1])
        self.timeout = rng.choice([300, 1000, 3000])
        self.requests: dict[Key, bytes] = {}
        self.resent = 0
        self.parts_sent = 0

    @property
    def producers(self) -> list[int]:
        return [c.producer for c in self.clients]

    def _ready(self) -> bool:
        return all(dg.front.topic_ready for dg in self.sim.data)

    # -- a publish ------------------------------------------------------------

    def _new_publish(self, c: SplitClient) -> None:
        """A batch of one ping on each of 1..3 partitions (mostly over
        several groups), now and then with a ping outside the region."""
        c.seq += 1
        k = (c.producer, c.seq)
        n = self.rng.choice([1, 2, 3, 3])
        partitions = sorted(self.rng.sample(range(SPLIT_PARTITIONS), n))
        bad = self.rng.random() < self.p_bad
        devices = [self.rng.choice(DEVICES[p]) for p in partitions]
        ts = TS0 + c.producer * TS_BASE + c.seq
        lat = [48.1] * len(devices)
        lon = [11.5] * len(devices)
        if bad:
            lat[-1], lon[-1] = OUTSIDE
        cols = PingColumns.from_columns(devices, [ts] * len(devices), lat, lon)
        req = client_pb2.PublishRequestView(
            topic=SPLIT_TOPIC,
            client_id=f"c{c.producer}",
            producer_id=c.producer,
            sequence=c.seq,
            batch=columnar.encode(cols),
        )
        self.requests[k] = req.SerializeToString()
        self.history.sent[k] = partitions
        if bad:
            self.history.bad.add(k)
        c.busy, c.sent = True, 0
        self._submit(c)

    def _submit(self, c: SplitClient) -> None:
        """Send the client's publish (again): into group 0's queue."""
        now = self.sim.now
        c.attempt += 1
        c.retry_at = None
        c.sent += 1
        self.resent += c.sent > 1
        c.deadline = now + self.timeout + 50
        c.parts, c.results = [], []
        g0 = self.sim.front
        attempt = c.attempt
        iid = g0.submit_foreign(
            "Publish",
            self.requests[(c.producer, c.seq)],
            float(now + self.timeout),
            f"c{c.producer}",
            lambda r: self._split_answered(c, attempt, r),
            serve=split_publish,
        )
        c.items = [(g0, iid)]

    def _failed(self, c: SplitClient) -> None:
        """The outcome is unknown: cancel what is left, send it again later."""
        for front, iid in c.items:
            front.cancel_foreign(iid)
        c.items, c.parts, c.results = [], [], []
        c.attempt += 1  # answers still on their way are stale
        c.retry_at = self.sim.now + self.rng.randint(1, 30)

    def _split_answered(self, c: SplitClient, attempt: int, r: OpResult | None) -> None:
        """Group 0's leader answered: a refusal, or the parts to hand out."""
        if attempt != c.attempt:
            return
        c.items = []
        k = (c.producer, c.seq)
        if r is None or r.code == Code.UNAVAILABLE:
            self._failed(c)
            return
        if r.code != Code.OK:
            if r.code != Code.INVALID_ARGUMENT or k not in self.history.bad:
                self.sim.checker.fail(f"split publish {k} answered {r}")
            self.history.refused.add(k)  # failed for sure: the client moves on
            c.busy = False
            return
        res = work_pb2.WorkResult.FromString(r.response)
        if not res.parts:
            self.sim.checker.fail(f"split publish {k} answered without parts")
        c.parts = list(res.parts)
        c.results = [None] * len(c.parts)
        for i, part in enumerate(c.parts):
            front = self.sim.data[part.group - 1].front
            iid = front.submit_foreign(
                "AppendPart",
                part.op,
                float(c.deadline - 50),  # the parent's deadline
                f"c{c.producer}",
                functools.partial(self._part_answered, c, attempt, i),
            )
            c.items.append((front, iid))
            self.parts_sent += 1

    def _part_answered(self, c: SplitClient, attempt: int, i: int, r: OpResult | None) -> None:
        """A part's answer, as the queue server sees it (a PublishBatchResponse
        with one result per span; a failure as the call's code)."""
        if attempt != c.attempt:
            return
        if r is None:
            res = work_pb2.WorkResult(code=Code.UNAVAILABLE, message="the part was lost")
        elif r.code != Code.OK:
            res = work_pb2.WorkResult(code=r.code, message=r.message)
        else:
            batch = client_pb2.PublishBatchResponse()
            batch.results.add(response=client_pb2.PublishResponse.FromString(r.response))
            res = work_pb2.WorkResult(response=batch.SerializeToString())
        c.results[i] = res
        if any(x is None for x in c.results):
            return
        c.items = []
        results = [x for x in c.results if x is not None]
        try:
            answer = queue_parts.merge(True, b"", c.parts, results)
        except RoadlogError:
            self._failed(c)  # some part failed: the outcome is unknown
            return
        self._acknowledge(c, client_pb2.PublishResponse.FromString(answer))

    def _acknowledge(self, c: SplitClient, resp: client_pb2.PublishResponse) -> None:
        """The client is told OK: every part must be committed, at the
        offsets the answer gives."""
        k = (c.producer, c.seq)
        fail = self.sim.checker.fail
        h = self.history
        if k in h.bad:
            fail(f"split publish {k} acknowledged, yet it has a ping to refuse")
        offsets = {o.partition: o.base_offset for o in resp.offsets}
        for p in h.sent[k]:
            g = h.groups[p]
            if p not in offsets:
                fail(
                    f"split publish {k} acknowledged without its part in group {g} (partition {p})"
                )
            if not any(
                stored_split_rows(n.sm).get(p, [])[offsets[p] : offsets[p] + 1] == [k]
                for n in self.sim.data[g - 1].nodes.values()
            ):
                fail(
                    f"split publish {k} acknowledged, but no replica of group {g} holds "
                    f"its partition {p} at offset {offsets[p]}"
                )
        h.acked[k] = offsets
        c.busy, c.items, c.parts, c.results = False, [], [], []

    # -- the run ----------------------------------------------------------------

    def step(self) -> None:
        drive_clients(
            self.clients,
            self.sim.now,
            lambda: self.sim.chaos and self._ready() and self.rng.random() < self.p_submit,
            self._failed,
            self._submit,
            self._new_publish,
        )

    def busy(self) -> bool:
        return any(c.busy for c in self.clients)

    def final_checks(self) -> None:
        """The history against what every member of every data group stored."""
        for dg in self.sim.data:
            for n in dg._members():
                stored = {dg.group: stored_split_rows(n.sm)}
                others: dict[int, dict[int, list[Key]]] = {
                    g: {} for g in range(1, len(self.sim.data) + 1) if g != dg.group
                }
                for v in split_violations(self._only(dg.group), {**others, **stored}):
                    dg.checker.fail(f"node {n.id}: {v}")

    def _only(self, group: int) -> SplitHistory:
        """The history as far as one group's replica can tell it: the other
        groups' partitions are checked on their own replicas."""
        h = self.history
        sent = {k: [p for p in ps if h.groups[p] == group] for k, ps in h.sent.items()}
        return SplitHistory(h.groups, sent, h.bad, h.acked, h.refused)


def split_publish(node: object, it: object) -> OpResult:
    """Group 0's leader's answer to a publish of the split topic (as
    node_daemon.work.handler's ``_split``): validated, split by partition, the
    partitions regrouped by group; the parts to hand out, or a refusal."""
    from queue_server.queues import Item
    from tests.simulation.harness import SimNode

    assert isinstance(node, SimNode) and isinstance(it, Item)
    view = client_pb2.PublishRequestView.FromString(it.request)
    cols = columnar.decode(view.batch)
    try:
        validation.check_batch(cols, REGION, NOW_MS)
    except validation.BatchRejected as e:
        return OpResult(Code.INVALID_ARGUMENT, str(e))
    data_groups = len(node.sim.data)
    op = append_op(
        view.topic,
        split_by_partition(cols, SPLIT_PARTITIONS),
        view.producer_id,
        view.sequence,
        view.client_id,
    ).append
    res = work_pb2.WorkResult()
    for group, sub, members in split_by_group(op, split_map(data_groups)):
        res.parts.add(group=group, op=sub.SerializeToString(), members=members)
    return OpResult(response=res.SerializeToString())
