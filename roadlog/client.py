"""The client library: Admin, Producer and Consumer over the gRPC API.

A Connection holds channels to one or more queue servers and fails over
between them. Calls that may succeed later (no leader during an election, a
queue server down, queues full) are retried with backoff until the caller's
deadline; others raise at once with the server's reason.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf.message import Message

from roadlog import columnar
from roadlog.client_tls import ClientTLS
from roadlog.columnar import PingColumns

# The SDK's error names (re-exported: callers catch roadlog.client.NotFound ...).
from roadlog.errors import AlreadyExists as AlreadyExists
from roadlog.errors import Code, error
from roadlog.errors import FailedPrecondition as FailedPrecondition
from roadlog.errors import InvalidArgument as InvalidArgument
from roadlog.errors import NotFound as NotFound
from roadlog.errors import PermissionDenied as PermissionDenied
from roadlog.errors import RoadlogError as RoadlogError
from roadlog.errors import Unavailable as Unavailable
from roadlog.federation.home import Home, home_in_metadata
from roadlog.geo import Region, parse_region
from roadlog.grpc_status import from_grpc
from roadlog.limits import CLIENT_MESSAGE_BYTES
from roadlog.partitioning import ping_groups
from roadlog.protowire import with_leading_varint
from roadlog.rpc import BY_NAME, SERVICE
from roadlog.v1 import (
    client_pb2,
    clients_pb2,
    groups_pb2,
    heatmaps_pb2,
    settings_pb2,
    topics_pb2,
)
from roadlog.validation import BatchRejected, check_size, ping_reasons, raise_if_bad

# What a client sends again (to the next queue server, with backoff): the
# server could not take it now. CANCELLED among them: a client never cancels
# a call it still waits on, so one it receives is the server's doing (a
# server that stops cancels every call it holds); sending again is safe
# (publishes are deduplicated by producer id and sequence, reads change nothing).
RETRYABLE = {Code.UNAVAILABLE, Code.RESOURCE_EXHAUSTED, Code.DEADLINE_EXCEEDED, Code.CANCELLED}
STALE_MAP = "the topic's map changed"  # a data group's refusal of another group's pings
UNKNOWN_PRODUCER = "unknown producer id"  # a cluster's refusal of an id it never issued
M = TypeVar("M", bound=Message)


class _Redirected(Exception):
    """The cluster asked holds not the topic but names its ``home``."""

    def __init__(self, home: Home, details: str) -> None:
        super().__init__(details)
        self.home = home
        self.details = details


def _rpc_error(e: grpc.RpcError) -> RoadlogError:
    """The SDK error for a failed gRPC call: its status and details."""
    return error(from_grpc(e.code()), e.details() or "")


def _final(e: grpc.RpcError) -> bool:
    """A RESOURCE_EXHAUSTED no retry changes: a request or answer over a
    hop's byte limit, or a quota reached (its message says what frees it)."""
    details = e.details() or ""
    return e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and (
        "over the limit" in details or "larger than max" in details or "quota:" in details
    )


def servers_from_env(value: str | None = None) -> list[str]:
    raw = value if value is not None else os.environ.get("ROADLOG_SERVERS", "")
    return [s.strip() for s in raw.split(",") if s.strip()]


def client_id() -> str:
    """ROADLOG_CLIENT_ID, or an id made once and kept in the user's config dir."""
    env = os.environ.get("ROADLOG_CLIENT_ID")
    if env:
        return env
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "roadlog"
    path = base / "client_id"
    try:
        return path.read_text().strip()
    except OSError:
        cid = f"client-{uuid.uuid4().hex[:16]}"
        try:
            base.mkdir(parents=True, exist_ok=True)
            path.write_text(cid + "\n")
        except OSError:
            pass
        return cid


def first_server(count: int) -> int:
    """Which of ``count`` queue servers a new connection calls first: any
    one, so that clients spread over the queue servers (none of them is the
    cluster's one ceiling) and fail over from there in turn."""
    return random.randrange(count) if count > 1 else 0


class Connection:
    """Channels to the queue servers, each connection starting at any one of
    them (``first_server``); calls fail over between them. Every
    call carries the identity's token (``token``, else ``tls.token``, else
    ROADLOG_TOKEN: ``authorization: Bearer TOKEN``) and the client id (queue
    servers are fair between clients; with tokens the identity's client id
    counts, not this one)."""

    def __init__(
        self,
        servers: Sequence[str],
        timeout: float = 30.0,
        client: str | None = None,
        tls: ClientTLS | None = None,
        token: str | None = None,
    ) -> None:
        if not servers:
            raise ValueError("no queue server given (--servers, --cluster or ROADLOG_SERVERS)")
        self.servers = list(servers)
        self.timeout = timeout
        self._options = opts = [
            ("grpc.max_receive_message_length", CLIENT_MESSAGE_BYTES),
            ("grpc.max_send_message_length", CLIENT_MESSAGE_BYTES),
        ]
        self.tls = (tls if tls is not None else ClientTLS.from_env()).with_token(token)
        self.channels = [self.tls.channel(s, options=opts) for s in self.servers]
        self.cluster = ""  # the member cluster a redirect pointed it at ("": as given)
        # Per channel, per method: a call that sends and receives bytes (the
        # rpc table says what they are; views are sent and read as they are).
        self._calls: list[dict[str, grpc.UnaryUnaryMultiCallable[bytes, bytes]]] = [
            {} for _ in self.channels
        ]
        self._current = first_server(len(self.channels))
        self.metadata = (("roadlog-client", client or client_id()), *self.tls.metadata())
        # Session consistency: the highest applied index any answer carried;
        # reads that take a fence wait for it (read your writes). Threads may
        # share a connection: the fence only ever grows, under a lock.
        self.fence = 0
        # The same per data group, for topics placed in data groups
        # (multi-raft): group -> the highest index an answer gave for it.
        self.group_fences: dict[int, int] = {}
        self._fence_lock = threading.Lock()

    def close(self) -> None:
        for c in self.channels:
            c.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(
        self,
        method: str,
        request: Message,
        timeout: float | None = None,
        response: type[Message] | None = None,
        routing_group: int = 0,
    ) -> Any:
        """``_call_once``, and once more at the topic's home when the cluster
        asked names another (federation, issue 43: ``follow``)."""
        try:
            return self._call_once(method, request, timeout, response, routing_group)
        except _Redirected as r:
            self.follow(r.home)
        try:
            return self._call_once(method, request, timeout, response, routing_group)
        except _Redirected as r:
            raise error(Code.FAILED_PRECONDITION, r.details) from None

    def follow(self, home: Home) -> None:
        """Point this connection at ``home``'s queue servers (a member
        cluster of a federation): what it calls next goes there. Its fences
        are dropped: Raft indexes are per cluster."""
        if list(home.queue_servers) == self.servers:
            return
        for c in self.channels:
            c.close()
        self.servers = list(home.queue_servers)
        self.channels = [self.tls.channel(s, options=self._options) for s in self.servers]
        self._calls = [{} for _ in self.channels]
        self._current = first_server(len(self.channels))
        self.cluster = home.cluster
        with self._fence_lock:
            self.fence = 0
            self.group_fences = {}

    def _call_once(
        self,
        method: str,
        request: Message,
        timeout: float | None = None,
        response: type[Message] | None = None,
        routing_group: int = 0,
    ) -> Any:
        """Call ``method``; retry retryable failures (on the next queue
        server) until ``timeout`` seconds have passed. A read that takes a
        fence and sets none waits for everything this connection wrote.
        ``request`` may be a view of the rpc's request (the same wire
        bytes); the answer is the rpc's response, or ``response`` (a view).
        ``routing_group``: a publish whose pings all lie in that data group's
        partitions, said first in the message (the queue server routes it to
        that group's leader without parsing it)."""
        fields = request.DESCRIPTOR.fields_by_name
        fenceable = "min_applied_index" in fields
        add_fence = self.fence and fenceable and not getattr(request, "min_applied_index")  # noqa: B009
        add_groups = (
            self.group_fences and "group_fences" in fields and not getattr(request, "group_fences")  # noqa: B009
        )
        if add_fence or add_groups:
            fenced = type(request)()
            fenced.CopyFrom(request)
            if add_fence:
                fenced.min_applied_index = self.fence  # type: ignore[attr-defined]
            if add_groups:
                with self._fence_lock:
                    held = sorted(self.group_fences.items())
                for g, index in held:
                    fenced.group_fences.add(group=g, applied_index=index)  # type: ignore[attr-defined]
            request = fenced
        wire = request.SerializeToString()
        if routing_group:
            # Written first, where the queue server reads it without parsing.
            hint = BY_NAME[method].group_hint_field
            if not hint:
                raise ValueError(f"a {method} request has no routing hint")
            wire = with_leading_varint(wire, hint, routing_group)
        raw = self._call(method, wire, timeout)
        resp: Any = (response or BY_NAME[method].response).FromString(raw)
        if "applied_index" in resp.DESCRIPTOR.fields_by_name:
            self.raise_fence(resp.applied_index)
        if "group_fences" in resp.DESCRIPTOR.fields_by_name:
            for f in resp.group_fences:
                self.raise_group_fence(f.group, f.applied_index)
        return resp

    def raise_fence(self, index: int) -> None:
        """Reads on this connection reflect everything up to ``index`` from now on."""
        with self._fence_lock:
            if index > self.fence:
                self.fence = index

    def raise_group_fence(self, group: int, index: int) -> None:
        """Reads of partitions in data group ``group`` reflect everything up
        to ``index`` of that group from now on."""
        with self._fence_lock:
            if index > self.group_fences.get(group, 0):
                self.group_fences[group] = index

    def _method(self, method: str) -> grpc.UnaryUnaryMultiCallable[bytes, bytes]:
        calls = self._calls[self._current]
        fn = calls.get(method)
        if fn is None:
            fn = calls[method] = self.channels[self._current].unary_unary(f"/{SERVICE}/{method}")
        return fn

    def _call(self, method: str, request: bytes, timeout: float | None) -> bytes:
        deadline = time.monotonic() + (timeout if timeout is not None else self.timeout)
        delay = 0.02
        last: grpc.RpcError | None = None
        reason = ""  # the most telling reason a server gave
        while True:
            left = deadline - time.monotonic()
            if left <= 0.05 or (last is not None and left <= 0.25):
                break
            try:
                return self._method(method)(request, timeout=left, metadata=self.metadata)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    home = home_in_metadata(e.trailing_metadata())
                    if home is not None:
                        raise _Redirected(home, e.details() or "") from None
                if from_grpc(e.code()) not in RETRYABLE or _final(e):
                    raise _rpc_error(e) from None
                last = e
                if e.details() and e.details() != "Deadline Exceeded":
                    reason = e.details() or ""
                self._current = (self._current + 1) % len(self.channels)
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 1.0)
        if last is not None:
            why = reason or last.details() or "no answer"
            raise error(Code.UNAVAILABLE, why) from None
        raise error(Code.UNAVAILABLE, "no time left")


class Admin:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def create_topic(
        self,
        name: str,
        region_geojson: str,
        partitions: int = 0,
        retention_ms: int = 0,
        h3_resolution: int = 0,
        contribution_window_ms: int = 0,
        no_open_produce: bool = False,
        contribution_min_pings: int | None = None,
        contribution_min_seconds: int | None = None,
    ) -> topics_pb2.TopicDescription:
        """A new topic; ``contribution_min_*`` None: the cluster's defaults
        (20 pings over 60 s, ``roadlog.contribution``)."""
        spec = topics_pb2.TopicSpec(
            name=name,
            region_geojson=region_geojson,
            partitions=partitions,
            retention_ms=retention_ms,
            h3_resolution=h3_resolution,
            contribution_window_ms=contribution_window_ms,
            no_open_produce=no_open_produce,
            contribution_min_pings=contribution_min_pings,
            contribution_min_seconds=contribution_min_seconds,
        )
        return self.conn.call("CreateTopic", client_pb2.CreateTopicRequest(spec=spec))  # type: ignore[no-any-return]

    def update_topic(
        self,
        name: str,
        no_open_produce: bool | None = None,
        contribution_min_pings: int | None = None,
        contribution_min_seconds: int | None = None,
    ) -> topics_pb2.TopicDescription:
        """Change a topic's access fields; those left None are kept."""
        req = client_pb2.UpdateTopicRequest(
            name=name,
            no_open_produce=no_open_produce,
            contribution_min_pings=contribution_min_pings,
            contribution_min_seconds=contribution_min_seconds,
        )
        return self.conn.call("UpdateTopic", req)  # type: ignore[no-any-return]

    def settings(self, key: str = "") -> list[settings_pb2.ClusterSetting]:
        """The cluster's settings (every known one, or ``key``'s)."""
        req = settings_pb2.GetSettingsRequest(key=key)
        return list(self.conn.call("GetSettings", req).settings)

    def set_setting(self, key: str, value: str) -> settings_pb2.ClusterSetting:
        """Set a cluster setting; the answer holds its value as stored."""
        req = settings_pb2.SetSettingRequest(key=key, value=value)
        return self.conn.call("SetSetting", req).setting  # type: ignore[no-any-return]

    def describe(self, name: str) -> topics_pb2.TopicDescription:
        return self.conn.call("DescribeTopic", client_pb2.DescribeTopicRequest(name=name))  # type: ignore[no-any-return]

    def list_topics(self) -> list[topics_pb2.TopicDescription]:
        """Every topic, in name order (asked for a page at a time)."""
        out: list[topics_pb2.TopicDescription] = []
        token = ""
        while True:
            page = self.conn.call("ListTopics", client_pb2.ListTopicsRequest(page_token=token))
            out.extend(page.topics)
            token = page.next_page_token
            if not token:
                return out

    def delete_topic(self, name: str) -> bool:
        return bool(self.conn.call("DeleteTopic", client_pb2.DeleteTopicRequest(name=name)).deleted)

    def status(self) -> client_pb2.ClusterStatus:
        return self.conn.call("Status", client_pb2.StatusRequest(), timeout=5)  # type: ignore[no-any-return]

    def list_groups(self) -> list[groups_pb2.GroupDescription]:
        return list(self.conn.call("ListGroups", client_pb2.ListGroupsRequest()).groups)

    def delete_group(self, name: str) -> int:
        """Delete a group no member is in; returns the index that deleted it."""
        resp = self.conn.call("DeleteGroup", client_pb2.DeleteGroupRequest(group=name))
        return int(resp.applied_index)

    def describe_group(self, name: str, min_applied_index: int = 0) -> groups_pb2.GroupDescription:
        req = client_pb2.DescribeGroupRequest(group=name, min_applied_index=min_applied_index)
        return self.conn.call("DescribeGroup", req)  # type: ignore[no-any-return]

    def heatmap(
        self,
        topic: str,
        client: str | None = None,
        window_start_ms: int = 0,
        min_applied_index: int = 0,
    ) -> client_pb2.GetHeatmapResponse:
        """The latest heat map (or that of one window) for a contributor:
        PermissionDenied unless ``client`` published to the topic lately.
        ``min_applied_index``: read your writes (a ``put_heatmap``'s index);
        without it, any node's current state, which may not hold a map
        stored a moment ago."""
        req = client_pb2.GetHeatmapRequest(
            topic=topic,
            client_id=client or client_id(),
            window_start_ms=window_start_ms,
            min_applied_index=min_applied_index,
        )
        return self.conn.call("GetHeatmap", req)  # type: ignore[no-any-return]

    def put_heatmap(self, heatmap: heatmaps_pb2.HeatMap) -> int:
        """Store a heat map (the Spark job does this); the applied index."""
        resp = self.conn.call("PutHeatmap", client_pb2.PutHeatmapRequest(heatmap=heatmap))
        return int(resp.applied_index)

    # Client identities (the scope admin; register_client: anyone, where open).

    def create_client(self, name: str, scopes: Sequence[str]) -> clients_pb2.CreateClientResponse:
        """A new identity: its ``client_id`` and ``token`` (shown once: the
        cluster keeps only its hash)."""
        req = clients_pb2.CreateClientRequest(name=name, scopes=list(scopes))
        return self.conn.call("CreateClient", req)  # type: ignore[no-any-return]

    def list_clients(self) -> clients_pb2.ListClientsResponse:
        return self.conn.call("ListClients", clients_pb2.ListClientsRequest())  # type: ignore[no-any-return]

    def revoke_client(self, name: str) -> int:
        """Revoke an identity: its token stops working (within seconds on
        every queue server). The applied index."""
        resp = self.conn.call("RevokeClient", clients_pb2.RevokeClientRequest(name=name))
        return int(resp.applied_index)

    def register_client(self) -> clients_pb2.CreateClientResponse:
        """A phone's own identity (open self-registration): produce:* and heatmap:*."""
        req = clients_pb2.RegisterClientRequest()
        return self.conn.call("RegisterClient", req)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Ack:
    """Where a batch went, per partition: (partition, base offset, count)."""

    offsets: list[tuple[int, int, int]]
    applied_index: int
    duplicate: bool

    @property
    def count(self) -> int:
        return sum(c for _, _, c in self.offsets)


class Producer:
    """Publishes pings to one topic, in batches, idempotently.

    ``send`` buffers one ping; a batch goes out when it holds ``batch_pings``
    pings or ``batch_bytes`` bytes, ``linger_s`` after its first ping (a
    background thread sees to that even if no other call comes), or on
    ``flush``/``close``. ``send_batch`` sends columns at once. Each batch gets
    the next sequence number; retries of it (after a timeout, an election or a
    queue server failure) are stored once. An error of a background flush is
    raised by the next call: nothing fails silently.

    ``producer_id``: an id this identity was issued before (``producer_id``
    of an earlier Producer, kept across a restart): the producer resumes it
    under its next ``epoch`` instead of taking a new one, and an instance
    still sending under the old epoch is refused from then on (fenced).
    """

    def __init__(
        self,
        conn: Connection,
        topic: str,
        *,
        batch_pings: int = 5000,
        batch_bytes: int = 1 << 20,
        linger_s: float = 0.05,
        deadline_s: float = 30.0,
        idempotent: bool = True,
        client: str | None = None,
        producer_id: int = 0,
    ) -> None:
        self.conn = conn
        self.topic = topic
        self.batch_pings = batch_pings
        self.batch_bytes = batch_bytes
        self.linger_s = linger_s
        self.deadline_s = deadline_s
        self.client_id = client or client_id()
        self.producer_id = 0
        self.epoch = 0
        if idempotent:
            init = client_pb2.InitProducerRequest(client_id=self.client_id, producer_id=producer_id)
            resp = conn.call("InitProducer", init)
            self.producer_id, self.epoch = int(resp.producer_id), int(resp.epoch)
        # The producer id is that cluster's (federation; a stand-in for a
        # Connection may have no cluster: "").
        self._issued_in = getattr(conn, "cluster", "")
        self.sequence = 0
        self.acked = 0
        # The topic's partition -> data group map (multi-raft; [] : none),
        # read at the first batch and again when a group says it changed.
        self._groups: list[int] | None = None
        self._region: Region | None = None
        self._rows: list[tuple[str, int, float, float, float, float, float]] = []
        self._first_at = 0.0
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._lingerer: threading.Thread | None = None
        self._closed = False
        self._error: RoadlogError | None = None

    def send(
        self,
        device_id: str,
        ts_ms: int,
        lat: float,
        lon: float,
        speed_mps: float = math.nan,
        heading_deg: float = math.nan,
        accuracy_m: float = math.nan,
    ) -> Ack | None:
        with self._lock:
            self._raise_pending()
            if not self._rows:
                self._first_at = time.monotonic()
                self._start_lingerer()
            self._rows.append((device_id, ts_ms, lat, lon, speed_mps, heading_deg, accuracy_m))
            if (
                len(self._rows) >= self.batch_pings
                or len(self._rows) * 48 >= self.batch_bytes
                or (time.monotonic() - self._first_at >= self.linger_s)
            ):
                return self.flush()
            self._wake.notify()
            return None

    def flush(self) -> Ack | None:
        with self._lock:
            self._raise_pending()
            if not self._rows:
                return None
            rows, self._rows = self._rows, []
            dev, ts, lat, lon, sp, hd, ac = zip(*rows, strict=True)
            return self.send_batch(PingColumns.from_columns(list(dev), ts, lat, lon, sp, hd, ac))

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _start_lingerer(self) -> None:
        if self._lingerer is None and self.linger_s > 0:
            self._lingerer = threading.Thread(
                target=self._linger, daemon=True, name="roadlog-linger"
            )
            self._lingerer.start()

    def _linger(self) -> None:
        """Flush a batch ``linger_s`` after its first ping."""
        with self._lock:
            while not self._closed:
                if not self._rows:
                    self._wake.wait()
                    continue
                due = self._first_at + self.linger_s - time.monotonic()
                if due > 0:
                    self._wake.wait(due)
                    continue
                try:
                    self.flush()
                except RoadlogError as e:
                    self._error = e
                except Exception as e:  # never lose an error in a background thread
                    self._error = RoadlogError(Code.UNKNOWN, f"{type(e).__name__}: {e}")

    def send_batch(self, cols: PingColumns) -> Ack:
        """Publish columns as one batch; returns once it is stored on a majority."""
        with self._lock:
            return self._send_batch(cols)

    def _send_batch(self, cols: PingColumns) -> Ack:
        self.sequence += 1
        if self._groups is None:
            self._learn_map()
        try:
            ack = self._publish_mapped(cols)
        except FailedPrecondition as e:
            # Followed to a home that does not know this id (a move that
            # could not bring it): a new id there, this batch its first.
            if not (self.producer_id and UNKNOWN_PRODUCER in e.message and self._followed()):
                raise
            self._new_id_here()
            ack = self._publish_mapped(cols)
        # A moved topic's new home imported this id with its sequences
        # (docs/federation.md, "Topic moves"): it is that cluster's now too.
        self._issued_in = getattr(self.conn, "cluster", "")
        self.acked += ack.count
        return ack

    def _followed(self) -> bool:
        return getattr(self.conn, "cluster", "") != self._issued_in

    def _new_id_here(self) -> None:
        init = client_pb2.InitProducerRequest(client_id=self.client_id)
        resp = self.conn.call("InitProducer", init)
        self.producer_id, self.epoch = int(resp.producer_id), int(resp.epoch)
        self._issued_in, self.sequence = getattr(self.conn, "cluster", ""), 1

    def _publish_mapped(self, cols: PingColumns) -> Ack:
        if not self._groups:  # every partition in group 0: one publish
            ack = self._publish(cols, 0)
        else:
            self._check(cols)
            try:
                ack = self._publish_by_group(cols)
            except FailedPrecondition as e:
                if STALE_MAP not in e.message:
                    raise
                # The topic was made again with another map: the same
                # sequence again, so the parts stored already are not.
                self._learn_map()
                ack = self._publish_by_group(cols) if self._groups else self._publish(cols, 0)
        return ack

    def _learn_map(self) -> None:
        """The topic's partition -> data group map, and its region (to check
        a batch whole before its groups' parts go their own ways). A
        describe that followed the topic to its home in a federation
        (``Connection.follow``) asks the home for a producer id: the first
        cluster's means nothing there; this batch is the new id's first."""
        record = Admin(self.conn).describe(self.topic).topic
        self._groups = list(record.partition_groups)
        self._region = parse_region(record.spec.region_geojson) if self._groups else None
        if self.producer_id and self._followed() and self.sequence <= 1:
            self._new_id_here()

    def _check(self, cols: PingColumns) -> None:
        """The cluster's checks of a batch, here: a batch split over data
        groups is refused whole for one bad ping, as one publish is (the
        groups' leaders check their parts again; a ping only they refuse,
        say for a clock far off, refuses its group's part alone)."""
        assert self._region is not None
        try:
            check_size(len(cols))
            raise_if_bad(ping_reasons(cols, self._region, int(time.time() * 1000)))
        except BatchRejected as e:
            raise InvalidArgument(Code.INVALID_ARGUMENT, str(e)) from None

    def _publish_by_group(self, cols: PingColumns) -> Ack:
        """A topic placed in data groups: each group's pings as a publish of
        their own (the same sequence: each group stores its share once),
        straight to that group's leader; acknowledged when every part is."""
        assert self._groups is not None
        groups = ping_groups(cols, self._groups)
        acks = [
            self._publish(cols.take(np.flatnonzero(groups == g)), int(g)) for g in np.unique(groups)
        ]
        return Ack(
            [o for a in acks for o in a.offsets],
            0,
            all(a.duplicate for a in acks),
        )

    def _publish(self, cols: PingColumns, group: int) -> Ack:
        req = client_pb2.PublishRequestView(  # the encoded batch as it is: no re-parse
            topic=self.topic,
            client_id=self.client_id,
            producer_id=self.producer_id,
            sequence=self.sequence,
            batch=columnar.encode(cols),
            producer_epoch=self.epoch,
        )
        resp = self.conn.call("Publish", req, timeout=self.deadline_s, routing_group=group)
        return Ack(
            [(o.partition, o.base_offset, o.count) for o in resp.offsets],
            resp.applied_index,
            resp.duplicate,
        )

    def close(self) -> None:
        """Send what is buffered and stop the background flusher."""
        try:
            self.flush()
        finally:
            with self._lock:
                self._closed = True
                self._wake.notify_all()
            if self._lingerer is not None:
                self._lingerer.join(timeout=5)


@dataclass(frozen=True)
class Fetched:
    partition: int
    base_offset: int
    append_ms: int
    pings: PingColumns


class Consumer:
    """Reads one topic by partition and offset."""

    def __init__(self, conn: Connection, topic: str) -> None:
        self.conn = conn
        self.topic = topic
        self.positions: dict[int, int] = {}
        self.min_applied_index = 0

    def seek(self, partition: int, offset: int) -> None:
        self.positions[partition] = offset

    def fetch(
        self, partition: int, max_pings: int = 10_000
    ) -> tuple[list[Fetched], client_pb2.FetchResponseView]:
        offset = self.positions.get(partition, 0)
        req = client_pb2.FetchRequest(
            topic=self.topic,
            partition=partition,
            offset=offset,
            max_pings=max_pings,
            min_applied_index=self.min_applied_index,
        )
        resp = self.conn.call("Fetch", req, response=client_pb2.FetchResponseView)
        out = [
            Fetched(partition, b.base_offset, b.append_ms, columnar.decode(b.batch))
            for b in resp.batches
        ]
        self.positions[partition] = resp.next_offset
        return out, resp

    def read_to_end(self, partition: int, limit: int | None = None) -> Iterator[Fetched]:
        """Every batch from the current position to the partition's end as it
        was when each fetch was answered: at least every ping acknowledged
        before this call began (its fetches are fenced on each group's
        commit index at its leader, ``learn_read_fences``), and never an end
        before one this connection was shown."""
        learn_read_fences(self.conn, self.topic)
        got = 0
        while True:
            batches, resp = self.fetch(partition)
            for b in batches:
                if limit is not None and got + len(b.pings) > limit:
                    keep = limit - got
                    if keep > 0:
                        yield Fetched(
                            b.partition, b.base_offset, b.append_ms, b.pings.take(np.arange(keep))
                        )
                    self.positions[partition] = b.base_offset + keep
                    return
                got += len(b.pings)
                yield b
            if not batches or resp.next_offset >= resp.end_offset:
                return


def learn_read_fences(conn: Connection, topic: str) -> None:
    """Fence ``conn``'s reads of ``topic`` on each of its groups' commit
    index at that group's leader (``ReadFences``, a ReadIndex each): a
    replica still catching up does not answer them until it has applied
    that far, so they see every ping acknowledged before this call. A queue
    server from before ReadFences (UNIMPLEMENTED): the reads are fenced only
    by what the connection wrote and was served, as they were."""
    try:
        conn.call("ReadFences", client_pb2.ReadFencesRequest(topic=topic))
    except RoadlogError as e:
        if e.code != Code.UNIMPLEMENTED:
            raise


class GroupConsumer:
    """A member of a consumer group: reads the partitions the cluster assigns
    to it, from the group's committed offsets on (at least once).

    A background thread heartbeats; when the group's generation moves on
    (members came or went) the next ``poll`` starts the partitions this
    member gained at their committed offsets. Rebalancing is cooperative: a
    partition that moves away is first marked revoking; ``poll`` stops
    reading it, and the next ``commit`` (or ``poll``) stores its position
    and releases it in one step, so its new owner starts exactly there and
    nothing is read twice. ``commit`` stores the positions reached by the
    pings ``poll`` returned; commits of a stale generation are refused by
    the cluster, so a member that was expired can never overwrite the
    offsets of the partition's new owner.
    """

    def __init__(
        self,
        conn: Connection,
        topic: str,
        group: str,
        *,
        client: str | None = None,
        session_timeout_ms: int = 10_000,
    ) -> None:
        self.conn = conn
        self.topic = topic
        self.group = group
        self.client = client or client_id()
        self.session_timeout_ms = session_timeout_ms
        self.member_id = ""
        self.generation = 0
        self.assigned: list[int] = []  # owned and read (the revoking ones left out)
        self.revoking: list[int] = []  # owned, moving away: commit and release them
        self.positions: dict[int, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._fence = 0
        self._next = 0
        self._heartbeats: threading.Thread | None = None
        self.error: Exception | None = None

    def join(self) -> None:
        req = client_pb2.JoinGroupRequest(
            group=self.group,
            topic=self.topic,
            member_id=self.member_id,
            client_id=self.client,
            session_timeout_ms=self.session_timeout_ms,
        )
        resp = self.conn.call("JoinGroup", req)
        with self._lock:
            self.member_id = resp.member_id
            self._fence = max(self._fence, resp.applied_index)
            self._assign(resp.generation, list(resp.partitions), list(resp.revoking))
        if self._heartbeats is None:
            interval = max(resp.heartbeat_interval_ms / 1000, 0.1)
            self._heartbeats = threading.Thread(
                target=self._beat, args=(interval,), name="heartbeat", daemon=True
            )
            self._heartbeats.start()

    def _assign(self, generation: int, partitions: list[int], revoking: list[int]) -> None:
        """Take the assignment of ``generation`` (with the lock held): read
        the owned partitions that are not revoking; keep the positions of
        every owned one (the revoking ones' are committed on release)."""
        owned = set(partitions)
        self.generation = generation
        self.revoking = sorted(owned & set(revoking))
        self.assigned = sorted(owned - set(revoking))
        self.positions = {p: o for p, o in self.positions.items() if p in owned}

    def _beat(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                resp = self.conn.call(
                    "Heartbeat",
                    client_pb2.HeartbeatRequest(
                        group=self.group, member_id=self.member_id, generation=self.generation
                    ),
                    timeout=max(interval, 1.0),
                )
                with self._lock:
                    # The offsets a gained partition starts from were stored
                    # at or before this index: read them there, not earlier.
                    self._fence = max(self._fence, resp.applied_index)
                    self._assign(resp.generation, list(resp.partitions), list(resp.revoking))
            except FailedPrecondition:  # expired: come back as the same member
                try:
                    self.join()
                except RoadlogError as e:
                    self.error = e
            except RoadlogError as e:
                self.error = e  # transient; the next beat tries again

    def _start_positions(self, partitions: list[int]) -> None:
        """Where the partitions this member gained start: their committed
        offsets; its reads of them from then on see every ping acknowledged
        before (``learn_read_fences``)."""
        learn_read_fences(self.conn, self.topic)
        d = Admin(self.conn).describe_group(self.group, min_applied_index=self._fence)
        committed = {o.partition: o.offset for o in d.offsets}
        with self._lock:
            for p in partitions:
                if p in self.assigned and p not in self.positions:
                    self.positions[p] = committed.get(p, 0)

    def poll(self, max_pings: int = 10_000) -> list[Fetched]:
        """The next batches of one assigned partition (round robin), or []
        when every assigned partition is read to its end."""
        if not self.member_id:
            self.join()
        if self.revoking:  # what earlier polls returned from them is done with
            self.commit()
        with self._lock:
            assigned = list(self.assigned)
            missing = [p for p in assigned if p not in self.positions]
        if missing:
            self._start_positions(missing)
        for _ in range(len(assigned)):
            p = assigned[self._next % len(assigned)]
            self._next += 1
            with self._lock:
                if p not in self.positions:
                    continue  # lost meanwhile
                offset = self.positions[p]
            req = client_pb2.FetchRequest(
                topic=self.topic, partition=p, offset=offset, max_pings=max_pings
            )
            resp = self.conn.call("Fetch", req, response=client_pb2.FetchResponseView)
            if not resp.batches:
                continue
            out = [
                Fetched(p, b.base_offset, b.append_ms, columnar.decode(b.batch))
                for b in resp.batches
            ]
            with self._lock:
                if p in self.positions:
                    self.positions[p] = resp.next_offset
            return out
        return []

    def commit(self) -> bool:
        """Store the positions reached, and release the revoking partitions
        in the same step; False if the generation moved on (the positions of
        partitions still owned are committed next time)."""
        with self._lock:
            gen = self.generation
            offsets = [
                groups_pb2.CommittedOffset(partition=p, offset=o) for p, o in self.positions.items()
            ]
            release = list(self.revoking)
        if (not offsets and not release) or not self.member_id:
            return True
        req = client_pb2.CommitOffsetsRequest(
            group=self.group,
            member_id=self.member_id,
            generation=gen,
            offsets=offsets,
            release=release,
        )
        try:
            resp = self.conn.call("CommitOffsets", req)
        except FailedPrecondition:
            return False
        with self._lock:
            self._fence = max(self._fence, resp.applied_index)
        if release:
            with self._lock:
                if self.generation == gen:  # else a newer assignment says what is ours
                    self.revoking = [p for p in self.revoking if p not in release]
                    for p in release:
                        self.positions.pop(p, None)
        return True

    def close(self, commit: bool = True) -> None:
        """Commit, leave the group (its partitions move at once), stop."""
        self._stop.set()
        try:
            if commit:
                self.commit()
            if self.member_id:
                self.conn.call(
                    "LeaveGroup",
                    client_pb2.LeaveGroupRequest(group=self.group, member_id=self.member_id),
                )
        finally:
            if self._heartbeats is not None:
                self._heartbeats.join(timeout=5)
