"""Publishing from many coroutines at once, corked.

A ``Publisher`` keeps at most ``max_in_flight`` PublishBatch calls out to
the queue servers (a batch that is already full, ``max_batch_bytes``, goes
out anyway, up to ``max_full_in_flight``). Publishes made while they are
out wait, and travel together in the next call, which goes out once as many
wait as the smallest call out carries (or at once when none is out), and
never before the callers a call just answered have had their turn to
publish again (one turn of the event loop): the
same thing a NATS or Kafka client does with its write buffer, so that a
process publishing thousands of small batches a second pays for a few gRPC
messages, not thousands. The batches travel on one long-lived stream per
queue server (``roadlog.batch_stream``; unary calls to a queue server
without it). Nothing else changes: each publish is validated, stored, deduplicated (producer id and
sequence) and answered on its own, as if it had been sent alone.

Invariants: every publish is answered exactly once, with its
PublishResponse or a RoadlogError; a publish is sent again only after a
retryable failure (no leader, a queue server down, full queues), to the next
queue server, with backoff, until its deadline; calls go out in the order
publishes were made, retries first.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from roadlog.batch_stream import BatchFailed, BatchStream, Dial
from roadlog.client import RETRYABLE, client_id, first_server
from roadlog.client_tls import ClientTLS
from roadlog.errors import Code, RoadlogError, error
from roadlog.federation.home import Home, home_in_message
from roadlog.framing import OnFrame
from roadlog.limits import CLIENT_MESSAGE_BYTES
from roadlog.protowire import with_leading_varint
from roadlog.publish_link import PublishLink, open_link
from roadlog.rpc import BY_NAME
from roadlog.v1 import client_pb2

MAX_BATCH_REQUESTS = 4096  # what a node takes in one PublishBatch
_BATCH_GROUP_FIELD = BY_NAME["PublishBatch"].group_hint_field


@dataclass(eq=False)
class _Pending:
    request: bytes
    future: asyncio.Future[client_pb2.PublishResponse]
    deadline: float  # time.monotonic()
    reason: str = ""  # the last retryable failure, for the final error
    followed: bool = False  # sent on to the topic's home once (federation)
    order: int = 0  # when it was published: retries go out in this order
    gen: int = 0  # the cluster it was last sent to (``Publisher._gen`` then)


@dataclass
class PublisherStats:
    calls: int = 0  # PublishBatch calls made
    sent: int = 0  # publishes in them (sent / calls: how well publishes cork)
    acked: int = 0
    retried: int = 0
    failed: int = 0


class Publisher:
    """Corked, pipelined publishing over one connection (asyncio)."""

    def __init__(
        self,
        servers: Sequence[str],
        *,
        max_in_flight: int = 2,
        max_batch_requests: int = 1024,
        max_batch_bytes: int = 1 << 20,
        max_full_in_flight: int = 8,
        timeout: float = 30.0,
        client: str | None = None,
        tls: ClientTLS | None = None,
        token: str | None = None,
        group: int = 0,
        publish_link: bool = True,
    ) -> None:
        """``publish_link``: send the calls over a queue server's publish
        link (``roadlog.publish_link``) where it offers one; False, or
        ROADLOG_PUBLISH_LINK=0: over gRPC only. ``group``: every publish's
        pings lie in this data group's partitions (a topic placed in data
        groups: ``partitioning.ping_groups`` tells each ping's); the calls
        say so, and the queue server hands them to that group's leader,
        which refuses a ping of another group's partition. 0: no such
        promise (group 0's leader takes them and splits them by group if it
        must)."""
        if not servers:
            raise ValueError("no queue server given (--servers, --cluster or ROADLOG_SERVERS)")
        if not 1 <= max_batch_requests <= MAX_BATCH_REQUESTS:
            raise ValueError(f"max_batch_requests must be 1..{MAX_BATCH_REQUESTS}")
        self.servers = list(servers)
        self.group = group
        # The identity's token: ``token``, else tls's, else ROADLOG_TOKEN.
        self.tls = (tls if tls is not None else ClientTLS.from_env()).with_token(token)
        self.max_in_flight = max_in_flight
        self.max_batch_requests = max_batch_requests
        self.max_batch_bytes = max_batch_bytes
        self.max_full_in_flight = max(max_full_in_flight, max_in_flight)
        self._queued_bytes = 0
        self.timeout = timeout
        self.client = client or client_id()
        self.metadata = (("roadlog-client", self.client), *self.tls.metadata())
        self.publish_link = publish_link and os.environ.get("ROADLOG_PUBLISH_LINK", "") != "0"
        self.fence = 0  # the highest applied index of any answer (read your writes)
        self.group_fences: dict[int, int] = {}  # the same per data group
        self.stats = PublisherStats()
        self._channels: list[grpc.aio.Channel] = []
        self._calls: list[BatchStream] = []
        self.cluster = ""  # the member cluster a redirect pointed it at ("": as given)
        # Streams and channels of a cluster left by ``follow``: calls out on
        # them end on their own; closed with the rest at ``close``.
        self._retired: list[tuple[list[grpc.aio.Channel], list[BatchStream]]] = []
        self._current = first_server(len(self.servers))
        self._queue: deque[_Pending] = deque()
        self._in_flight = 0  # calls out, and retries waiting out their backoff
        self._flight_sizes: list[int] = []  # publishes in each call out
        self._tasks: set[asyncio.Task[None]] = set()
        self._backoff = 0.0
        # A call came back: no call goes out until the callers it answered
        # had their turn (``_answered``).
        self._answering = False
        self._idle = asyncio.Event()  # nothing queued, nothing out
        self._idle.set()
        self._published = 0  # publishes made: each one's ``order``
        # Federation: ``follow`` moves to the next generation; calls out (or
        # waiting out a backoff) to the cluster left hold every send until
        # they are back, so what the new home gets is in publish order (an
        # idempotent producer's sequences: one older than the 8 a partition
        # remembers would be refused).
        self._gen = 0
        self._held: dict[int, int] = {}  # generation -> its calls out or backing off

    @property
    def linked(self) -> int:
        """Calls answered over a publish link so far (the rest: gRPC)."""
        return sum(c.linked for c in self._calls)

    async def __aenter__(self) -> Publisher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _open(self) -> None:
        opts = [
            ("grpc.max_receive_message_length", CLIENT_MESSAGE_BYTES),
            ("grpc.max_send_message_length", CLIENT_MESSAGE_BYTES),
        ]
        for s in self.servers:
            ch = self.tls.aio_channel(s, options=opts)
            self._channels.append(ch)
            dial = self._dialer(s) if self.publish_link else None
            self._calls.append(BatchStream(ch, self.metadata, dial))

    def _dialer(self, target: str) -> Dial:
        """How to open the publish link of the queue server at ``target``
        (its host, the port it offers), as this publisher's identity."""
        host = target.rpartition(":")[0].strip("[]") or target
        credential = f"Bearer {self.tls.token}" if self.tls.token else None

        async def dial(port: int, on_frame: OnFrame) -> PublishLink:
            ctx = self.tls.ssl_context()
            return await open_link(
                host, port, ctx, self.client, credential, on_frame, CLIENT_MESSAGE_BYTES + 1024
            )

        return dial

    async def close(self) -> None:
        """Wait until every publish made is answered, then close the channels."""
        await self._idle.wait()
        for channels, calls in [*self._retired, (self._channels, self._calls)]:
            for stream in calls:
                await stream.close()
            for ch in channels:
                await ch.close()
        self._channels, self._calls, self._retired = [], [], []

    def follow(self, home: Home) -> None:
        """Publish to ``home``'s queue servers from now on (a member cluster
        of a federation that holds the topic); the fences are dropped (Raft
        indexes are per cluster)."""
        if list(home.queue_servers) == self.servers:
            return
        if self._calls:
            self._retired.append((self._channels, self._calls))
        self._channels, self._calls = [], []
        self.servers = list(home.queue_servers)
        self._open()
        self._current = first_server(len(self.servers))
        self.cluster = home.cluster
        self.fence = 0
        self.group_fences = {}
        self._gen += 1

    async def publish(
        self, request: client_pb2.PublishRequest | bytes, timeout: float | None = None
    ) -> client_pb2.PublishResponse:
        """Publish one request; returns once it is stored on a majority."""
        if not self._calls:
            self._open()
        raw = request if isinstance(request, bytes) else request.SerializeToString()
        fut: asyncio.Future[client_pb2.PublishResponse] = asyncio.get_running_loop().create_future()
        wait = self.timeout if timeout is None else timeout
        self._published += 1
        self._queue.append(_Pending(raw, fut, time.monotonic() + wait, order=self._published))
        self._queued_bytes += len(raw)
        self._idle.clear()
        self._pump()
        return await fut

    # ------------------------------------------------------------ sending

    def _may_send(self) -> bool:
        """Whether the publishes waiting go out now (balanced corking):
        - at once when no call is out (a lone publish never waits);
        - a full batch (max_batch_bytes) at once, up to max_full_in_flight
          calls: big publishes pipeline;
        - otherwise, below max_in_flight, once as many publishes wait as the
          smallest call out carries. Calls then carry about the same number
          of publishes, as many as the publishers keep going allow, instead
          of a call taking the few that came in while another returned: the
          fixed cost of a call (a replication round on every node) is
          shared by more publishes, with the same calls in flight.
        Never while a call's answers are being taken up (``_answered``)."""
        if not self._queue or self._answering:
            return False
        if any(n for g, n in self._held.items() if g < self._gen):
            return False  # the cluster left still has publishes of ours out
        if self._in_flight == 0:
            return True
        if self._queued_bytes >= self.max_batch_bytes:
            return self._in_flight < self.max_full_in_flight
        if self._in_flight >= self.max_in_flight:
            return False
        return len(self._queue) >= min(self._flight_sizes, default=1)

    def _pump(self) -> None:
        """Send what waits, as ``_may_send`` allows."""
        while self._may_send():
            batch = self._take()
            if not batch:
                break
            self._in_flight += 1
            self._flight_sizes.append(len(batch))
            self._hold(self._gen, +1)
            for p in batch:
                p.gen = self._gen
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if not self._queue and not self._in_flight:
            self._idle.set()

    def _take(self) -> list[_Pending]:
        batch: list[_Pending] = []
        size = 0
        now = time.monotonic()
        q = self._queue
        while q and len(batch) < self.max_batch_requests:
            p = q[0]
            if p.future.done():  # the caller gave up
                q.popleft()
                self._queued_bytes -= len(p.request)
                continue
            if p.deadline <= now:
                q.popleft()
                self._queued_bytes -= len(p.request)
                self._fail(p, error(Code.UNAVAILABLE, p.reason or "no time left"))
                continue
            if batch and size + len(p.request) > self.max_batch_bytes:
                break
            q.popleft()
            self._queued_bytes -= len(p.request)
            batch.append(p)
            size += len(p.request)
        return batch

    async def _send(self, batch: list[_Pending]) -> None:
        try:
            await self._call(batch)
        except Exception as e:  # never leave a publish unanswered
            for p in batch:
                self._fail(p, RoadlogError(Code.INTERNAL, f"{type(e).__name__}: {e}"))
        finally:
            self._in_flight -= 1
            self._flight_sizes.remove(len(batch))
            self._hold(batch[0].gen, -1)
            self._answering = True
            asyncio.get_running_loop().call_soon(self._answered)

    def _answered(self) -> None:
        """Send what waits, a turn of the event loop after a call came back:
        the callers its answers woke (each woken by a callback scheduled
        before this one) have published again by now and ride in the next
        call with the publishes that waited, instead of the first of them
        sending the waiting ones off alone and the rest waiting out a whole
        round. In a closed loop of senders, a call then carries every
        sender's publish, not half of them in each of two calls: one
        replication round for all (bench/profiles/write-path.md, session
        23)."""
        self._answering = False
        self._pump()

    async def _call(self, batch: list[_Pending]) -> None:
        server = self._current
        body = client_pb2.PublishBatchRequestView(requests=[p.request for p in batch])
        # The group first, where the queue server reads it without parsing.
        wire = with_leading_varint(body.SerializeToString(), _BATCH_GROUP_FIELD, self.group)
        left = max(p.deadline for p in batch) - time.monotonic()
        self.stats.calls += 1
        self.stats.sent += len(batch)
        try:
            raw = await self._calls[server].exchange(wire, max(left, 0.01))
        except BatchFailed as e:
            code, why = e.code, e.why
            home = home_in_message(why) if code == Code.FAILED_PRECONDITION else None
            if home is not None and not any(p.followed for p in batch):
                for p in batch:
                    p.followed = True
                self.follow(home)
                self._retry(batch, why)
                return
            if code not in RETRYABLE:
                for p in batch:
                    self._fail(p, error(code, why))
                return
            if self._current == server:  # fail over to the next queue server
                self._current = (server + 1) % len(self._calls)
            self._retry(batch, why)
            return
        resp = client_pb2.PublishBatchResponseView.FromString(raw)
        if len(resp.results) != len(batch):
            err = RoadlogError(
                Code.INTERNAL,
                f"{len(resp.results)} results for {len(batch)} publishes",
            )
            for p in batch:
                self._fail(p, err)
            return
        again: list[_Pending] = []
        for p, r in zip(batch, resp.results, strict=True):
            if r.code == 0:
                out = client_pb2.PublishResponse.FromString(r.response)
                self.fence = max(self.fence, out.applied_index)
                for f in out.group_fences:
                    self.group_fences[f.group] = max(
                        self.group_fences.get(f.group, 0), f.applied_index
                    )
                self.stats.acked += 1
                if not p.future.done():
                    p.future.set_result(out)
                continue
            code = Code.of(r.code)
            home = home_in_message(r.message) if code == Code.FAILED_PRECONDITION else None
            if home is not None and not p.followed:
                p.followed = True  # once: a second redirect is the caller's error
                self.follow(home)
                p.reason = r.message
                again.append(p)
            elif code in RETRYABLE:
                p.reason = r.message
                again.append(p)
            else:
                self._fail(p, error(code, r.message))
        if again:
            self._retry(again, again[0].reason)
        else:
            self._backoff = 0.0

    def _retry(self, batch: list[_Pending], reason: str) -> None:
        """Send these again after a backoff, ahead of newer publishes."""
        self.stats.retried += len(batch)
        for p in batch:
            p.reason = p.reason or reason
        self._backoff = min(max(self._backoff * 2, 0.02), 1.0)
        self._in_flight += 1  # the backoff holds a slot: no new call jumps ahead
        gen = batch[0].gen
        self._hold(gen, +1)

        def requeue() -> None:
            self._in_flight -= 1
            self._hold(gen, -1)
            self._queue.extendleft(reversed(batch))
            orders = [p.order for p in self._queue]
            if orders != sorted(orders):  # retries of several calls: publish order again
                self._queue = deque(sorted(self._queue, key=lambda p: p.order))
            self._queued_bytes += sum(len(p.request) for p in batch)
            self._pump()

        asyncio.get_running_loop().call_later(self._backoff, requeue)

    def _hold(self, gen: int, delta: int) -> None:
        n = self._held.get(gen, 0) + delta
        if n:
            self._held[gen] = n
        else:
            self._held.pop(gen, None)

    def _fail(self, p: _Pending, err: RoadlogError) -> None:
        self.stats.failed += 1
        if not p.future.done():
            p.future.set_exception(err)
