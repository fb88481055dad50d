"""``spark.read.format("roadlog")``: the replicated log as a Spark DataFrame.

Options:

- ``nodes``: node gRPC addresses ``HOST:PORT,...`` (any one that answers plans);
- ``secret_file`` and ``cluster_name``: the cluster token (needed only
  without TLS; with TLS the client certificate below is the credential);
- TLS from the environment of the driver and of every executor
  (``ClientTLS.from_env()``: ``ROADLOG_CA_FILE``, and a client certificate of
  the cluster's CA in ``ROADLOG_CERT_FILE``/``ROADLOG_KEY_FILE``, since a
  node's port is mutual TLS; set them for executors with
  ``spark.executorEnv.*``);
- ``topic``;
- ``window_start_ms`` / ``window_end_ms``: event time (the pings' ``ts_ms``)
  to keep, [start, end); both optional;
- ``lead_ms`` (default 5 min) and ``lateness_ms`` (default 1 h): how far
  before the window a ping may have been appended (clock skew) and how late
  after it (buffered devices); the time index is read over
  [start - lead, end + lateness), capped at the planning moment;
- ``max_bytes_per_task`` (default 64 MiB): tasks are sized by the Arrow
  bytes of the columns read (about, per ping), the window's pings cut into
  equal tasks of at most this (ranges of several partitions in one task
  when they are small), at least ``min_tasks`` (default 2) of them;
- ``max_pings_per_task`` (no default): at most this many pings a task too.

Column pruning: a schema given to the reader
(``spark.read.format("roadlog").schema("ts_ms long, speed_mps float")``)
names the columns read, a subset of the source's (same names and types):
only those are built, and only the stored ones among them (and ``ts_ms``
for the window) are sent by the node. (Spark 4's Python data sources are
not told which columns a query uses, so the schema says it.)

Streaming (``spark.readStream.format("roadlog")``, the same options but the
window; see ``RoadlogStreamReader``):

- ``starting``: where a new query starts: ``latest`` (default: only what is
  appended from now on), ``earliest`` (everything retained), or an append
  time in epoch ms (the batches appended at or after it);
- ``tick_ms`` (default 0: off): offsets carry the time floored to this, so a
  query triggered every ``tick_ms`` runs a micro-batch at each trigger even
  when no ping came (a heat map's window slides on).

Planning (on the driver) asks one node for the offset ranges of every
partition in that append-time window, pinned at its applied index (of the
partition's Raft group, for a topic placed in data groups): one
input partition per (topic partition, offset range). Each task reads its
range from the node on its own host when one runs there (every node holds
all the data), else from the others in turn, and yields Arrow record
batches built from the stored columns without a Python object per ping.
Only committed data is read, and a plan read twice gives the same rows.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    SupportsTriggerAvailableNow,
)

from roadlog.client_tls import ClientTLS
from roadlog.column_subset import parse_subset
from roadlog.limits import PEER_MESSAGE_BYTES
from roadlog.runtime.auth import cluster_token, token_metadata
from roadlog.runtime.config import read_secret
from roadlog.v1 import client_pb2, noderead_pb2, noderead_pb2_grpc
from spark.arrow_batches import (
    ARROW_BYTES,
    ARROW_TYPES,
    Dictionaries,
    Part,
    from_stored,
    record_batch,
    stored_fields,
)

SCHEMA = (
    "partition int, offset long, device_id string, ts_ms long, lat double, lon double, "
    "speed_mps float, heading_deg float, accuracy_m float, append_ms long"
)
ARROW_SCHEMA = pa.schema(
    [
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("device_id", pa.string()),
        ("ts_ms", pa.int64()),
        ("lat", pa.float64()),
        ("lon", pa.float64()),
        ("speed_mps", pa.float32()),
        ("heading_deg", pa.float32()),
        ("accuracy_m", pa.float32()),
        ("append_ms", pa.int64()),
    ]
)
DEFAULT_LEAD_MS = 5 * 60_000
DEFAULT_LATENESS_MS = 3_600_000
DEFAULT_TASK_BYTES = 64 << 20
DEFAULT_MIN_TASKS = 2
ALL_COLUMNS = tuple(ARROW_SCHEMA.names)
# Stored batches joined into one record batch up to about this many pings.
BATCH_PINGS = 1 << 17
GRPC_OPTIONS = [("grpc.max_receive_message_length", PEER_MESSAGE_BYTES)]


@dataclass(frozen=True)
class RangeTask:
    """One input partition: offsets [start, end) of one topic partition."""

    topic: str
    partition: int
    start: int
    end: int
    fence: int
    nodes: tuple[str, ...]
    token: str
    window: tuple[int | None, int | None]
    group: int = 0  # the Raft group holding the partition; ``fence`` is its index
    columns: tuple[str, ...] = ALL_COLUMNS  # what a read of it builds, in this order


def columns_of(schema: Any) -> tuple[str, ...]:
    """The columns a reader's schema names (ValueError: one the source has
    not, or of another type)."""
    from pyspark.sql.pandas.types import to_arrow_schema

    if schema is None:
        return ALL_COLUMNS
    arrow = to_arrow_schema(schema, timezone="UTC")
    for f in arrow:
        want = ARROW_TYPES.get(f.name)
        if want is None:
            raise ValueError(f"the roadlog source has no column {f.name!r} ({SCHEMA})")
        if f.type != want:
            raise ValueError(f"column {f.name}: the roadlog source's is {want}, not {f.type}")
    return tuple(arrow.names)


class RoadlogDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "roadlog"

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: Any) -> DataSourceReader:
        return RoadlogReader(dict(self.options), columns_of(schema))

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return RoadlogStreamReader(dict(self.options), columns_of(schema))


def _opt_int(options: dict[str, str], key: str) -> int | None:
    v = options.get(key)
    return int(v) if v not in (None, "") else None


def credentials(options: dict[str, str]) -> str:
    """The cluster token from ``secret_file``; "" without one: with TLS the
    reader's client certificate alone lets it read from the nodes (so the
    Spark hosts need not hold the cluster secret)."""
    secret_file = options.get("secret_file")
    if not secret_file:
        if ClientTLS.from_env().insecure:
            raise ValueError("the roadlog source needs option secret_file (the cluster has no TLS)")
        return ""
    return cluster_token(read_secret(Path(secret_file)), options.get("cluster_name", "roadlog"))


def _nodes_and_topic(options: dict[str, str]) -> tuple[tuple[str, ...], str]:
    nodes = tuple(n for n in options.get("nodes", "").split(",") if n)
    topic = options.get("topic", "")
    if not nodes or not topic:
        raise ValueError("the roadlog source needs options nodes and topic")
    return nodes, topic


def read_fences(options: dict[str, str]) -> tuple[int, list[tuple[int, int]]]:
    """Where the plan must start from (options ``min_applied_index`` and
    ``group_fences``, ``GROUP:INDEX,...``): the node that plans answers
    once it applied them. A caller that learns them with ``ReadFences``
    (the heat-map job does) gets a plan holding every ping acknowledged
    before it; without them the plan is what the answering node applied."""
    given = []
    for f in options.get("group_fences", "").split(","):
        if f:
            g, _, i = f.partition(":")
            if not (g.isdigit() and i.isdigit()):
                raise ValueError(f"option group_fences: {f!r} is not GROUP:INDEX")
            given.append((int(g), int(i)))
    return _opt_int(options, "min_applied_index") or 0, given


def ask_plan(
    nodes: tuple[str, ...], token: str, req: noderead_pb2.PlanRequest
) -> noderead_pb2.PlanResponse:
    """Ask the nodes in turn (the one on this host first) for a plan."""
    errors = []
    for n in sorted(nodes, key=lambda n: not is_local(n)):
        try:
            with ClientTLS.from_env().channel(n, options=GRPC_OPTIONS) as ch:
                resp: noderead_pb2.PlanResponse = noderead_pb2_grpc.NodeReadStub(ch).Plan(
                    req, metadata=token_metadata(token), timeout=30
                )
            return resp
        except grpc.RpcError as e:
            errors.append(f"{n}: {e.code().name} {e.details()}")
            if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED):
                break
    raise RuntimeError("no node could plan the read: " + "; ".join(errors))


def split(
    topic: str,
    partition: int,
    start: int,
    end: int,
    fence: int,
    nodes: tuple[str, ...],
    token: str,
    window: tuple[int | None, int | None],
    step: int,
    group: int = 0,
    columns: tuple[str, ...] = ALL_COLUMNS,
) -> list[RangeTask]:
    """Offsets [start, end) of one partition as ranges of at most ``step`` pings."""
    return [
        RangeTask(
            topic, partition, lo, min(lo + step, end), fence, nodes, token, window, group, columns
        )
        for lo in range(start, end, step)
    ]


def bundle(ranges: list[RangeTask], options: dict[str, str]) -> list[tuple[RangeTask, ...]]:
    """The ranges as tasks sized by bytes: the pings cut into equal tasks of
    at most ``max_bytes_per_task`` (about, in Arrow, of the columns read)
    and ``max_pings_per_task``, at least ``min_tasks`` of them (a small
    read is not one task on one core); a range is cut where a task ends,
    and a task may hold the ranges of several partitions."""
    total = sum(r.end - r.start for r in ranges)
    if not total:
        return []
    width = sum(ARROW_BYTES[c] for c in ranges[0].columns) or 1
    cap = (_opt_int(options, "max_bytes_per_task") or DEFAULT_TASK_BYTES) // width
    cap = min(cap, _opt_int(options, "max_pings_per_task") or cap)
    n_tasks = max(_opt_int(options, "min_tasks") or DEFAULT_MIN_TASKS, -(-total // max(cap, 1)))
    n_tasks = min(n_tasks, total)
    size = -(-total // n_tasks)
    tasks: list[tuple[RangeTask, ...]] = []
    current: list[RangeTask] = []
    room = size
    for r in ranges:
        lo = r.start
        while lo < r.end:
            hi = min(r.end, lo + room)
            current.append(dataclasses.replace(r, start=lo, end=hi))
            room -= hi - lo
            lo = hi
            if room == 0:
                tasks.append(tuple(current))
                current, room = [], size
    if current:
        tasks.append(tuple(current))
    return tasks


def range_fence(resp: noderead_pb2.PlanResponse, r: noderead_pb2.OffsetRange) -> int:
    """The applied index a read of ``r`` waits for: its group's when it
    names one (a node of a release before data groups names none)."""
    return r.applied_index if r.group else resp.applied_index


def plan(
    options: dict[str, str], now_ms: int | None = None, columns: tuple[str, ...] = ALL_COLUMNS
) -> list[RangeTask]:
    """The ranges these options read, one per partition, cut at
    ``max_pings_per_task`` when given (asks one node); ``bundle`` makes
    tasks of them."""
    nodes, topic = _nodes_and_topic(options)
    token = credentials(options)
    start, end = _opt_int(options, "window_start_ms"), _opt_int(options, "window_end_ms")
    now = now_ms if now_ms is not None else int(time.time() * 1000)
    lead = _opt_int(options, "lead_ms") or DEFAULT_LEAD_MS
    late = _opt_int(options, "lateness_ms") or DEFAULT_LATENESS_MS
    fence, group_fences = read_fences(options)
    req = noderead_pb2.PlanRequest(
        topic=topic,
        append_start_ms=max(0, start - lead) if start is not None else 0,
        append_end_ms=min(end + late, now) if end is not None else now,
        min_applied_index=fence,
        group_fences=[client_pb2.GroupFence(group=g, applied_index=i) for g, i in group_fences],
    )
    resp = ask_plan(nodes, token, req)
    every = tuple(dict.fromkeys([*resp.node_addresses, *nodes]))
    step = _opt_int(options, "max_pings_per_task")
    tasks = []
    for r in resp.ranges:
        tasks += split(
            topic,
            r.partition,
            r.start_offset,
            r.end_offset,
            range_fence(resp, r),
            every,
            token,
            (start, end),
            step or max(1, r.end_offset - r.start_offset),
            r.group,
            columns,
        )
    return tasks


class RoadlogReader(DataSourceReader):
    def __init__(self, options: dict[str, str], columns: tuple[str, ...] = ALL_COLUMNS) -> None:
        self.options = options
        self.columns = columns

    def partitions(self) -> list[InputPartition]:
        return [InputPartition(t) for t in bundle(plan(self.options, columns=self.columns),
                                                  self.options)]  # fmt: skip

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        for task in partition.value:
            yield from read_range(task)


# ------------------------------------------------------------- streaming

# An append time past any real one: a plan up to it ends at each partition's
# next offset.
END_OF_TIME_MS = 2**62


class RoadlogStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches of committed pings, offset by offset.

    An offset is ``{"topic_id": I, "applied_index": N, "fences": {"G": N},
    "partitions": {"P": next offset}, "tick_ms": T}``: what one node had
    applied when asked, in group 0 and in each data group the topic is
    placed in (only committed pings, pinned there, so a micro-batch read
    again after a restart from the checkpoint gives the same pings), each
    partition's end. A
    micro-batch reads, per partition, offsets [start, end) from the node on
    the task's own host first. Offsets are dense and never reused, so
    consecutive micro-batches neither miss nor repeat a ping; offsets that
    retention trimmed meanwhile are skipped.
    """

    def __init__(self, options: dict[str, str], columns: tuple[str, ...] = ALL_COLUMNS) -> None:
        self.options = options
        self.columns = columns
        self.nodes, self.topic = _nodes_and_topic(options)
        self.token = credentials(options)
        self.tick_ms = _opt_int(options, "tick_ms") or 0
        self.known = self.nodes
        self.target: dict[str, Any] | None = None  # Trigger.AvailableNow's end
        self.partition_groups: list[int] | None = None  # the topic's, once planned

    def _plan(self, append_start_ms: int) -> noderead_pb2.PlanResponse:
        resp = ask_plan(
            self.known,
            self.token,
            noderead_pb2.PlanRequest(
                topic=self.topic, append_start_ms=append_start_ms, append_end_ms=END_OF_TIME_MS
            ),
        )
        self.known = tuple(dict.fromkeys([*self.nodes, *resp.node_addresses]))
        self.partition_groups = list(resp.topic.partition_groups)
        return resp

    def _offset(
        self, resp: noderead_pb2.PlanResponse, at: str, now_ms: int | None = None
    ) -> dict[str, Any]:
        """Each partition's start (``at="start"``) or end offset in a plan;
        a partition with nothing in the plan's range is at its end, which
        the plan up to the end of time gives (``at="end"``)."""
        parts = {str(p): 0 for p in range(resp.topic.spec.partitions)}
        for r in resp.ranges:
            parts[str(r.partition)] = r.start_offset if at == "start" else r.end_offset
        now = now_ms if now_ms is not None else int(time.time() * 1000)
        tick = now // self.tick_ms * self.tick_ms if self.tick_ms else 0
        return {
            "topic_id": resp.topic.id,
            "applied_index": resp.applied_index,
            "fences": {str(g): int(i) for g, i in sorted(resp.group_applied.items())},
            "partitions": parts,
            "tick_ms": tick,
        }

    def _latest(self) -> dict[str, Any]:
        return self._offset(self._plan(0), "end")

    def initialOffset(self) -> dict[str, Any]:
        starting = self.options.get("starting", "latest")
        if starting == "latest":
            return self._latest()
        if starting == "earliest":
            return self._offset(self._plan(0), "start")
        try:
            since = int(starting)
        except ValueError:
            raise ValueError(
                f"starting={starting!r}: latest, earliest or an append time in ms"
            ) from None
        ends = self._latest()
        resp = self._plan(since)  # the partitions appended to since: from there
        parts = dict(ends["partitions"])
        for r in resp.ranges:
            parts[str(r.partition)] = r.start_offset
        fence = max(ends["applied_index"], resp.applied_index)
        fences = {
            g: max(i, int(resp.group_applied.get(int(g), 0))) for g, i in ends["fences"].items()
        }
        return {**ends, "applied_index": fence, "fences": fences, "partitions": parts,
                "tick_ms": 0}  # fmt: skip

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        if not isinstance(limit, ReadAllAvailable):
            raise ValueError(f"the roadlog stream reads everything available, not {limit}")
        latest = json.loads(json.dumps(self.target)) if self.target else self._latest()
        if start.get("topic_id", latest["topic_id"]) != latest["topic_id"]:
            raise RuntimeError(
                f"topic {self.topic!r} was deleted and created again since this query's "
                "checkpoint: its offsets mean nothing now; start with a new checkpoint"
            )
        if latest["applied_index"] < start.get("applied_index", 0):
            # a node behind the last batch's: never move an offset back
            latest["applied_index"] = start["applied_index"]
        fences = latest.setdefault("fences", {})
        for g, i in start.get("fences", {}).items():
            fences[g] = max(int(fences.get(g, 0)), int(i))
        for p, off in start.get("partitions", {}).items():
            latest["partitions"][p] = max(latest["partitions"].get(p, 0), off)
        return latest

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = self._latest()

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        ranges: list[RangeTask] = []
        fence = int(end.get("applied_index", 0))
        fences = end.get("fences", {})
        if fences and self.partition_groups is None:
            self._plan(END_OF_TIME_MS)  # a restart from a checkpoint: learn the map
        groups = self.partition_groups or []
        for p, hi in sorted(end["partitions"].items(), key=lambda kv: int(kv[0])):
            lo = int(start.get("partitions", {}).get(p, 0))
            g = int(groups[int(p)]) if groups else 0
            if hi > lo:
                ranges.append(RangeTask(
                    self.topic, int(p), lo, int(hi),
                    int(fences.get(str(g), fence)) if g else fence,
                    self.known, self.token, (None, None), g, self.columns,
                ))  # fmt: skip
        return [InputPartition(t) for t in bundle(ranges, self.options)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        for task in partition.value:
            yield from read_range(task)

    def commit(self, end: dict[str, Any]) -> None:
        pass  # the cluster keeps every ping until its retention: nothing to release


def is_local(address: str) -> bool:
    """Does ``address`` name this host? (The route to it leaves from it.)"""
    host = address.rpartition(":")[0]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return bool(s.getsockname()[0] == socket.gethostbyname(host))
    except OSError:
        return False


def read_range(task: RangeTask) -> Iterator[pa.RecordBatch]:
    """The task's pings, from the local node first, failing over to the
    others; resumes where a broken stream stopped."""
    order = sorted(task.nodes, key=lambda n: not is_local(n))
    offset = task.start
    errors = []
    for _ in range(3):
        for node in order:
            try:
                for rb, nxt in _stream(task, node, offset):
                    offset = nxt
                    if rb is not None:
                        yield rb
                if offset >= task.end:
                    return
            except grpc.RpcError as e:
                errors.append(f"{node}: {e.code().name} {e.details()}")
        time.sleep(1.0)
    raise RuntimeError(
        f"could not read {task.topic}/{task.partition} [{task.start}, {task.end}): "
        + "; ".join(errors[-3:])
    )


def _stream(task: RangeTask, node: str, offset: int) -> Iterator[tuple[pa.RecordBatch | None, int]]:
    """The range from ``offset`` on from ``node``: record batches of about
    ``BATCH_PINGS`` pings each (stored batches joined), and the offset after
    each; the node sends only the columns the task builds."""
    req = noderead_pb2.ReadRangeRequest(
        topic=task.topic,
        partition=task.partition,
        start_offset=offset,
        end_offset=task.end,
        min_applied_index=task.fence,
        group=task.group,
        columns=stored_fields(task.columns, task.window),
    )
    dictionaries = Dictionaries() if "device_id" in task.columns else None
    parts: list[Part] = []
    pending = 0

    def flush() -> tuple[pa.RecordBatch | None, int]:
        last = parts[-1]
        rb = record_batch(parts, task.partition, task.columns, task.window)
        return rb, last.base + last.sub.n

    with ClientTLS.from_env().channel(node, options=GRPC_OPTIONS) as ch:
        stream = noderead_pb2_grpc.NodeReadStub(ch).ReadRange(
            req, metadata=token_metadata(task.token), timeout=600
        )
        for b in stream:
            if b.count:  # pruned by the node
                sub = parse_subset(b.batch, b.device_ids, b.count)
                ids = dictionaries.of(b.device_ids) if dictionaries is not None else None
            else:  # a node that does not prune: the batch as stored
                sub, ids = from_stored(b.batch, dictionaries)
            parts.append(Part(b.base_offset, b.append_ms, sub, ids))
            pending += sub.n
            if pending >= BATCH_PINGS:
                yield flush()
                parts, pending = [], 0
        if parts:
            yield flush()
        yield None, task.end  # the node streamed the whole range
