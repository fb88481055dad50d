"""Topics in the state machine (applied from the log, so every replica
holds the same records): each topic's record and its partitions' states.

- ``topics``: name -> Topic (protobuf: its spec, id, creation time, bounding
  box and, once the cluster has data groups, the group of each partition)
- ``parts``: topic id, partition -> first offset, next offset, last append ms
- in ``meta``: ``next_topic_id``, and ``data_groups``, the cluster's number
  of data groups, which its first topic records and every later one is
  placed by

Group 0 creates and deletes topics; a data group holds the topics placed in
it as group 0 made them (``place``: the same id, empty partitions).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from node_daemon.state.heatmaps import DEFAULT_CONTRIBUTION_WINDOW_MS
from node_daemon.state.keys import meta_int
from roadlog.contribution import min_pings, min_seconds
from roadlog.errors import Code, RoadlogError
from roadlog.geo import RegionError, parse_region
from roadlog.placement import MAX_DATA_GROUPS, group_of, partition_groups
from roadlog.v1 import client_pb2, command_pb2, topics_pb2
from roadlog.validation import MAX_PARTITIONS, check_topic_name

DEFAULT_PARTITIONS = 8
DEFAULT_RETENTION_MS = 7 * 24 * 3600 * 1000
DEFAULT_H3_RESOLUTION = 9

_PART = struct.Struct(">II")
_PART_VAL = struct.Struct(">QQq")
_U64 = struct.Struct(">Q")
MAX_CONTRIBUTION_PINGS = 1_000_000


@dataclass(frozen=True, slots=True)
class PartitionState:
    first_offset: int
    next_offset: int
    last_append_ms: int


class TopicTables:
    """The topic records in ``records`` (the ``topics`` database) and their
    partitions' states in ``parts``."""

    def __init__(self, records: Any, parts: Any, meta: Any) -> None:
        self.records = records
        self.parts = parts
        self.meta = meta

    # ------------------------------------------------------------- applying

    def create(
        self, txn: Any, spec: topics_pb2.TopicSpec, leader_ms: int, data_groups: int = 0
    ) -> topics_pb2.TopicDescription:
        spec = normalized_spec(spec)
        existing = txn.get(spec.name.encode(), db=self.records)
        if existing is not None:
            topic = topics_pb2.Topic.FromString(existing)
            if topic.spec == spec:
                return self.describe(txn, topic)  # the same request again
            raise RoadlogError(Code.ALREADY_EXISTS, f"topic {spec.name!r} already exists")
        tid = meta_int(txn, self.meta, b"next_topic_id") + 1
        groups = self._data_groups(txn, data_groups, first_topic=tid == 1)
        txn.put(b"next_topic_id", _U64.pack(tid), db=self.meta)
        region = parse_region(spec.region_geojson)
        topic = topics_pb2.Topic(
            spec=spec,
            id=tid,
            created_ms=leader_ms,
            bbox=region.bbox,
            partition_groups=partition_groups(tid, spec.partitions, groups),
        )
        txn.put(spec.name.encode(), topic.SerializeToString(), db=self.records)
        for p in range(spec.partitions):
            txn.put(_PART.pack(tid, p), _PART_VAL.pack(0, 0, 0), db=self.parts)
        return self.describe(txn, topic)

    def place(self, txn: Any, topic: topics_pb2.Topic) -> None:
        """In a data group: record group 0's topic as it is (its id kept),
        with empty partitions; the same record again changes nothing. A
        topic of the same name but another id (deleted and made again in
        group 0) is refused: the group drops the old one first."""
        if not topic.id or not topic.spec.name or topic.spec.partitions <= 0:
            raise RoadlogError(Code.INVALID_ARGUMENT, "a placed topic needs its id and spec")
        existing = txn.get(topic.spec.name.encode(), db=self.records)
        if existing is not None:
            if topics_pb2.Topic.FromString(existing).id == topic.id:
                return
            raise RoadlogError(
                Code.FAILED_PRECONDITION, f"topic {topic.spec.name!r} here has another id"
            )
        txn.put(topic.spec.name.encode(), topic.SerializeToString(), db=self.records)
        for p in range(topic.spec.partitions):
            txn.put(_PART.pack(topic.id, p), _PART_VAL.pack(0, 0, 0), db=self.parts)

    def _data_groups(self, txn: Any, proposed: int, first_topic: bool) -> int:
        """The cluster's number of data groups. The first topic ever made
        records the value its leader proposed (at least 1) and every later
        topic is placed by it, whatever later leaders propose; a cluster
        with topics from before groups has one."""
        recorded = meta_int(txn, self.meta, b"data_groups")
        if recorded:
            return recorded
        if not first_topic:
            return 1
        recorded = min(max(proposed, 1), MAX_DATA_GROUPS)
        txn.put(b"data_groups", _U64.pack(recorded), db=self.meta)
        return recorded

    def update(self, txn: Any, req: client_pb2.UpdateTopicRequest) -> topics_pb2.TopicDescription:
        """Change the access fields ``req`` sets (group 0's record; a data
        group's placed copy keeps its spec, and these fields are read from
        group 0's): checked as a create's are."""
        topic = self.get(txn, req.name)
        spec = updated_spec(topic.spec, req)
        if spec != topic.spec:
            topic.spec.CopyFrom(spec)
            txn.put(req.name.encode(), topic.SerializeToString(), db=self.records)
        return self.describe(txn, topic)

    def drop(self, txn: Any, name: str) -> None:
        """The topic's record (its partitions' states go with its id's prefix)."""
        txn.delete(name.encode(), db=self.records)

    def put_state(self, txn: Any, tid: int, p: int, st: PartitionState) -> None:
        txn.put(
            _PART.pack(tid, p),
            _PART_VAL.pack(st.first_offset, st.next_offset, st.last_append_ms),
            db=self.parts,
        )

    # ---------------------------------------------------------------- reads

    def founded_data_groups(self, txn: Any) -> int | None:
        """The data groups the cluster was founded with, as its first topic
        recorded them (1 for a cluster whose topics came before groups);
        None before the first topic, when that is not decided yet."""
        recorded = meta_int(txn, self.meta, b"data_groups")
        if recorded:
            return recorded
        return 1 if meta_int(txn, self.meta, b"next_topic_id") else None

    def recorded_data_groups(self, txn: Any) -> int:
        """The recorded number of data groups (0: not recorded yet)."""
        return meta_int(txn, self.meta, b"data_groups")

    def get(self, txn: Any, name: str) -> topics_pb2.Topic:
        try:
            check_topic_name(name)  # also keeps LMDB from an empty or oversized key
        except ValueError as e:
            raise RoadlogError(Code.INVALID_ARGUMENT, str(e)) from None
        raw = txn.get(name.encode(), db=self.records)
        if raw is None:
            raise RoadlogError(Code.NOT_FOUND, f"no topic {name!r}")
        return topics_pb2.Topic.FromString(raw)

    def lookup(self, txn: Any, name: str) -> topics_pb2.Topic | None:
        """The topic named ``name`` (None: none here), its name unchecked."""
        raw = txn.get(name.encode(), db=self.records)
        return None if raw is None else topics_pb2.Topic.FromString(raw)

    def each(self, txn: Any) -> Iterator[topics_pb2.Topic]:
        """Every topic's record, in name order."""
        for _, raw in txn.cursor(db=self.records):
            yield topics_pb2.Topic.FromString(raw)

    def by_name(self, txn: Any) -> dict[str, topics_pb2.Topic]:
        return {k.decode(): topics_pb2.Topic.FromString(v) for k, v in txn.cursor(db=self.records)}

    def part_state(self, txn: Any, tid: int, p: int) -> PartitionState:
        raw = txn.get(_PART.pack(tid, p), db=self.parts)
        if raw is None:
            raise RoadlogError(Code.NOT_FOUND, f"no partition {p}")
        return PartitionState(*_PART_VAL.unpack(raw))

    def describe(self, txn: Any, topic: topics_pb2.Topic) -> topics_pb2.TopicDescription:
        d = topics_pb2.TopicDescription(topic=topic)
        for p in range(topic.spec.partitions):
            st = self.part_state(txn, topic.id, p)
            d.partitions.add(
                partition=p,
                first_offset=st.first_offset,
                next_offset=st.next_offset,
                last_append_ms=st.last_append_ms,
                group=group_of(topic, p),
            )
        return d

    def page(
        self, txn: Any, after: str, limit: int, max_bytes: int
    ) -> tuple[list[topics_pb2.TopicDescription], str]:
        """Topics named after ``after``, in name order: at most ``limit``,
        and no more once ``max_bytes`` are reached (always one, if any is
        left). Returns them and the token of the next page ("": none)."""
        out: list[topics_pb2.TopicDescription] = []
        size = 0
        cur = txn.cursor(db=self.records)
        key = after.encode()
        if not cur.set_range(key):
            return out, ""
        for k, raw in cur:
            if k == key:
                continue
            if len(out) >= limit or (out and size >= max_bytes):
                return out, out[-1].topic.spec.name
            d = self.describe(txn, topics_pb2.Topic.FromString(raw))
            out.append(d)
            size += d.ByteSize()
        return out, ""


def normalized_spec(spec: topics_pb2.TopicSpec) -> topics_pb2.TopicSpec:
    """Defaults filled in and everything checked; RoadlogError when invalid."""
    try:
        check_topic_name(spec.name)
        region = parse_region(spec.region_geojson)
    except (ValueError, RegionError) as e:
        raise RoadlogError(Code.INVALID_ARGUMENT, str(e)) from None
    out = topics_pb2.TopicSpec(
        name=spec.name,
        region_geojson=region.geojson,
        partitions=spec.partitions or DEFAULT_PARTITIONS,
        retention_ms=spec.retention_ms or DEFAULT_RETENTION_MS,
        h3_resolution=spec.h3_resolution or DEFAULT_H3_RESOLUTION,
        contribution_window_ms=spec.contribution_window_ms or DEFAULT_CONTRIBUTION_WINDOW_MS,
        no_open_produce=spec.no_open_produce,
        contribution_min_pings=min_pings(spec),  # set: a later default changes no topic
        contribution_min_seconds=min_seconds(spec),
    )
    if out.contribution_window_ms < 0:
        raise RoadlogError(Code.INVALID_ARGUMENT, "the contribution window must be positive")
    check_contribution(out)
    if not 1 <= out.partitions <= MAX_PARTITIONS:
        raise RoadlogError(Code.INVALID_ARGUMENT, f"partitions must be in 1..{MAX_PARTITIONS}")
    if out.retention_ms < 0:
        raise RoadlogError(Code.INVALID_ARGUMENT, "retention must be positive")
    if out.h3_resolution > 15:
        raise RoadlogError(Code.INVALID_ARGUMENT, "H3 resolution must be in 0..15")
    return out


def updated_spec(
    spec: topics_pb2.TopicSpec, req: client_pb2.UpdateTopicRequest
) -> topics_pb2.TopicSpec:
    """``spec`` with the fields ``req`` sets; INVALID_ARGUMENT if the result
    is not a valid contribution rule."""
    out = topics_pb2.TopicSpec()
    out.CopyFrom(spec)
    if req.HasField("no_open_produce"):
        out.no_open_produce = req.no_open_produce
    if req.HasField("contribution_min_pings"):
        out.contribution_min_pings = req.contribution_min_pings
    if req.HasField("contribution_min_seconds"):
        out.contribution_min_seconds = req.contribution_min_seconds
    check_contribution(out)
    return out


def check_contribution(spec: topics_pb2.TopicSpec) -> None:
    """A contribution needs 1..MAX_CONTRIBUTION_PINGS pings, over no more
    seconds than the contribution window holds."""
    pings, seconds = min_pings(spec), min_seconds(spec)
    window_s = (spec.contribution_window_ms or DEFAULT_CONTRIBUTION_WINDOW_MS) / 1000
    if not 1 <= pings <= MAX_CONTRIBUTION_PINGS:
        raise RoadlogError(
            Code.INVALID_ARGUMENT,
            f"contribution_min_pings must be in 1..{MAX_CONTRIBUTION_PINGS}, not {pings}",
        )
    if seconds > window_s:
        raise RoadlogError(
            Code.INVALID_ARGUMENT,
            f"contribution_min_seconds {seconds} is longer than the contribution window "
            f"({window_s:g} s)",
        )


def check_topic_id(op: command_pb2.AppendOp, topic: topics_pb2.Topic) -> None:
    """Refuse an op made for another topic of the same name (a data group's
    part, made for the topic group 0 holds now), or for a topic fenced for
    a move to another cluster (``Topic.moving``, issue 43)."""
    if op.topic_id and op.topic_id != topic.id:
        raise RoadlogError(
            Code.UNAVAILABLE,
            f"topic {op.topic!r} here is not the one group 0 holds now: try again",
        )
    if topic.moving:  # federation (issue 43): fenced for a move
        raise RoadlogError(
            Code.UNAVAILABLE, f"topic {op.topic!r} is moving to another cluster: try again"
        )
