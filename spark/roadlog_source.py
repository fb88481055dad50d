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
- ``max_pings_per_task`` (default 2,000,000): larger offset ranges are split.

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

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
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

from roadlog import columnar
from roadlog.client_tls import ClientTLS
from roadlog.limits import PEER_MESSAGE_BYTES
from roadlog.runtime.auth import cluster_token, token_metadata
from roadlog.runtime.config import read_secret
from roadlog.v1 import client_pb2, noderead_pb2, noderead_pb2_grpc

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
DEFAULT_TASK_PINGS = 2_000_000
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


class RoadlogDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "roadlog"

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: Any) -> DataSourceReader:
        return RoadlogReader(dict(self.options))

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return RoadlogStreamReader(dict(self.options))


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
) -> list[RangeTask]:
    """Offsets [start, end) of one partition as tasks of at most ``step`` pings."""
    return [
        RangeTask(topic, partition, lo, min(lo + step, end), fence, nodes, token, window, group)
        for lo in range(start, end, step)
    ]


def range_fence(resp: noderead_pb2.PlanResponse, r: noderead_pb2.OffsetRange) -> int:
    """The applied index a read of ``r`` waits for: its group's when it
    names one (a node of a release before data groups names none)."""
    return r.applied_index if r.group else resp.applied_index


def plan(options: dict[str, str], now_ms: int | None = None) -> list[RangeTask]:
    """The input partitions for these options (asks one node)."""
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
    step = _opt_int(options, "max_pings_per_task") or DEFAULT_TASK_PINGS
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
            step,
            r.group,
        )
    return tasks


class RoadlogReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.options = options

    def partitions(self) -> list[InputPartition]:
        return [InputPartition(t) for t in plan(self.options)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        task: RangeTask = partition.value
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

    def __init__(self, options: dict[str, str]) -> None:
        self.options = options
        self.nodes, self.topic = _nodes_and_topic(options)
        self.token = credentials(options)
        self.tick_ms = _opt_int(options, "tick_ms") or 0
        self.step = _opt_int(options, "max_pings_per_task") or DEFAULT_TASK_PINGS
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
        tasks: list[InputPartition] = []
        fence = int(end.get("applied_index", 0))
        fences = end.get("fences", {})
        if fences and self.partition_groups is None:
            self._plan(END_OF_TIME_MS)  # a restart from a checkpoint: learn the map
        groups = self.partition_groups or []
        for p, hi in sorted(end["partitions"].items(), key=lambda kv: int(kv[0])):
            lo = int(start.get("partitions", {}).get(p, 0))
            g = int(groups[int(p)]) if groups else 0
            for t in split(
                self.topic, int(p), lo, int(hi), int(fences.get(str(g), fence)) if g else fence,
                self.known, self.token, (None, None), self.step, g,
            ):  # fmt: skip
                tasks.append(InputPartition(t))
        return tasks

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        task: RangeTask = partition.value
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
    req = noderead_pb2.ReadRangeRequest(
        topic=task.topic,
        partition=task.partition,
        start_offset=offset,
        end_offset=task.end,
        min_applied_index=task.fence,
        group=task.group,
    )
    lo, hi = task.window
    with ClientTLS.from_env().channel(node, options=GRPC_OPTIONS) as ch:
        stream = noderead_pb2_grpc.NodeReadStub(ch).ReadRange(
            req, metadata=token_metadata(task.token), timeout=600
        )
        for b in stream:
            cols = columnar.decode(b.batch)
            n = len(cols)
            nxt = b.base_offset + n
            keep = np.ones(n, dtype=bool)
            if lo is not None:
                keep &= cols.ts_ms >= lo
            if hi is not None:
                keep &= cols.ts_ms < hi
            if not keep.any():
                yield None, nxt
                continue
            idx = np.flatnonzero(keep) if not keep.all() else None
            yield to_arrow(cols, task.partition, b.base_offset, b.append_ms, idx), nxt
        yield None, task.end  # the node streamed the whole range


def to_arrow(
    cols: columnar.PingColumns,
    partition: int,
    base: int,
    append_ms: int,
    idx: np.ndarray[Any, np.dtype[np.intp]] | None = None,
) -> pa.RecordBatch:
    """A stored batch as an Arrow record batch (the device ids decoded from
    their dictionary in Arrow, not in Python)."""
    offsets = base + np.arange(len(cols), dtype=np.int64)
    if idx is not None:
        cols = cols.take(idx)
        offsets = offsets[idx]
    n = len(cols)
    devices = pa.DictionaryArray.from_arrays(
        pa.array(cols.device_index.astype(np.int32)), pa.array(cols.device_ids, pa.string())
    ).dictionary_decode()
    return pa.RecordBatch.from_arrays(
        [
            pa.array(np.full(n, partition, dtype=np.int32)),
            pa.array(offsets),
            devices,
            pa.array(cols.ts_ms),
            pa.array(cols.lat),
            pa.array(cols.lon),
            pa.array(cols.speed_mps),
            pa.array(cols.heading_deg),
            pa.array(cols.accuracy_m),
            pa.array(np.full(n, append_ms, dtype=np.int64)),
        ],
        schema=ARROW_SCHEMA,
    )
