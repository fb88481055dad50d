"""Workloads: idempotent producers over gRPC, producers over HTTP (through
both queue servers), consumers in a group committing offsets, an observer
of the group's offsets, fenced and unfenced readers, and topic churn.
Every operation is recorded (``history``) as the client saw it.

A ping is named by (producer, n): its device is ``<producer>~<n % D>``
and its timestamp ``T0 + n`` (ms), so any read maps back to who sent it.

Invariants: every loop ends when the run's stop event is set or its
deadline passes, and each blocking call has a deadline of its own; a
publish whose outcome is unknown is never sent again (so its pings may be
stored at most once); a producer sends one publish at a time, so its
pings' order is its publishes' order.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from roadlog import columnar
from roadlog.client import (
    Ack,
    Admin,
    Connection,
    GroupConsumer,
    Producer,
    RoadlogError,
    learn_read_fences,
)
from roadlog.client_tls import ClientTLS
from roadlog.columnar import PingColumns
from roadlog.errors import Code
from roadlog.geo import bbox_region
from roadlog.scopes import ADMIN, ANY_TOPIC, HEATMAP, PRODUCE, READ
from roadlog.v1 import client_pb2, heatmaps_pb2
from tests.nemesis.history import Recorder

log = logging.getLogger("nemesis.workload")

REGION = bbox_region(11.4, 48.05, 11.75, 48.25).geojson
MAIN_TOPIC, GROUP = "main", "g1"
# Give-to-get's minimum contribution on the main topic (issue 39): small, so
# that producers qualify a few seconds into the run, and more than one ping.
MIN_PINGS, MIN_SECONDS = 3, 2
# The identities a run with tokens issues (``identities``): each producer its
# own (give-to-get is per identity), a stranger that never publishes, topic
# churn, and INFRA for the rest (readers, consumers, observers, setup).
INFRA, STRANGER, CHURN = "nemesis", "stranger", "churn"
PARTITIONS = 4
DEVICES = 8
# Outcomes a client may take as certain: the request was refused before
# anything was stored (bad input). Everything else may have happened.
DEFINITE = {Code.INVALID_ARGUMENT, Code.PERMISSION_DENIED}
READ_DEFINITE = {Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.FAILED_PRECONDITION}


@dataclass
class Ctx:
    """What every worker shares."""

    rec: Recorder
    servers: list[str]  # queue servers' gRPC addresses
    https: list[str]  # their HTTP base URLs
    seed: int
    deadline: float  # monotonic
    t0_ms: int = field(default_factory=lambda: int(time.time() * 1000) - 3_600_000)
    stop: threading.Event = field(default_factory=threading.Event)
    # (topic, partition, base, count, index, group) of recent acknowledgements:
    # the index is the one of the group that stored the partition's part.
    acks: deque[tuple[str, int, int, int, int, int]] = field(
        default_factory=lambda: deque(maxlen=64)
    )
    fence: int = 0  # the highest group 0 index any answer carried
    group_fences: dict[int, int] = field(default_factory=dict)  # the same per data group
    # topic -> each partition's Raft group (all 0: the topic is in group 0);
    # fixed when the topic is made, so learnt once.
    placement: dict[str, list[int]] = field(default_factory=dict)
    # The clients' TLS (the CA; insecure in a plaintext run) and the issued
    # identities' tokens by name (none in a plaintext run: no check at all).
    tls: ClientTLS = field(default_factory=lambda: ClientTLS(insecure=True))
    tokens: dict[str, str] = field(default_factory=dict)
    # Pings in a gRPC publish: 1..max_batch (HTTP: half as many). Long runs
    # may send fewer: the state grows slower, and the wiped and damaged
    # nodes that the quiet kinds of fault wait for catch up sooner.
    max_batch: int = 200
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def going(self) -> bool:
        return not self.stop.is_set() and time.monotonic() < self.deadline

    def tls_for(self, identity: str) -> ClientTLS:
        """How ``identity`` dials the queue servers: with its own token (an
        identity not issued one: the workload's own, INFRA's)."""
        return self.tls.with_token(self.tokens.get(identity) or self.tokens.get(INFRA))

    def rng(self, name: str) -> random.Random:
        return random.Random(f"{self.seed}:{name}")

    def saw(self, index: int, fences: dict[int, int] | None = None) -> None:
        """An answer carried ``index`` (group 0's) and ``fences`` (per data group)."""
        with self._lock:
            self.fence = max(self.fence, index)
            for g, i in (fences or {}).items():
                if i > self.group_fences.get(g, 0):
                    self.group_fences[g] = i

    def fences(self) -> dict[int, int]:
        """Every group's highest index seen, group 0's under 0."""
        with self._lock:
            return {0: self.fence, **self.group_fences}

    def groups_of(self, conn: Connection, topic: str) -> list[int]:
        """``topic``'s partitions' groups, asked once (raises RoadlogError)."""
        with self._lock:
            known = self.placement.get(topic)
        if known is None:
            record = Admin(conn).describe(topic).topic
            known = list(record.partition_groups) or [0] * record.spec.partitions
            with self._lock:
                self.placement[topic] = known
        return known

    def group_of(self, topic: str, p: int) -> int:
        """The group of ``topic``'s partition ``p`` (0 when not learnt yet)."""
        with self._lock:
            known = self.placement.get(topic) or []
        return known[p] if p < len(known) else 0

    def acknowledged(
        self, topic: str, offsets: list[list[int]], applied: int, fences: dict[int, int]
    ) -> dict[str, int]:
        """Take note of a publish's acknowledgement: each partition's index
        (in the group that stored its part: ``applied`` for group 0),
        returned as the ``part_index`` the history records. The topic's
        placement is known (``groups_of``): a part's index is never guessed."""
        assert topic in self.placement, f"{topic}'s placement was not learnt"
        self.saw(applied, fences)
        out: dict[str, int] = {}
        for p, base, count in offsets:
            g = self.group_of(topic, p)
            index = applied if g == 0 else fences.get(g, 0)
            out[str(p)] = index
            self.acks.append((topic, p, base, count, index, g))
        return out

    def pings(self, producer: str, n0: int, n1: int) -> PingColumns:
        n = np.arange(n0, n1)
        return PingColumns.from_columns(
            [f"{producer}~{k % DEVICES}" for k in range(n0, n1)],
            self.t0_ms + n,
            (48.1 + (n % 100) * 1e-4).astype(np.float64),
            (11.5 + (n % 100) * 1e-4).astype(np.float64),
            speed_mps=np.full(len(n), 10.0, dtype=np.float32),
        )

    def rows(self, cols: PingColumns) -> list[list[Any]]:
        """[producer, n] per ping (a device of no producer of ours: [device, ts])."""
        out: list[list[Any]] = []
        for dev, ts in zip(cols.device_of().tolist(), cols.ts_ms.tolist(), strict=True):
            prod, sep, _ = str(dev).partition("~")
            out.append([prod, int(ts) - self.t0_ms] if sep else [str(dev), int(ts)])
        return out


def _code(e: BaseException) -> Code:
    return e.code if isinstance(e, RoadlogError) else Code.UNKNOWN


def _why(e: BaseException) -> str:
    return (e.message if isinstance(e, RoadlogError) else f"{type(e).__name__}: {e}")[:200]


class RecordingConnection(Connection):
    """A Connection that records the reads, commits, group descriptions and
    topic changes made through it, as the client saw them."""

    FS = {
        "Fetch": "read",
        "CommitOffsets": "commit",
        "DescribeGroup": "describe_group",
        "CreateTopic": "create_topic",
        "DeleteTopic": "delete_topic",
        "PutHeatmap": "put_heatmap",
    }

    def __init__(
        self,
        ctx: Ctx,
        proc: str,
        servers: list[str],
        timeout: float = 10.0,
        identity: str = INFRA,
    ) -> None:
        super().__init__(servers, timeout=timeout, client=proc, tls=ctx.tls_for(identity))
        self.ctx = ctx
        self.proc = proc
        self.published: list[Any] = []  # Publish answers since last cleared

    def call(
        self,
        method: str,
        request: Any,
        timeout: float | None = None,
        response: Any = None,
        routing_group: int = 0,
    ) -> Any:
        f = self.FS.get(method)
        if f is None:
            resp = super().call(method, request, timeout, response, routing_group)
            if method == "Publish":  # the parts of one send_batch, gathered by its producer
                self.published.append(resp)
            return resp
        fields = self._invoke_fields(method, request)
        op = self.ctx.rec.invoke(self.proc, f, **fields)
        try:
            resp = super().call(method, request, timeout, response, routing_group)
        except Exception as e:
            code = _code(e)
            # A write the connection sent again (after an unknown outcome) may
            # be refused for what its own first attempt did (ALREADY_EXISTS,
            # NOT_FOUND, a stale generation): only bad input is certain.
            writes = ("create_topic", "delete_topic", "commit", "put_heatmap")
            definite = code in (DEFINITE if f in writes else READ_DEFINITE)
            self.ctx.rec.complete(
                self.proc, op, "fail" if definite else "info", f, code=code.name, reason=_why(e)
            )
            raise
        self.ctx.rec.complete(self.proc, op, "ok", f, **self._done_fields(method, resp))
        index = getattr(resp, "applied_index", 0) if method != "Fetch" else 0
        if index:
            self.ctx.saw(index)
        return resp

    def _invoke_fields(self, method: str, req: Any) -> dict[str, Any]:
        if method == "Fetch":
            # The fence of the partition's group the read is served at: its
            # own, or (none set) the one the connection adds (Connection.call).
            group = self.ctx.group_of(req.topic, req.partition)
            if group == 0:
                fence = req.min_applied_index or self.fence
            else:
                own = {x.group: x.applied_index for x in req.group_fences}
                with self._fence_lock:
                    held = dict(self.group_fences)
                fence = own.get(group, 0) if own else held.get(group, 0)
            return {
                "api": "grpc",
                "topic": req.topic,
                "partition": req.partition,
                "offset": req.offset,
                "group": group,
                "fence": fence,
            }
        if method == "CommitOffsets":
            return {
                "group": req.group,
                "topic": MAIN_TOPIC,
                "member": req.member_id,
                "generation": req.generation,
                "offsets": {str(o.partition): o.offset for o in req.offsets},
                "release": list(req.release),
            }
        if method == "DescribeGroup":
            return {"group": req.group, "topic": MAIN_TOPIC, "fence": req.min_applied_index}
        if method == "CreateTopic":
            return {"api": "grpc", "topic": req.spec.name, "partitions": req.spec.partitions}
        if method == "PutHeatmap":
            return {"api": "grpc", "topic": req.heatmap.topic}
        return {"api": "grpc", "topic": req.name}

    def _done_fields(self, method: str, resp: Any) -> dict[str, Any]:
        if method == "Fetch":
            return {
                "first_offset": resp.first_offset,
                "end_offset": resp.end_offset,
                "served_by": resp.served_by,
                "batches": [
                    [b.base_offset, self.ctx.rows(columnar.decode(b.batch))] for b in resp.batches
                ],
            }
        if method == "DescribeGroup":
            return {
                "generation": resp.group.generation,
                "offsets": {str(o.partition): o.offset for o in resp.offsets},
            }
        if method == "DeleteTopic":
            return {"deleted": bool(resp.deleted), "applied_index": resp.applied_index}
        return {"applied_index": getattr(resp, "applied_index", 0)}


# ------------------------------------------------------------------ workers


class Worker:
    """A thread that runs ``body`` until the run stops; errors are logged,
    never lost, and never end the run."""

    def __init__(self, ctx: Ctx, name: str) -> None:
        self.ctx = ctx
        self.name = name
        self.rng = ctx.rng(name)
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.errors = 0

    def start(self) -> Worker:
        self.thread.start()
        return self

    def _main(self) -> None:
        try:
            self.body()
        except Exception:
            self.errors += 1
            log.exception("worker failed", extra={"worker": self.name})

    def body(self) -> None:
        raise NotImplementedError

    def pause(self, lo: float, hi: float) -> None:
        """Pace the load (ends early when the run stops)."""
        self.ctx.stop.wait(self.rng.uniform(lo, hi))


def _retry(ctx: Ctx, fn: Callable[[], Any], tries: int = 20) -> Any:
    """``fn()`` until it returns (None once the run stops or tries run out)."""
    for _ in range(tries):
        if not ctx.going():
            return None
        try:
            return fn()
        except RoadlogError as e:
            log.info("retrying", extra={"why": _why(e)})
            ctx.stop.wait(0.5)
    return None


class GrpcProducer(Worker):
    """An idempotent Producer; batches of 1..max_batch pings, one at a time."""

    def __init__(self, ctx: Ctx, name: str, topic: str, servers: list[str]) -> None:
        super().__init__(ctx, name)
        self.topic = topic
        self.servers = servers
        self.n = 0
        self.limit: int | None = None  # publishes, for one-shot producers
        # "client": the SDK's Producer splits a batch by group (a part per
        # group, each to its leader); "server": the batch goes whole and the
        # queue server splits it.
        self.split = "client"
        self.identity = name  # whose token it publishes with

    def body(self) -> None:
        conn = RecordingConnection(self.ctx, self.name, self.servers, identity=self.identity)
        producer = _retry(
            self.ctx,
            lambda: Producer(conn, self.topic, client=self.name, deadline_s=8.0, linger_s=0),
        )
        if producer is None:
            return
        sent = 0
        while self.ctx.going() and (self.limit is None or sent < self.limit):
            self.publish(producer, self.rng.randint(1, self.ctx.max_batch))
            sent += 1
            self.pause(0.0, 0.05)

    def publish(self, producer: Producer, size: int) -> None:
        rec, n0, n1 = self.ctx.rec, self.n, self.n + size
        self.n = n1  # never sent again, whatever happens
        cols = self.ctx.pings(self.name, n0, n1)
        conn = producer.conn
        assert isinstance(conn, RecordingConnection)
        op = rec.invoke(self.name, "publish", topic=self.topic, producer=self.name, api="grpc",
                        split=self.split, n0=n0, n1=n1)  # fmt: skip
        try:
            self.ctx.groups_of(conn, self.topic)
            conn.published.clear()
            if self.split == "server":
                ack = self.send_whole(producer, cols)
            else:
                ack = producer.send_batch(cols)
        except Exception as e:
            code = _code(e)
            rec.complete(self.name, op, "fail" if code in DEFINITE else "info", "publish",
                         code=code.name, reason=_why(e))  # fmt: skip
            return
        # One answer per group a client-side split sent a part to (each of
        # one group), or one for the whole (the queue server's split).
        applied, fences = 0, dict[int, int]()
        for resp in conn.published:
            applied = max(applied, resp.applied_index)
            for x in resp.group_fences:
                fences[x.group] = max(fences.get(x.group, 0), x.applied_index)
        offsets = [list(o) for o in ack.offsets]
        part_index = self.ctx.acknowledged(self.topic, offsets, applied, fences)
        rec.complete(self.name, op, "ok", "publish", offsets=offsets, applied_index=applied,
                     fences={str(g): i for g, i in sorted(fences.items())},
                     part_index=part_index, duplicate=ack.duplicate)  # fmt: skip

    def send_whole(self, producer: Producer, cols: PingColumns) -> Ack:
        """The batch as one publish, whatever partitions and groups its
        devices fall in: the queue server splits it (a gateway's or
        ``roadlog produce``'s publish), with the producer's id and next
        sequence, so its retries are stored once in every group."""
        producer.sequence += 1
        req = client_pb2.PublishRequestView(
            topic=self.topic, client_id=producer.client_id, producer_id=producer.producer_id,
            sequence=producer.sequence, batch=columnar.encode(cols),
            producer_epoch=producer.epoch,
        )  # fmt: skip
        resp = producer.conn.call("Publish", req, timeout=producer.deadline_s)
        return Ack(
            [(o.partition, o.base_offset, o.count) for o in resp.offsets],
            resp.applied_index,
            resp.duplicate,
        )


def _http(
    tls: ClientTLS, method: str, url: str, body: Any = None, timeout: float = 10.0
) -> tuple[int, Any]:
    """(status, JSON answer); status 0 when no answer came (raises nothing).
    ``tls``: the CA to trust (https) and the identity's token."""
    data = json.dumps(body).encode() if body is not None else None
    # The server's deadline is 80% of the client's: it answers 504 before
    # the client stops waiting. Both forms: the wall-clock one also counts a
    # wait before the server reads the request (finding 17).
    headers = {
        "Content-Type": "application/json",
        "X-Timeout-Ms": str(int(timeout * 800)),
        "X-Deadline-Unix-Ms": str(int((time.time() + timeout * 0.8) * 1000)),
        **tls.headers(),
    }
    req = urllib.request.Request(url, data, headers, method=method)
    context = None if tls.insecure else tls.ssl_context()
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, {}
    except (OSError, ValueError) as e:
        refused = isinstance(getattr(e, "reason", e), ConnectionRefusedError)
        return (-1 if refused else 0), {"error": {"reason": f"{type(e).__name__}: {e}"}}


def _http_outcome(status: int) -> str:
    """ok, fail (certainly not done: refused connection or a client error
    before anything was stored) or info (a 5xx or no answer)."""
    if 200 <= status < 300:
        return "ok"
    if status == -1 or status in (400, 403, 404, 409, 413, 422):
        return "fail"
    return "info"


class HttpProducer(Worker):
    """Publishes over HTTP (not idempotent: never retried), alternating
    between the queue servers."""

    def __init__(self, ctx: Ctx, name: str, topic: str) -> None:
        super().__init__(ctx, name)
        self.topic = topic
        self.n = 0

    def body(self) -> None:
        rec = self.ctx.rec
        while self.ctx.going():
            size = self.rng.randint(1, max(1, self.ctx.max_batch // 2))
            n0, n1 = self.n, self.n + size
            self.n = n1
            base = self.rng.choice(self.ctx.https)
            cols = self.ctx.pings(self.name, n0, n1)
            pings = [
                {"device_id": d, "ts_ms": t, "lat": la, "lon": lo, "speed_mps": 10.0}
                for d, t, la, lo in zip(
                    cols.device_of().tolist(), cols.ts_ms.tolist(), cols.lat.tolist(),
                    cols.lon.tolist(), strict=True,
                )
            ]  # fmt: skip
            op = rec.invoke(self.name, "publish", topic=self.topic, producer=self.name,
                            api="http", via=base, n0=n0, n1=n1)  # fmt: skip
            status, body = _http(
                self.ctx.tls_for(self.name), "POST", f"{base}/v1/topics/{self.topic}/pings",
                {"client_id": self.name, "pings": pings},
            )  # fmt: skip
            outcome = _http_outcome(status)
            if outcome == "ok":
                offsets = [[o["partition"], o["base_offset"], o["count"]] for o in body["offsets"]]
                applied = int(body["applied_index"])
                fences = {int(g): int(i) for g, i in body.get("group_fences", {}).items()}
                part_index = self.ctx.acknowledged(self.topic, offsets, applied, fences)
                rec.complete(self.name, op, "ok", "publish", offsets=offsets,
                             applied_index=applied, part_index=part_index,
                             fences={str(g): i for g, i in sorted(fences.items())})  # fmt: skip
            else:
                err = body.get("error", {}) if isinstance(body, dict) else {}
                rec.complete(self.name, op, outcome, "publish", code=f"HTTP {status}",
                             reason=str(err.get("reason", ""))[:200])  # fmt: skip
            self.pause(0.0, 0.1)


class Reader(Worker):
    """Reads recently acknowledged batches back: fenced at their index in
    the group that stored them (gRPC ``min_applied_index`` or
    ``group_fences``, HTTP the same as query parameters), or unfenced (any
    node, maybe behind); and now and then reads a partition to its end on
    a new connection (``read_end``: the fences learnt by ``ReadFences``)."""

    def body(self) -> None:
        conns = [
            RecordingConnection(self.ctx, self.name, s)
            for s in (self.ctx.servers, self.ctx.servers[::-1])
        ]
        while self.ctx.going():
            self.pause(0.05, 0.3)
            if not self.ctx.acks:
                continue
            topic, p, base, count, index, group = self.ctx.acks[-1]
            if self.rng.random() < 0.15:
                self.read_end(topic, p, base)
                continue
            fence = index if self.rng.random() < 0.8 else 0
            if self.rng.random() < 0.5:
                conn = self.rng.choice(conns)
                req = client_pb2.FetchRequest(
                    topic=topic, partition=p, offset=base, max_pings=max(count, 1),
                    min_applied_index=fence if group == 0 else 0,
                )  # fmt: skip
                if group and fence:
                    req.group_fences.add(group=group, applied_index=fence)
                # Recorded; Fetch answers carry no index, so the fence stays the read's own.
                with contextlib.suppress(RoadlogError):
                    conn.call("Fetch", req, response=client_pb2.FetchResponseView)
            else:
                self.http_read(topic, p, base, count, fence, group)

    def read_end(self, topic: str, p: int, offset: int) -> None:
        """Where partition ``p`` ends, read as a reader that starts now
        (``Consumer.read_to_end``'s way: ``ReadFences``, then a fetch fenced
        on them), on a connection of its own that holds no fence yet: the
        end must cover every publish acknowledged before this began."""
        rec = self.ctx.rec
        servers = self.ctx.servers if self.rng.random() < 0.5 else self.ctx.servers[::-1]
        op = rec.invoke(self.name, "read_end", topic=topic, partition=p, offset=offset)
        conn = RecordingConnection(self.ctx, self.name, servers)
        try:
            learn_read_fences(conn, topic)
            fences = dict(conn.group_fences)
            req = client_pb2.FetchRequest(topic=topic, partition=p, offset=offset, max_pings=1)
            resp = conn.call("Fetch", req, response=client_pb2.FetchResponseView)
        except RoadlogError as e:
            definite = e.code in READ_DEFINITE
            rec.complete(self.name, op, "fail" if definite else "info", "read_end",
                         code=e.code.name, reason=_why(e))  # fmt: skip
            return
        finally:
            conn.close()
        rec.complete(self.name, op, "ok", "read_end", end_offset=resp.end_offset,
                     fences={str(g): i for g, i in sorted(fences.items())})  # fmt: skip

    def http_read(
        self, topic: str, p: int, offset: int, count: int, fence: int, group: int
    ) -> None:
        rec = self.ctx.rec
        base = self.rng.choice(self.ctx.https)
        op = rec.invoke(self.name, "read", api="http", via=base, topic=topic, partition=p,
                        offset=offset, group=group, fence=fence)  # fmt: skip
        fenced = f"min_applied_index={fence}" if group == 0 else f"group_fences={group}:{fence}"
        url = (
            f"{base}/v1/topics/{topic}/partitions/{p}/pings?offset={offset}"
            f"&limit={max(count, 1)}&{fenced}"
        )
        status, body = _http(self.ctx.tls_for(INFRA), "GET", url)
        outcome = _http_outcome(status)
        if outcome != "ok":
            err = body.get("error", {}) if isinstance(body, dict) else {}
            rec.complete(self.name, op, outcome, "read", code=f"HTTP {status}",
                         reason=str(err.get("reason", ""))[:200])  # fmt: skip
            return
        batches: list[list[Any]] = []
        for ping in body["pings"]:
            prod, sep, _ = str(ping["device_id"]).partition("~")
            row = [prod, int(ping["ts_ms"]) - self.ctx.t0_ms] if sep else [ping["device_id"], 0]
            if batches and batches[-1][0] + len(batches[-1][1]) == ping["offset"]:
                batches[-1][1].append(row)
            else:
                batches.append([ping["offset"], [row]])
        rec.complete(self.name, op, "ok", "read", first_offset=body["first_offset"],
                     end_offset=body["end_offset"], served_by=body.get("served_by", ""),
                     batches=batches)  # fmt: skip


class GroupMembers(Worker):
    """Members of one group come and go (each lives a few seconds, then
    commits and leaves in good order); each polls and commits."""

    def __init__(self, ctx: Ctx, name: str, members: int = 2) -> None:
        super().__init__(ctx, name)
        self.members = members
        self.count = 0

    def body(self) -> None:
        threads: list[threading.Thread] = []
        while self.ctx.going():
            threads = [t for t in threads if t.is_alive()]
            while len(threads) < self.members and self.ctx.going():
                self.count += 1
                t = threading.Thread(
                    target=self.member, args=(f"{self.name}-m{self.count}",), daemon=True
                )
                t.start()
                threads.append(t)
            self.pause(0.2, 0.5)
        for t in threads:
            t.join(timeout=30)

    def member(self, name: str) -> None:
        servers = self.ctx.servers if self.rng.random() < 0.5 else self.ctx.servers[::-1]
        conn = RecordingConnection(self.ctx, name, servers)  # INFRA's identity, every member
        gc = GroupConsumer(conn, MAIN_TOPIC, GROUP, client=name, session_timeout_ms=3000)
        life = time.monotonic() + self.rng.uniform(4, 15)
        try:
            while self.ctx.going() and time.monotonic() < life:
                try:
                    gc.poll(max_pings=500)
                    gc.commit()
                except RoadlogError:
                    self.ctx.stop.wait(0.2)  # recorded; try again
                self.ctx.stop.wait(self.rng.uniform(0.0, 0.2))
        finally:
            try:
                gc.close(commit=True)
            except RoadlogError as e:
                log.info("member left badly", extra={"member": name, "why": _why(e)})
                gc._stop.set()  # no more heartbeats: it expires
            conn.close()


class GroupObserver(Worker):
    """Reads the group's committed offsets, fenced at the highest index seen."""

    def body(self) -> None:
        conn = RecordingConnection(self.ctx, self.name, self.ctx.servers)
        admin = Admin(conn)
        while self.ctx.going():
            self.pause(0.3, 0.8)
            with contextlib.suppress(RoadlogError):  # recorded
                admin.describe_group(GROUP, min_applied_index=self.ctx.fence)


class HeatmapReader(Worker):
    """Stores a heat map of the main topic, then asks for it, fenced at the
    highest index seen, as a producer that keeps publishing (give-to-get
    must let it in) or as a stranger that never published (kept out), over
    gRPC and HTTP. A refusal is an answer: recorded ok, ``allowed`` False."""

    WINDOW_MS = 15 * 60 * 1000  # the default contribution window
    # What a contribution needs (the main topic's), recorded with each read.
    RULE = {"min_pings": MIN_PINGS, "min_seconds": MIN_SECONDS}

    def __init__(self, ctx: Ctx, name: str, contributors: list[str]) -> None:
        super().__init__(ctx, name)
        self.contributors = contributors

    def body(self) -> None:
        conn = RecordingConnection(self.ctx, self.name, self.ctx.servers)
        admin = Admin(conn)
        # Each asks as itself: with tokens, its identity is who asks (the
        # request's client_id is then not what counts).
        asking = {
            c: RecordingConnection(self.ctx, self.name, self.ctx.servers, identity=c)
            for c in [*self.contributors, STRANGER]
        }
        hm = heatmaps_pb2.HeatMap(
            topic=MAIN_TOPIC, window_start_ms=self.ctx.t0_ms,
            window_end_ms=self.ctx.t0_ms + self.WINDOW_MS, h3_resolution=8,
            computed_ms=self.ctx.t0_ms,
        )  # fmt: skip
        if _retry(self.ctx, lambda: admin.put_heatmap(hm)) is None:
            return
        while self.ctx.going():
            self.pause(0.2, 0.6)
            client = self.rng.choice([*self.contributors, STRANGER])
            if self.rng.random() < 0.5:
                self.ask_grpc(asking[client], client)
            else:
                self.ask_http(client)

    def ask_grpc(self, conn: RecordingConnection, client: str) -> None:
        rec, fences = self.ctx.rec, self.ctx.fences()
        fence = fences.pop(0)
        op = rec.invoke(self.name, "heatmap", api="grpc", topic=MAIN_TOPIC, client=client,
                        fence=fence, fences={str(g): i for g, i in sorted(fences.items())},
                        window_ms=self.WINDOW_MS, **self.RULE)  # fmt: skip
        req = client_pb2.GetHeatmapRequest(
            topic=MAIN_TOPIC, client_id=client, min_applied_index=fence
        )
        for g, i in sorted(fences.items()):
            req.group_fences.add(group=g, applied_index=i)
        try:
            conn.call("GetHeatmap", req, timeout=10)
        except RoadlogError as e:
            if e.code in (Code.PERMISSION_DENIED, Code.NOT_FOUND):
                rec.complete(self.name, op, "ok", "heatmap",
                             allowed=e.code == Code.NOT_FOUND, reason=_why(e))  # fmt: skip
            else:
                rec.complete(self.name, op, "info", "heatmap", code=e.code.name, reason=_why(e))
            return
        rec.complete(self.name, op, "ok", "heatmap", allowed=True)

    def ask_http(self, client: str) -> None:
        rec, fences = self.ctx.rec, self.ctx.fences()
        fence = fences.pop(0)
        base = self.rng.choice(self.ctx.https)
        op = rec.invoke(self.name, "heatmap", api="http", via=base, topic=MAIN_TOPIC,
                        client=client, fence=fence,
                        fences={str(g): i for g, i in sorted(fences.items())},
                        window_ms=self.WINDOW_MS, **self.RULE)  # fmt: skip
        groups = ",".join(f"{g}:{i}" for g, i in sorted(fences.items()) if i)
        status, body = _http(
            self.ctx.tls_for(client),
            "GET",
            f"{base}/v1/topics/{MAIN_TOPIC}/heatmap?client_id={client}&min_applied_index={fence}"
            + (f"&group_fences={groups}" if groups else ""),
        )
        err = body.get("error", {}) if isinstance(body, dict) else {}
        if status in (200, 403, 404):
            rec.complete(self.name, op, "ok", "heatmap", allowed=status != 403,
                         reason=str(err.get("reason", ""))[:200])  # fmt: skip
        else:
            rec.complete(self.name, op, "info", "heatmap", code=f"HTTP {status}",
                         reason=str(err.get("reason", ""))[:200])  # fmt: skip


class TopicChurn(Worker):
    """Creates topics (gRPC or HTTP), publishes a batch to each, reads it
    back, and deletes most of them again."""

    def body(self) -> None:
        conn = RecordingConnection(self.ctx, self.name, self.ctx.servers, identity=CHURN)
        admin = Admin(conn)
        k = 0
        while self.ctx.going():
            self.pause(1.0, 4.0)
            k += 1
            topic = f"churn-{k}"
            if not self.create(admin, topic):
                continue
            prod = GrpcProducer(self.ctx, f"{self.name}-{k}", topic, self.ctx.servers)
            prod.identity = CHURN
            prod.limit = 1
            prod.body()
            if self.rng.random() < 0.7 and self.ctx.going():
                with contextlib.suppress(RoadlogError):  # recorded
                    admin.delete_topic(topic)

    def create(self, admin: Admin, topic: str) -> bool:
        parts = self.rng.choice((1, 2, 4))
        if self.rng.random() < 0.5:
            try:
                admin.create_topic(topic, REGION, parts)
                return True
            except RoadlogError:
                return False  # recorded
        rec = self.ctx.rec
        base = self.rng.choice(self.ctx.https)
        op = rec.invoke(self.name, "create_topic", api="http", via=base, topic=topic,
                        partitions=parts)  # fmt: skip
        status, body = _http(
            self.ctx.tls_for(CHURN), "POST", f"{base}/v1/topics",
            {"name": topic, "bbox": [11.4, 48.05, 11.75, 48.25], "partitions": parts},
        )  # fmt: skip
        outcome = _http_outcome(status)
        if outcome == "ok":
            rec.complete(self.name, op, "ok", "create_topic", applied_index=body["applied_index"])
            self.ctx.saw(int(body["applied_index"]))
            return True
        err = body.get("error", {}) if isinstance(body, dict) else {}
        rec.complete(self.name, op, outcome, "create_topic", code=f"HTTP {status}",
                     reason=str(err.get("reason", ""))[:200])  # fmt: skip
        return False


def create_main_topic(ctx: Ctx) -> bool:
    """The topic the long-lived workers use (recorded like any create)."""
    conn = RecordingConnection(ctx, "setup", ctx.servers, timeout=30)
    try:
        made = _retry(ctx, lambda: Admin(conn).create_topic(
            MAIN_TOPIC, REGION, PARTITIONS, contribution_min_pings=MIN_PINGS,
            contribution_min_seconds=MIN_SECONDS))  # fmt: skip
        if made is None:
            return False
        # Where its partitions went (the HTTP producer's answers say only
        # each group's index), recorded for the history's reader.
        groups = _retry(ctx, lambda: ctx.groups_of(conn, MAIN_TOPIC))
        if groups is not None:
            ctx.rec.event("setup", "ok", "placement", topic=MAIN_TOPIC, groups=groups)
        return groups is not None
    finally:
        conn.close()


GRPC_PRODUCERS, HTTP_PRODUCERS = 3, 1


def identities(
    grpc_producers: int = GRPC_PRODUCERS, http_producers: int = HTTP_PRODUCERS
) -> dict[str, list[str]]:
    """The identities a run with tokens issues (name -> scopes) before the
    workload starts: each producer publishes and reads any topic and asks
    for the main topic's heat map (give-to-get decides); the stranger may
    ask too, and never publishes; topic churn and INFRA are admins."""
    producer = [f"{PRODUCE}:{ANY_TOPIC}", f"{READ}:{ANY_TOPIC}", f"{HEATMAP}:{MAIN_TOPIC}"]
    names = [f"g{k}" for k in range(grpc_producers)] + [f"h{k}" for k in range(http_producers)]
    return {
        INFRA: [ADMIN],
        CHURN: [ADMIN],
        STRANGER: [f"{READ}:{ANY_TOPIC}", f"{HEATMAP}:{MAIN_TOPIC}"],
        **{n: producer for n in names},
    }


def start_all(
    ctx: Ctx, grpc_producers: int = GRPC_PRODUCERS, http_producers: int = HTTP_PRODUCERS
) -> list[Worker]:
    """The whole workload, started; each worker stops with the run."""
    servers = ctx.servers
    workers: list[Worker] = []
    for k in range(grpc_producers):
        order = servers if k % 2 == 0 else servers[::-1]  # both queue servers, first
        producer = GrpcProducer(ctx, f"g{k}", MAIN_TOPIC, order)
        producer.split = "server" if k % 2 else "client"  # mixed devices, split either side
        workers.append(producer)
    for k in range(http_producers):
        workers.append(HttpProducer(ctx, f"h{k}", MAIN_TOPIC))
    contributors = [w.name for w in workers]
    workers += [
        Reader(ctx, "reader"),
        HeatmapReader(ctx, "heat", contributors),
        GroupMembers(ctx, "c"),
        GroupObserver(ctx, "observer"),
        TopicChurn(ctx, "churn"),
    ]
    for w in workers:
        w.start()
    return workers


def stop_all(ctx: Ctx, workers: list[Worker], timeout: float = 60.0) -> list[str]:
    """Stop every worker; the names of those that did not end in time."""
    ctx.stop.set()
    deadline = time.monotonic() + timeout
    for w in workers:
        w.thread.join(max(0.0, deadline - time.monotonic()))
    return [w.name for w in workers if w.thread.is_alive()]
