"""The simulated front door: clients, one queue server (the real
``WorkQueues``) and the nodes as its workers, in virtual time.

Clients are idempotent producers: each sends one request at a time, a write
or a read. A write is tagged with its producer id and a sequence, and until
it is acknowledged the client sends the same (producer, sequence) again
after every failure: its item given up by the queue (dropped on a worker's
crash past its deadline, expired), an UNAVAILABLE answer after too many
retries, or its own deadline (it cancels the item). A client is
acknowledged only when the node that proposed its write applied it and the
worker's answer reached the queue server, as in queue_server/server.py and
node_daemon/work/handler.py: a node connects as a worker when it starts and
disconnects when it crashes (what it held goes back to the queue), tells
its role and indexes (every tick, and with every answer), grants credit
and gets one credit back per answer; only the leader takes writes; a node
that is not the leader, or whose proposal was overwritten, answers
UNAVAILABLE and the queue hands the item to another worker.

A read is fenced, as roadlog.client does it: ``min_applied_index`` is the
highest applied index the client's answers carried (now and then an earlier
write's). It goes into the queue as a READ item with that fence, which any
node whose worker told an applied index at or above it may take, leader or
follower; the node waits until it has applied the fence (failing the read
after FENCE_WAIT), takes a while, and answers with the topic's writes as
its state machine holds them then (the real one through its fetch, the toy
one its stored writes). A read that fails (its node crashed past its
deadline, the client's deadline passed, its fence beyond every connected
node's commit index for FENCE_GRACE, as the queue server refuses it) is
sent again; one whose node crashed in time is handed to another node.

Checked after every queue operation: each open item is in exactly one
place (queued in the queue of its kind, or held by one connected worker),
none is lost and none is held twice; a read a node waits on is held by its
worker; a client's item is of the kind of its request; a read is handed
only to a worker that told an applied index at or above its fence. Checked
on every read answer: it holds every write of its client acknowledged at an
index up to its fence, and every write of other clients acknowledged at an
index in 1..fence, each at the offset its answer gave (read your writes);
nothing it holds was never sent; and all reads agree (one is a prefix of
the other). Checked at the end, on every converged replica: each
acknowledged write is stored exactly once, at the offset its answer gave
(on the real state machine its rows are read back; the toy one stores
writes in offset order and dedupes a resent (producer, sequence) as the
real one does), no write is stored twice even when it was sent again, and
every read returned a prefix of what the replica holds.

The queue server also submits items of its own (``submit_foreign``; the
split publishes of split.py and their parts, the consumers' offset commits
of consumers.py), checked as the clients' are: each in exactly one place
until it is answered or cancelled.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from node_daemon.raft import Entry, PendingProposals, ProposalDropped, Ready, Role
from node_daemon.state.machine import append_op
from node_daemon.state.responses import OpResult
from queue_server.queues import Item, Kind, QueueFull, WorkQueues
from roadlog import columnar
from roadlog.columnar import PingColumns
from roadlog.errors import Code, RoadlogError
from roadlog.v1 import client_pb2, command_pb2, topics_pb2

if TYPE_CHECKING:
    from tests.simulation.harness import SimNode, Simulation

TOPIC = "q"
# Write credit a worker grants when it connects: node_daemon.work.handler's
# WRITE_CREDIT, or a few, so that a proposal that is never answered (its
# entry overwritten or cut away and nothing else ever applied at its index)
# starves the queue and fails the run.
CREDITS = (4, 256)
# Read credit: node_daemon.work.handler's READ_CREDIT, or a couple (reads waiting
# for their fence on a node then hold all of it).
READ_CREDITS = (2, 64)
MAX_ATTEMPTS = 50  # as queue_server.server: UNAVAILABLE answers before the client hears one
TS_BASE = 1 << 20  # a stored ping's ts_ms is producer * TS_BASE + sequence
# As queue_server.server's FENCE_GRACE_S: a read fenced beyond every
# connected node's commit index waits this long before it is refused.
FENCE_GRACE = 200
# As node_daemon.work.handler (wait_applied's timeout): how long a node holding a
# read waits to apply its fence before it answers with a failure.
FENCE_WAIT = 1000
FENCE_TIMEOUT = "TimeoutError: the fence was not applied in time"


@dataclass(slots=True)
class Read:
    """A fenced read of the whole topic: answered by a node that applied
    ``fence``."""

    fence: int
    request: bytes


@dataclass(slots=True)
class Foreign:
    """An item of the queue server's own: who hears its answer, and how a
    leader serves it when not by proposing it (``serve``: answered at once),
    or what it does before proposing it (``judge``: given the node, its
    worker and the item, it later calls ``Front.propose`` or answers with
    ``Front.answer_held``)."""

    answer: Callable[[OpResult | None], None]
    serve: Callable[[SimNode, Item], OpResult] | None = None
    judge: Callable[[SimNode, int, Item], None] | None = None


@dataclass(slots=True)
class Client:
    producer: int
    seq: int = 0  # the sequence of the write in flight (or last acknowledged)
    item: int | None = None  # the queue item carrying it now
    deadline: int = 0  # virtual time the client stops waiting for ``item``
    retry_at: int | None = None  # when to send the same request again
    sent: int = 0  # how many times the current request was submitted
    # As roadlog.client's fence: the highest applied index its answers carried.
    fence: int = 0
    indexes: list[int] = field(default_factory=list)  # its acknowledged writes' indexes
    read: Read | None = None  # the read in flight, if it is one (else write ``seq`` is)


@dataclass
class Front:
    sim: Simulation
    rng: random.Random
    q: WorkQueues = field(default_factory=lambda: WorkQueues(max_writes=64, max_reads=64))
    clients: list[Client] = field(default_factory=list)
    p_submit: float = 0.3
    credit: int = CREDITS[-1]
    timeout: int = 1000  # time units a client waits for an answer
    next_item: int = 0
    workers: dict[int, int] = field(default_factory=dict)  # node id -> worker id
    # node -> (worker, item) of each write it proposed, by log index
    pending: dict[int, PendingProposals[tuple[int, int]]] = field(default_factory=dict)
    open_items: dict[int, int] = field(default_factory=dict)  # item -> client index
    acked: dict[tuple[int, int], int] = field(default_factory=dict)  # (producer, seq) -> offset
    # (producer, seq) -> the applied index its answer carried (its read fence)
    acked_at: dict[tuple[int, int], int] = field(default_factory=dict)
    submitted: set[tuple[int, int]] = field(default_factory=set)  # writes ever sent
    topic_ready: bool = False
    sends: int = 0
    retries: int = 0
    p_read: float = 0.25  # share of a client's requests that are reads
    read_credit: int = READ_CREDITS[-1]
    read_time: int = 0  # at most this long a node takes to serve a read
    # node -> the reads it holds: (worker, item, served not before, given up at)
    waiting: dict[int, list[tuple[int, Item, int, int]]] = field(default_factory=dict)
    reads_ok: int = 0  # fenced reads answered and checked
    reads_resent: int = 0  # sent again by their client
    reads_handed_again: int = 0  # served after an earlier holder crashed or the client cancelled
    longest_read: list[tuple[int, int]] = field(default_factory=list)
    # Without clients the queue sees only workers, and the run's history
    # (messages, faults) is the one of the Raft-only harness.
    with_clients: bool = True
    # Items the queue server submits for others (split.SplitFront: a split
    # publish into group 0's queue, its parts into the data groups'):
    # item -> who is answered, and how a leader serves it if not by proposing.
    foreign: dict[int, Foreign] = field(default_factory=dict)
    # Ops the first client's first write adds on the real state machine (a
    # data group's: the split topic and the split clients' producer ids;
    # group 0's: its record of the split topic and the consumers' groups).
    extra_create_ops: list[command_pb2.Op] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = self.rng.choice([1, 2, 3]) if self.with_clients else 0
        self.clients = [Client(producer=i + 1) for i in range(n)]
        self.p_submit = self.rng.choice([0.05, 0.1, 0.3])
        self.timeout = self.rng.choice([300, 1000, 3000])
        self.credit = self.rng.choice(CREDITS)
        self.p_read = self.rng.choice([0.0, 0.25, 0.5])
        self.read_credit = self.rng.choice(READ_CREDITS)
        self.read_time = self.rng.choice([0, 50, 500])
        if not self.sim.opts.real_sm:
            self.topic_ready = True  # the toy state machine has no topics

    # -- what a write is ----------------------------------------------------

    def command(self, c: Client) -> bytes:
        if not self.sim.opts.real_sm:
            return b"w%d.%d" % (c.producer, c.seq)
        if c.seq == 0:
            # The first client's first write creates the topic and issues
            # every client's producer id, as InitProducer does (a resend
            # finds them taken: only the first op's result is the answer).
            from tests.simulation.harness import REGION

            spec = topics_pb2.TopicSpec(name=TOPIC, region_geojson=REGION, partitions=1)
            ops = [command_pb2.Op(create_topic=command_pb2.CreateTopicOp(spec=spec))]
            ops += [
                command_pb2.Op(
                    init_producer=command_pb2.InitProducerOp(
                        client_id=f"c{k.producer}", producer_id=k.producer
                    )
                )
                for k in self.clients
            ]
            ops += self.extra_create_ops
        else:
            cols = PingColumns.from_columns(
                [f"d{c.producer}"], [c.producer * TS_BASE + c.seq], [48.1], [11.5]
            )
            ops = [append_op(TOPIC, [(0, cols)], c.producer, c.seq, f"c{c.producer}")]
        return command_pb2.Command(leader_ms=self.sim.now, ops=ops).SerializeToString()

    # -- what a read is -----------------------------------------------------

    def new_read(self, c: Client) -> Read:
        """Read your writes: fenced at the client's fence (as roadlog.client
        sets it), or now and then at an earlier write's index."""
        fence = c.fence
        if c.indexes and self.rng.random() < 0.25:
            fence = self.rng.choice(c.indexes)
        if not self.sim.opts.real_sm:
            return Read(fence, b"r%d" % fence)
        req = client_pb2.FetchRequest(
            topic=TOPIC, partition=0, offset=0, max_pings=1 << 30, min_applied_index=fence
        )
        return Read(fence, req.SerializeToString())

    def read_fence(self, it: Item) -> int:
        """The fence the node waits for, as node_daemon.work.handler: the item's
        or the request's, the higher."""
        if not self.sim.opts.real_sm:
            return max(it.fence, int(it.request[1:]))
        return max(it.fence, client_pb2.FetchRequest.FromString(it.request).min_applied_index)

    def serve_read(self, node: SimNode, it: Item) -> OpResult:
        """What the node answers: the topic's writes as its state machine
        holds them now (the real one through its fetch)."""
        from tests.simulation.harness import RealStateMachine

        sm = node.sm
        if not isinstance(sm, RealStateMachine):
            keys = b",".join(sm.writes)
            return OpResult(response=b"%d|%s" % (node.id, keys))
        try:
            resp = sm.sm.fetch(client_pb2.FetchRequest.FromString(it.request))
        except RoadlogError as e:
            return OpResult(e.code, e.message)
        resp.served_by = str(node.id)
        return OpResult(response=resp.SerializeToString())

    def read_rows(self, response: bytes) -> tuple[str, list[tuple[int, int]]]:
        """Who served a read and the (producer, sequence) it returned, in
        offset order."""
        from tests.simulation.harness import toy_write

        if not self.sim.opts.real_sm:
            node, _, keys = response.partition(b"|")
            rows = [w for w in map(toy_write, keys.split(b",")) if w is not None]
            return node.decode(), rows
        resp = client_pb2.FetchResponseView.FromString(response)
        out: list[tuple[int, int]] = []
        for b in resp.batches:
            if b.base_offset != len(out):
                self.sim.checker.fail(f"read from offset 0 has a batch at {b.base_offset}")
            for ts in columnar.decode(b.batch).ts_ms.tolist():
                out.append((ts // TS_BASE, ts % TS_BASE))
        if resp.next_offset != len(out) or resp.end_offset != len(out):
            self.sim.checker.fail(
                f"read of {len(out)} pings ends at {resp.next_offset} of {resp.end_offset}"
            )
        return resp.served_by, out

    # -- clients ----------------------------------------------------------------

    def step(self) -> None:
        """One tick of the front door: clients send, time out and retry;
        workers tell their state; the queue expires and dispatches."""
        now = self.sim.now
        for i, c in enumerate(self.clients):
            if c.item is not None and now >= c.deadline:
                if self.q.cancel(c.item):  # the client gives up waiting on this item
                    self.open_items.pop(c.item, None)  # it was queued: gone now
                self._failed(i)
            if c.item is None and c.retry_at is not None:
                if now >= c.retry_at:
                    self._submit(i)
            elif c.item is None and self.sim.chaos and self.rng.random() < self.p_submit:
                if self.topic_ready and c.fence and self.rng.random() < self.p_read:
                    c.read = self.new_read(c)
                    self._submit(i)
                elif self.topic_ready:
                    c.seq += 1
                    self._submit(i)
                elif i == 0:  # the topic's creation is the first client's write 0
                    self._submit(i)
        for nid in self.workers:
            self._tell(self.sim.nodes[nid])
        self._serve_waiting()
        self._drop_unreachable()
        self._expire()
        self._dispatch()
        self.check()

    def _tell(self, node: SimNode) -> None:
        """The node's worker tells the queue server its role and indexes."""
        core, wid = node.core, self.workers.get(node.id)
        if core is not None and wid is not None:
            self.q.update(wid, core.role == Role.LEADER, core.term, node.sm.applied)

    def _drop_unreachable(self) -> None:
        """As QueueServer._expire: reads fenced beyond every connected
        node's commit index for FENCE_GRACE are refused (OUT_OF_RANGE)."""
        commits = [
            core.log.committed
            for nid in self.workers
            if (core := self.sim.nodes[nid].core) is not None
        ]
        if not commits:
            return
        for it in self.q.drop_unreachable_fences(max(commits), float(self.sim.now - FENCE_GRACE)):
            self.open_items.pop(it.id, None)
            self._answer(it.id, None)

    def _submit(self, i: int) -> None:
        c = self.clients[i]
        self.next_item += 1
        now = self.sim.now
        deadline = float(now + self.timeout)
        if c.read is not None:
            item = Item(self.next_item, Kind.READ, "Fetch", c.read.request, deadline, now)
            item.fence = c.read.fence  # as QueueServer.call: the request's fence routes it
        else:
            item = Item(self.next_item, Kind.WRITE, "Publish", self.command(c), deadline, now)
            self.submitted.add((c.producer, c.seq))
        item.client = f"c{c.producer}"
        c.retry_at = None
        try:
            self.q.submit(item)
        except QueueFull:
            self.sim.checker.fail(f"queue full with {len(self.open_items)} items open")
        c.item, c.deadline, c.sent = item.id, now + self.timeout + 50, c.sent + 1
        if c.read is not None:
            self.reads_resent += c.sent > 1
        else:
            self.sends += 1
            self.retries += c.sent > 1
        self.open_items[item.id] = i

    def _failed(self, i: int) -> None:
        """The client's request failed: send the same request again later."""
        c = self.clients[i]
        c.item = None
        c.retry_at = self.sim.now + self.rng.randint(1, 30)

    def _answer(self, item_id: int, result: OpResult | None) -> None:
        """The queue server answers the client waiting on ``item_id``, if
        any (a cancelled item's answer reaches no one)."""
        f = self.foreign.pop(item_id, None)
        if f is not None:
            f.answer(result)
            return
        for i, c in enumerate(self.clients):
            if c.item != item_id:
                continue
            if result is None or (c.read is not None and result.message == FENCE_TIMEOUT):
                self._failed(i)
                return
            if c.read is not None:
                self._read_answered(c, c.read, result)
                c.read = None
            else:
                self._acknowledge(c, result)
            c.item, c.sent = None, 0
            return

    def _acknowledge(self, c: Client, r: OpResult) -> None:
        if r.code != OpResult().code:
            self.sim.checker.fail(f"producer {c.producer} seq {c.seq} answered {r}")
        offset = -1
        if self.sim.opts.real_sm and c.seq == 0:
            self.topic_ready = True
            index = topics_pb2.TopicDescription.FromString(r.response).applied_index
        else:
            resp = client_pb2.PublishResponse.FromString(r.response)
            [o] = resp.offsets  # a retry stored before is answered with its first offsets
            if o.count != 1:
                self.sim.checker.fail(f"producer {c.producer} seq {c.seq} answered {o}")
            offset, index = o.base_offset, resp.applied_index
        self.acked[(c.producer, c.seq)] = offset
        self.acked_at[(c.producer, c.seq)] = index
        c.fence = max(c.fence, index)  # as roadlog.client
        if index:
            c.indexes.append(index)

    def _read_answered(self, c: Client, read: Read, r: OpResult) -> None:
        """Read your writes: a read fenced at F holds every write of its
        client acknowledged at an index up to F, and every other client's
        write acknowledged at an index in 1..F, each at the offset its
        answer gave; it holds nothing that was never sent, and it agrees
        with every other read (one is a prefix of the other)."""
        fail = self.sim.checker.fail
        if r.code != Code.OK:
            fail(f"read of producer {c.producer} fenced at {read.fence} answered {r}")
        node, rows = self.read_rows(r.response)
        where = f"read of producer {c.producer} fenced at {read.fence} (node {node})"
        for (p, s), index in sorted(self.acked_at.items()):
            if index > read.fence or (p != c.producer and not index):
                continue
            offset = self.acked[(p, s)]
            if offset < 0:
                continue  # the topic's creation: the read found the topic
            if offset >= len(rows) or rows[offset] != (p, s):
                fail(
                    f"{where} lacks write {(p, s)} acknowledged at index {index} "
                    f"offset {offset}: it holds {len(rows)} writes"
                )
        never = [w for w in rows if w not in self.submitted]
        if never:
            fail(f"{where} returned writes never sent: {never[:3]}")
        longest = self.longest_read
        common = min(len(rows), len(longest))
        if rows[:common] != longest[:common]:
            fail(f"{where} disagrees with an earlier read within its first {common} writes")
        if len(rows) > len(longest):
            self.longest_read = rows
        self.reads_ok += 1

    # -- workers ----------------------------------------------------------------

    def connect(self, node: SimNode) -> None:
        self.next_item += 1
        wid = self.next_item
        self.workers[node.id] = wid
        self.q.connect(wid, node.id)
        self.q.grant(wid, self.credit, self.read_credit)

    def disconnect(self, node: SimNode) -> None:
        """The node crashed: its stream breaks; what it held goes back."""
        self.pending.pop(node.id, None)
        self.waiting.pop(node.id, None)
        wid = self.workers.pop(node.id, None)
        if wid is None:
            return
        self.q.disconnect(wid, float(self.sim.now))
        self._expire()
        self.check()

    def _expire(self) -> None:
        for e in self.q.expire(float(self.sim.now)):
            self.open_items.pop(e.item.id, None)
            self._answer(e.item.id, None)

    def _dispatch(self) -> None:
        nodes = {w: n for n, w in self.workers.items()}
        for wid, it in self.q.dispatch(float(self.sim.now)):
            w = self.q.workers.get(wid)
            if it.kind == Kind.READ and w is not None and w.applied < it.fence:
                self.sim.checker.fail(
                    f"read fenced at {it.fence} handed to node {w.node_id}, "
                    f"which told the queue it applied {w.applied}"
                )
            if w is None or it.id not in w.inflight:
                continue  # its node crashed while an earlier item was proposed
            self._work(self.sim.nodes[nodes[wid]], wid, it)

    def _work(self, node: SimNode, wid: int, it: Item) -> None:
        core = node.core
        assert core is not None
        if it.kind == Kind.READ:
            # Any node serves a read, once it has applied its fence; it takes
            # a while (it may crash meanwhile, or the client stop waiting).
            now = self.sim.now
            ready = now + self.rng.randint(0, self.read_time)
            self.waiting.setdefault(node.id, []).append((wid, it, ready, now + FENCE_WAIT))
            self._serve_waiting([node.id])
            return
        if core.role != Role.LEADER:
            self._result(wid, it.id, None)  # NotLeader: UNAVAILABLE
            return
        f = self.foreign.get(it.id)
        if f is not None and f.serve is not None:  # answered at once, nothing proposed
            self._result(wid, it.id, f.serve(node, it))
            return
        if f is not None and f.judge is not None:  # judged first (it proposes, or answers)
            f.judge(node, wid, it)
            return
        data = it.request
        if it.method == "AppendPart":
            from tests.simulation.split import part_proposal

            data = part_proposal(it.request, self.sim.opts.real_sm, self.sim.now)
        self.propose(node, wid, it, data)

    def propose(self, node: SimNode, wid: int, it: Item, data: bytes) -> None:
        """The node proposes ``data`` for the item its worker ``wid`` holds,
        answered once it applies it; a node that is no longer the leader
        answers UNAVAILABLE (NotLeader), as does a dropped proposal."""
        core = node.core
        if core is None or core.role != Role.LEADER:
            self._result(wid, it.id, None)
            return
        try:
            index = core.propose_many([data])
        except ProposalDropped:
            self._result(wid, it.id, None)
            return
        self.pending.setdefault(node.id, PendingProposals()).add(index, core.term, (wid, it.id))
        node.process()

    def answer_held(self, wid: int, it: Item, r: OpResult | None) -> None:
        """The worker ``wid`` answers the item it holds without proposing
        it (a refusal; None: UNAVAILABLE, handed to another node)."""
        self._result(wid, it.id, r)

    def holds(self, wid: int, it: Item) -> bool:
        """Worker ``wid`` (still connected) holds ``it``: it was not handed
        back after a crash of its node."""
        w = self.q.workers.get(wid)
        return w is not None and w.inflight.get(it.id) is it

    def fence_reached(self, node: SimNode, it: Item) -> bool:
        """As WorkHandler._fenced: the node has applied the read's fence."""
        return node.sm.applied >= self.read_fence(it)

    def _serve_waiting(self, nids: list[int] | None = None) -> None:
        """Answer the reads whose node has applied their fence (and taken
        its time); fail those that waited FENCE_WAIT for it (the worker's
        wait timed out)."""
        now = self.sim.now
        for nid in sorted(self.waiting) if nids is None else nids:
            node = self.sim.nodes[nid]
            done: list[tuple[int, Item, OpResult]] = []
            still = []
            for wid, it, ready, give_up in self.waiting.get(nid, []):
                if self.fence_reached(node, it):
                    if now >= ready:
                        done.append((wid, it, self.serve_read(node, it)))
                        self.reads_handed_again += it.deliveries > 1
                        continue
                elif now >= give_up:
                    done.append((wid, it, OpResult(Code.INTERNAL, FENCE_TIMEOUT)))
                    continue
                still.append((wid, it, ready, give_up))
            self.waiting[nid] = still
            for wid, it, r in done:
                self._result(wid, it.id, r)

    def on_applied(self, node: SimNode, e: Entry, results: Callable[[], OpResult]) -> None:
        """As Replica._resolve: the proposer's pending write at ``e.index``
        is answered, or failed when another entry took its place."""
        pend = self.pending.get(node.id)
        if not pend:
            return
        mine, lost = pend.applied([e])
        for _, (wid, item) in mine:
            self._result(wid, item, results())
        for wid, item in lost:
            self._result(wid, item, None)

    def on_log_written(self, node: SimNode, rd: Ready) -> None:
        """As Replica._ready_done: writes whose entry left the node's log
        (overwritten, cut away, under a snapshot) are failed at once."""
        pend = self.pending.get(node.id)
        core = node.core
        if pend is None or core is None:
            return
        first = rd.entries[0].index if rd.entries else None
        if pend.may_be_lost(first, rd.snapshot is not None):
            for wid, item in pend.lost(core.log):
                self._result(wid, item, None)

    def _result(self, wid: int, item_id: int, r: OpResult | None) -> None:
        """The worker's answer reaches the queue server, with one credit
        and the node's state (as node_daemon.work.handler: a read fenced at this
        write's index can go to this node at once)."""
        w = self.q.workers.get(wid)
        if w is None:
            return  # its stream broke: the item was handed back already
        held = w.inflight.get(item_id)
        is_read = held is not None and held.kind == Kind.READ
        self.q.grant(wid, 0 if is_read else 1, 1 if is_read else 0)
        self._tell(self.sim.nodes[w.node_id])
        if r is None:
            it = self.q.retry(wid, item_id)
            if it is not None and it.attempts < MAX_ATTEMPTS:
                self.check()
                return  # queued again at the front: another node (the new leader) takes it
            if it is not None:  # as queue_server.server: given up, out of the queue
                self.q.cancel(item_id)
        else:
            self.q.complete(wid, item_id)
        self.open_items.pop(item_id, None)
        self._answer(item_id, r)
        self.check()

    # -- checks -----------------------------------------------------------------

    def check(self) -> None:
        """Each open item is in exactly one place: queued, or held by one
        connected worker; nothing else is in the queue."""
        seen: dict[int, str] = {}
        kinds: dict[int, Kind] = {}
        fail = self.sim.checker.fail
        for kind, queue in self.q.queues.items():
            for it in queue:
                if it.id in seen:
                    fail(f"queue item {it.id} is {seen[it.id]} and queued again")
                if it.kind != kind:
                    fail(f"queue item {it.id} ({it.kind.name}) is in the {kind.name} queue")
                seen[it.id], kinds[it.id] = f"queued ({kind.name})", it.kind
        for w in self.q.workers.values():
            for iid, it in w.inflight.items():
                if iid != it.id:
                    fail(f"worker {w.id} holds item {it.id} under {iid}")
                if iid in seen:
                    fail(f"queue item {iid} is {seen[iid]} and held by worker {w.id}")
                seen[iid], kinds[iid] = f"held by worker {w.id}", it.kind
        for nid, held in self.waiting.items():
            for wid, it, _, _ in held:
                holder = self.q.workers.get(wid)
                if holder is None or holder.node_id != nid or holder.inflight.get(it.id) is not it:
                    fail(f"node {nid} waits to serve read {it.id}, which its worker does not hold")
        for iid in self.foreign:
            if iid not in seen:
                fail(f"queue server's item {iid} is lost: neither queued, held nor finished")
        for iid, i in self.open_items.items():
            if iid not in seen:
                fail(f"queue item {iid} is lost: neither queued, held nor finished")
            c = self.clients[i]
            if c.item == iid and (c.read is None) != (kinds.get(iid) == Kind.WRITE):
                fail(f"queue item {iid} of producer {c.producer} is of the wrong kind")
        for iid, where in seen.items():
            if iid not in self.open_items and iid not in self.foreign:
                fail(f"queue item {iid} is {where} but was finished")

    def busy(self) -> bool:
        return any(c.item is not None or c.retry_at is not None for c in self.clients)

    # -- the queue server's own items -------------------------------------------

    def submit_foreign(
        self,
        method: str,
        request: bytes,
        deadline: float,
        client: str,
        answer: Callable[[OpResult | None], None],
        serve: Callable[[SimNode, Item], OpResult] | None = None,
        judge: Callable[[SimNode, int, Item], None] | None = None,
    ) -> int:
        """A write the queue server submits itself (a split publish, or one
        of its parts; a consumer's offset commit); ``answer`` hears its
        result (None: failed, as a client's write), ``serve`` is how a
        leader answers it (None: it proposes it), ``judge`` what a leader
        does before proposing it (see ``Foreign``). Its id."""
        self.next_item += 1
        now = self.sim.now
        item = Item(self.next_item, Kind.WRITE, method, request, deadline, now, client=client)
        try:
            self.q.submit(item)
        except QueueFull:
            self.sim.checker.fail(f"queue full with {len(self.open_items)} items open")
        self.foreign[item.id] = Foreign(answer, serve, judge)
        return item.id

    def cancel_foreign(self, item_id: int) -> None:
        """Nobody waits for it any more (its publish's call ended): out of
        the queue if it is there (a worker holding it answers no one)."""
        if item_id not in self.foreign:
            return
        if self.q.cancel(item_id):  # it was queued: gone now
            del self.foreign[item_id]
        else:  # a worker holds it: its answer reaches no one (served, judged as before)
            f = self.foreign[item_id]
            self.foreign[item_id] = Foreign(lambda r: None, f.serve, f.judge)
        self.check()

    def final_checks(self, members: list[SimNode]) -> None:
        """Every acknowledged write is stored on every replica exactly once,
        at the offset its answer gave, and no write twice (retries
        included), on the toy state machine as on the real one."""
        fail = self.sim.checker.fail
        for n in members:
            stored = stored_writes(n.sm) if self.topic_ready else []
            counts: dict[tuple[int, int], int] = {}
            for w in stored:
                counts[w] = counts.get(w, 0) + 1
            twice = sorted(w for w, k in counts.items() if k > 1)
            if twice:
                fail(f"node {n.id} stored {len(twice)} writes more than once, e.g. {twice[:3]}")
            for (p, s), offset in sorted(self.acked.items()):
                if offset < 0:
                    continue  # the topic's creation
                if (p, s) not in counts:
                    fail(f"node {n.id} lacks acknowledged write {(p, s)}")
                if stored[offset] != (p, s):
                    fail(f"write {(p, s)} acknowledged at offset {offset} holds {stored[offset]}")
            if stored[: len(self.longest_read)] != self.longest_read:
                fail(f"node {n.id} holds other writes than a read returned")


def stored_writes(sm: object) -> list[tuple[int, int]]:
    """(producer, sequence) of every write stored in the topic, in offset
    order: the pings read back from the real state machine, or the toy's
    stored writes."""
    from tests.simulation.harness import RealStateMachine, StateMachine, toy_write

    if isinstance(sm, StateMachine):
        return [w for w in map(toy_write, sm.writes) if w is not None]
    assert isinstance(sm, RealStateMachine)
    batches, _ = sm.sm.read_range(TOPIC, 0, 0, 1 << 40)
    out = []
    for b in batches:
        for ts in columnar.decode(b.batch).ts_ms.tolist():
            out.append((ts // TS_BASE, ts % TS_BASE))
    return out
