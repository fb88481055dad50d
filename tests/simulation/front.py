"""The simulated front door: clients, one queue server (the real
``WorkQueues``) and the nodes as its workers, in virtual time.

Clients are idempotent producers: each sends one write at a time, tagged
with its producer id and a sequence, and until it is acknowledged sends the
same (producer, sequence) again after every failure: its item given up by
the queue (dropped on a worker's crash past its deadline, expired), an
UNAVAILABLE answer after too many retries, or its own deadline (it cancels
the item). A client is acknowledged only when the node that proposed its
write applied it and the worker's answer reached the queue server, as in
queue_server/server.py and node_daemon/worker.py: a node connects as a
worker when it starts and disconnects when it crashes (what it held goes
back to the queue), tells its role and indexes, grants credit and gets one
credit back per answer; only the leader takes writes; a node that is not
the leader, or whose proposal was overwritten, answers UNAVAILABLE and the
queue hands the item to another worker.

Checked after every queue operation: each open item is in exactly one
place (queued, or held by one connected worker), none is lost and none is
held twice. Checked at the end, on every converged replica: each
acknowledged write is stored exactly once, at the offset its answer gave
(on the real state machine its rows are read back; the toy one stores
writes in offset order and dedupes a resent (producer, sequence) as the
real one does), and no write is stored twice even when it was sent again.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from node_daemon.raft import Entry, PendingProposals, ProposalDropped, Ready, Role
from node_daemon.state.machine import OpResult, append_op
from queue_server.queues import Item, Kind, QueueFull, WorkQueues
from roadlog import columnar
from roadlog.columnar import PingColumns
from roadlog.v1 import client_pb2, command_pb2, topics_pb2

if TYPE_CHECKING:
    from tests.simulation.harness import SimNode, Simulation

TOPIC = "q"
# Write credit a worker grants when it connects: node_daemon.worker's
# WRITE_CREDIT, or a few, so that a proposal that is never answered (its
# entry overwritten or cut away and nothing else ever applied at its index)
# starves the queue and fails the run.
CREDITS = (4, 256)
MAX_ATTEMPTS = 50  # as queue_server.server: UNAVAILABLE answers before the client hears one
TS_BASE = 1 << 20  # a stored ping's ts_ms is producer * TS_BASE + sequence


@dataclass(slots=True)
class Client:
    producer: int
    seq: int = 0  # the sequence of the write in flight (or last acknowledged)
    item: int | None = None  # the queue item carrying it now
    deadline: int = 0  # virtual time the client stops waiting for ``item``
    retry_at: int | None = None  # when to send the same write again
    sent: int = 0  # how many times the current write was submitted


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
    topic_ready: bool = False
    sends: int = 0
    retries: int = 0
    # Without clients the queue sees only workers, and the run's history
    # (messages, faults) is the one of the Raft-only harness.
    with_clients: bool = True

    def __post_init__(self) -> None:
        n = self.rng.choice([1, 2, 3]) if self.with_clients else 0
        self.clients = [Client(producer=i + 1) for i in range(n)]
        self.p_submit = self.rng.choice([0.05, 0.1, 0.3])
        self.timeout = self.rng.choice([300, 1000, 3000])
        self.credit = self.rng.choice(CREDITS)
        if not self.sim.opts.real_sm:
            self.topic_ready = True  # the toy state machine has no topics

    # -- what a write is ----------------------------------------------------

    def command(self, c: Client) -> bytes:
        if not self.sim.opts.real_sm:
            return b"w%d.%d" % (c.producer, c.seq)
        if c.seq == 0:  # the first client's first write creates the topic
            from tests.simulation.harness import REGION

            spec = topics_pb2.TopicSpec(name=TOPIC, region_geojson=REGION, partitions=1)
            op = command_pb2.Op(create_topic=command_pb2.CreateTopicOp(spec=spec))
        else:
            cols = PingColumns.from_columns(
                [f"d{c.producer}"], [c.producer * TS_BASE + c.seq], [48.1], [11.5]
            )
            op = append_op(TOPIC, [(0, cols)], c.producer, c.seq, f"c{c.producer}")
        return command_pb2.Command(leader_ms=self.sim.now, ops=[op]).SerializeToString()

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
                if self.topic_ready:
                    c.seq += 1
                    self._submit(i)
                elif i == 0:  # the topic's creation is the first client's write 0
                    self._submit(i)
        for nid, wid in self.workers.items():
            core = self.sim.nodes[nid].core
            assert core is not None
            self.q.update(wid, core.role == Role.LEADER, core.term, self.sim.nodes[nid].sm.applied)
        self._expire()
        self._dispatch()
        self.check()

    def _submit(self, i: int) -> None:
        c = self.clients[i]
        self.next_item += 1
        now = self.sim.now
        data = self.command(c)
        item = Item(self.next_item, Kind.WRITE, "Publish", data, float(now + self.timeout), now)
        item.client = f"c{c.producer}"
        c.retry_at = None
        try:
            self.q.submit(item)
        except QueueFull:
            self.sim.checker.fail(f"queue full with {len(self.open_items)} items open")
        c.item, c.deadline, c.sent = item.id, now + self.timeout + 50, c.sent + 1
        self.sends += 1
        if c.sent > 1:
            self.retries += 1
        self.open_items[item.id] = i

    def _failed(self, i: int) -> None:
        """The client's request failed: send the same write again later."""
        c = self.clients[i]
        c.item = None
        c.retry_at = self.sim.now + self.rng.randint(1, 30)

    def _answer(self, item_id: int, result: OpResult | None) -> None:
        """The queue server answers the client waiting on ``item_id``, if
        any (a cancelled item's answer reaches no one)."""
        for i, c in enumerate(self.clients):
            if c.item != item_id:
                continue
            if result is None:
                self._failed(i)
                return
            self._acknowledge(c, result)
            c.item, c.sent = None, 0
            return

    def _acknowledge(self, c: Client, r: OpResult) -> None:
        if r.code != OpResult().code:
            self.sim.checker.fail(f"producer {c.producer} seq {c.seq} answered {r}")
        offset = -1
        if self.sim.opts.real_sm and c.seq == 0:
            self.topic_ready = True
        else:
            resp = client_pb2.PublishResponse.FromString(r.response)
            [o] = resp.offsets  # a retry stored before is answered with its first offsets
            if o.count != 1:
                self.sim.checker.fail(f"producer {c.producer} seq {c.seq} answered {o}")
            offset = o.base_offset
        self.acked[(c.producer, c.seq)] = offset

    # -- workers ----------------------------------------------------------------

    def connect(self, node: SimNode) -> None:
        self.next_item += 1
        wid = self.next_item
        self.workers[node.id] = wid
        self.q.connect(wid, node.id)
        self.q.grant(wid, self.credit, 0)

    def disconnect(self, node: SimNode) -> None:
        """The node crashed: its stream breaks; what it held goes back."""
        self.pending.pop(node.id, None)
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
            if w is None or it.id not in w.inflight:
                continue  # its node crashed while an earlier item was proposed
            self._work(self.sim.nodes[nodes[wid]], wid, it)

    def _work(self, node: SimNode, wid: int, it: Item) -> None:
        core = node.core
        assert core is not None
        if core.role != Role.LEADER:
            self._result(wid, it.id, None)  # NotLeader: UNAVAILABLE
            return
        try:
            index = core.propose_many([it.request])
        except ProposalDropped:
            self._result(wid, it.id, None)
            return
        self.pending.setdefault(node.id, PendingProposals()).add(index, core.term, (wid, it.id))
        node.process()

    def on_applied(self, node: SimNode, e: Entry, results: Callable[[], OpResult]) -> None:
        """As RaftNode._resolve: the proposer's pending write at ``e.index``
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
        """As RaftNode._ready_done: writes whose entry left the node's log
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
        """The worker's answer reaches the queue server, with one credit."""
        if wid not in self.q.workers:
            return  # its stream broke: the item was handed back already
        self.q.grant(wid, 1, 0)
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
        fail = self.sim.checker.fail
        for kind, queue in self.q.queues.items():
            for it in queue:
                if it.id in seen:
                    fail(f"queue item {it.id} is {seen[it.id]} and queued again")
                seen[it.id] = f"queued ({kind.name})"
        for w in self.q.workers.values():
            for iid, it in w.inflight.items():
                if iid != it.id:
                    fail(f"worker {w.id} holds item {it.id} under {iid}")
                if iid in seen:
                    fail(f"queue item {iid} is {seen[iid]} and held by worker {w.id}")
                seen[iid] = f"held by worker {w.id}"
        for iid in self.open_items:
            if iid not in seen:
                fail(f"queue item {iid} is lost: neither queued, held nor finished")
        for iid, where in seen.items():
            if iid not in self.open_items:
                fail(f"queue item {iid} is {where} but was finished")

    def busy(self) -> bool:
        return any(c.item is not None or c.retry_at is not None for c in self.clients)

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
