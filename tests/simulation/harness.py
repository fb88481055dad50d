"""A deterministic Raft cluster simulator: one seed drives everything.

N RaftCores in one process, each driven by the node daemon's own Ready loop
(``ReadyDriver``: early sends, writes that complete later, applies while a
write is in flight), over a simulated network that drops, duplicates,
delays (so reorders) and partitions messages; nodes crash and restart from
their storage (what the core held in memory is lost); membership changes,
log compactions, snapshot installs, leadership transfers and ReadIndex reads
happen at random. After every event the Raft invariants are checked; at the
end the network heals and every node must converge to the same state.

Clients write and read through the front door (``front.Front``): a real
``WorkQueues`` with the nodes as its workers, idempotent producers that send
a failed write again, acknowledgements only through that path, and reads
fenced at the client's acknowledged writes that any node may serve; the
queue's items are checked after every queue operation, every read must hold
the writes acknowledged up to its fence, and at the end every acknowledged
write must be stored once on every replica.

One seed in four or so runs several Raft groups on the same simulated
nodes (``Options.groups``; docs/multiraft.md): group 0 and data groups,
each a replica on every founding node with the real state machine where
the seed says so, over the same network (each message names its group),
each with clients and a queue of its own (the real ``WorkQueues``: each
group's leader takes its writes, as for a topic placed in data groups) and
the front door's checks. A data group's state machine here issues its own
producer ids, as group 0's does: the product's check of a data group's
producers against group 0, and fences per group, are not simulated yet.
Publishes whose pings span several data groups run too
(``split.SplitFront``): into group 0's queue, answered by its leader with
parts, each part a write of its group's queue, the client acknowledged
once every part is (the product's merge), retried with the same producer
id and sequence when the outcome is unknown; each acknowledged publish
must be stored once in every group it spans, no retry twice, nothing of
one refused for sure. Consumers read that topic on the data groups'
replicas and commit their offsets through group 0
(``consumers.ConsumerFront``), each commit judged first by group 0's
leader against the partition's data group (its replica, then a ReadIndex
of that group); an acknowledged or stored offset must never be ahead of
what the data group committed. A node crash takes every group's replica on it
down at once, a partition cuts every group's
messages between two nodes, and one node may lead several groups; each
group's invariants are checked on their own, and at the end every group
must converge with every acknowledged write.

A violation raises ``Violation`` with the seed; ``replay_command(seed)``
reproduces it exactly.
"""

from __future__ import annotations

import hashlib
import heapq
import os
import random
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from node_daemon.raft import (
    ApplyJob,
    ConfChange,
    ConfChangeType,
    Config,
    Entry,
    EntryType,
    LogStorage,
    LogWrite,
    MemoryStorage,
    Message,
    MessageType,
    ProposalDropped,
    RaftCore,
    Ready,
    ReadyDriver,
    Role,
    Snapshot,
    bootstrap,
)
from node_daemon.state.machine import StateMachine as NodeStateMachine
from node_daemon.state.producers import RECENT_SEQUENCES
from node_daemon.state.responses import OpResult
from node_daemon.storage.raft_log import LmdbLogStorage
from roadlog.errors import Code
from roadlog.geo import bbox_region
from roadlog.v1 import client_pb2, command_pb2, topics_pb2
from tests.simulation.consumers import ConsumerFront
from tests.simulation.front import Front
from tests.simulation.split import SplitFront, creation_ops

TICK = 10  # time units per tick; message delays are in time units
# Where LMDB seeds keep their files: in memory where the machine has a
# tmpfs. A simulated crash closes and reopens the files, so what fsync buys
# is never tested here, and on a busy disk its waits were most of the time
# these seeds took.
SCRATCH = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


class Violation(AssertionError):
    """A Raft invariant does not hold."""


def replay_command(seed: int) -> str:
    return f"make sim SEEDS=1 START={seed}"


# --------------------------------------------------------------- state machine


class StateMachine:
    """Applies entries into a hash chain and the set of proposal ids; with
    ``writes``, it stores clients' writes (``w<producer>.<sequence>``) as
    the node's StateMachine stores a producer's appends: in offset order,
    each (producer, sequence) once. It keeps each producer's last
    RECENT_SEQUENCES sequences with their offsets; a write sent again is
    answered with its first offset (``duplicate``) and not stored again,
    one older than those is refused (FAILED_PRECONDITION). Unlike the node's
    answer to a duplicate, the toy's carries the index that answered it as
    its read fence (the write is applied at or below it).

    It survives a crash (in roadlog the state machine is applied in the same
    LMDB transaction as its applied index)."""

    def __init__(self, writes: bool = True) -> None:
        self.applied = 0
        self.digest = b"\0" * 32
        self.proposals: set[bytes] = set()
        self.with_writes = writes
        self.writes: list[bytes] = []  # stored client writes, by offset
        self.recent: dict[int, list[tuple[int, int]]] = {}  # producer -> (sequence, offset)
        self.last_result = OpResult()  # the answer for the entry applied last
        # Parts of split publishes (split.toy_part_key), a topic of their own:
        # partition -> (producer, sequence) by offset; each stored part's key
        # and (partition, offset)s; producer -> (sequence, stored part).
        self.split: dict[int, list[tuple[int, int]]] = {}
        self.split_keys: list[bytes] = []
        self.split_at: list[list[tuple[int, int]]] = []
        self.split_recent: dict[int, list[tuple[int, int]]] = {}
        # Consumers' offsets committed (consumers.toy_commit_key): (consumer
        # group, partition) -> offset, the last one applied.
        self.offsets: dict[tuple[str, int], int] = {}

    def apply(self, e: Entry) -> None:
        if e.index != self.applied + 1:
            raise Violation(f"applied {e.index} after {self.applied}")
        h = hashlib.sha256(self.digest)
        h.update(struct.pack(">QQB", e.index, e.term, int(e.type)))
        h.update(e.data)
        self.digest = h.digest()
        self.applied = e.index
        self.last_result = OpResult()
        if e.type == EntryType.NORMAL and e.data:
            self.proposals.add(e.data)
            w = toy_write(e.data) if self.with_writes else None
            if w is not None:
                self.last_result = self._store(e.data, *w, e.index)
            elif self.with_writes and e.data.startswith(b"s"):
                self.last_result = self._store_part(e.data, e.index)
            elif self.with_writes and e.data.startswith(b"o"):
                self.last_result = self._store_offset(e.data, e.index)

    def _store(self, key: bytes, producer: int, seq: int, index: int) -> OpResult:
        """Store a client's write unless it is a duplicate; its answer."""
        seen = self.recent.get(producer, [])
        resp = client_pb2.PublishResponse(applied_index=index)
        dup = self._duplicate(seen, seq)
        if dup is not None:
            resp.duplicate = True
            offset = dup
        elif seen and seq < seen[-1][0]:
            return OpResult(
                Code.FAILED_PRECONDITION,
                f"sequence {seq} of producer {producer} is older than the last "
                f"{RECENT_SEQUENCES} it stored",
            )
        else:
            offset = len(self.writes)
            self.writes.append(key)
            self.recent[producer] = [*seen, (seq, offset)][-RECENT_SEQUENCES:]
        resp.offsets.add(partition=0, base_offset=offset, count=1)
        return OpResult(response=resp.SerializeToString())

    def _store_part(self, key: bytes, index: int) -> OpResult:
        """Store a split publish's part (its pings in its partitions) unless
        its (producer, sequence) was stored before (then answered with the
        first offsets, as the node's state machine answers a retried span)."""
        from tests.simulation.split import parse_toy_part

        producer, seq, _ = parse_toy_part(key)
        seen = self.split_recent.get(producer, [])
        resp = client_pb2.PublishResponse(applied_index=index)
        dup = self._duplicate(seen, seq)
        if dup is not None:
            resp.duplicate = True
            at = self.split_at[dup]
        elif seen and seq < seen[-1][0]:
            return OpResult(Code.FAILED_PRECONDITION, f"sequence {seq} of {producer} is too old")
        else:
            at = self._add_part(key)
        for p, offset in at:
            resp.offsets.add(partition=p, base_offset=offset, count=1)
        return OpResult(response=resp.SerializeToString())

    def _store_offset(self, key: bytes, index: int) -> OpResult:
        """Store a consumer's committed offset, as the node's state machine
        does for a topic placed in data groups: no end checked at apply
        (its leader judged it before proposing)."""
        from tests.simulation.consumers import parse_toy_commit

        group, partition, offset = parse_toy_commit(key)
        self.offsets[(group, partition)] = offset
        return OpResult(
            response=client_pb2.CommitOffsetsResponse(applied_index=index).SerializeToString()
        )

    def _add_part(self, key: bytes) -> list[tuple[int, int]]:
        from tests.simulation.split import parse_toy_part

        producer, seq, partitions = parse_toy_part(key)
        at = []
        for p in partitions:
            rows = self.split.setdefault(p, [])
            at.append((p, len(rows)))
            rows.append((producer, seq))
        self.split_recent[producer] = [
            *self.split_recent.get(producer, []),
            (seq, len(self.split_keys)),
        ][-RECENT_SEQUENCES:]
        self.split_keys.append(key)
        self.split_at.append(at)
        return at

    def _duplicate(self, seen: list[tuple[int, int]], seq: int) -> int | None:
        """The offset ``seq`` was stored at, if it is one of ``seen``."""
        return next((o for s, o in seen if s == seq), None)

    def serialize(self) -> bytes:
        return b"".join(
            [
                struct.pack(">Q", self.applied),
                self.digest,
                *sorted(p + b"\n" for p in self.proposals),
                b"\0",
                b"\n".join(self.writes),
                *([b"\0", b"\n".join(self.split_keys)] if self.split_keys or self.offsets else []),
                *([b"\0", self._offset_lines()] if self.offsets else []),
            ]
        )

    def _offset_lines(self) -> bytes:
        from tests.simulation.consumers import toy_commit_key

        return b"\n".join(toy_commit_key(g, p, o) for (g, p), o in sorted(self.offsets.items()))

    def restore(self, data: bytes) -> None:
        self.applied = struct.unpack_from(">Q", data)[0]
        self.digest = data[8:40]
        proposals, _, rest = data[40:].partition(b"\0")
        writes, _, rest = rest.partition(b"\0")
        parts, _, offsets = rest.partition(b"\0")
        self.proposals = {p for p in proposals.split(b"\n") if p}
        self.writes = [w for w in writes.split(b"\n") if w]
        self.split, self.split_keys, self.split_at, self.split_recent = {}, [], [], {}
        for key in parts.split(b"\n"):
            if key:
                self._add_part(key)
        self.offsets = {}
        for key in offsets.split(b"\n"):
            if key:
                self._store_offset(key, 0)
        self.recent = {}
        for offset, key in enumerate(self.writes):
            w = toy_write(key)
            assert w is not None
            self.recent[w[0]] = [*self.recent.get(w[0], []), (w[1], offset)][-RECENT_SEQUENCES:]

    def lacks(self, acked: set[bytes]) -> set[bytes]:
        return acked - self.proposals

    def state_digest(self) -> bytes:
        return self.digest

    def reopen(self) -> None:
        pass

    def close(self) -> None:
        pass


def toy_write(data: bytes) -> tuple[int, int] | None:
    """(producer, sequence) of a client's write to the toy state machine."""
    if not data.startswith(b"w"):
        return None
    producer, _, seq = data[1:].partition(b".")
    return int(producer), int(seq)


class RealStateMachine:
    """The node daemon's own StateMachine (LMDB in the run's temp dir) under
    the toy's interface. Each proposal is a real Command (``proposal_command``)
    whose effect can be looked up, so an acknowledged proposal is something
    every converged replica must hold; ``state_digest`` is the real state's SHA-256 over
    every table. Beside it runs the toy's hash chain over the applied
    entries: the checker compares that at every index (the real digest
    reads the whole state, too dear to take per entry).

    It survives a crash (closed and reopened from its files); a snapshot is
    a compact copy of its LMDB file, which ``restore`` installs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sm = NodeStateMachine(path / "state", map_size=SM_MAP_BYTES)
        self.chain = StateMachine(writes=False)  # index order and per-index digests
        self.snapshots = 0
        self.last_results: list[OpResult] = []

    @property
    def applied(self) -> int:
        return self.chain.applied

    @property
    def digest(self) -> bytes:
        return self.chain.digest

    def apply(self, e: Entry) -> None:
        self.chain.apply(e)  # raises Violation on a gap or a double apply
        if self.sm.applied_index != e.index - 1:
            raise Violation(f"state machine at {self.sm.applied_index} is given entry {e.index}")
        [self.last_results] = self.sm.apply([e])

    def serialize(self) -> bytes:
        self.snapshots += 1
        dest = self.path / f"snap-{self.snapshots}.mdb"
        index, _ = self.sm.write_snapshot(dest)
        if index != self.applied:
            raise Violation(f"snapshot copy at {index}, applied {self.applied}")
        return struct.pack(">Q", index) + self.chain.digest + str(dest).encode()

    def restore(self, data: bytes) -> None:
        index = struct.unpack_from(">Q", data)[0]
        self.sm.install_snapshot(data[40:].decode())
        if self.sm.applied_index != index:
            raise Violation(f"installed snapshot {index} holds state at {self.sm.applied_index}")
        self.chain.restore(data[:40])

    def lacks(self, acked: set[bytes]) -> set[bytes]:
        topics = {t.topic.spec.name for t in self.sm.list_topics()}
        peers = self.sm.peers()
        missing = set()
        for d in acked:
            op = proposal_op(d)
            if op.HasField("create_topic"):
                found = op.create_topic.spec.name in topics
            else:
                found = peers.get(op.add_peer.node_id) == op.add_peer.address
            if not found:
                missing.add(d)
        return missing

    def state_digest(self) -> bytes:
        return self.sm.digest()

    def reopen(self) -> None:
        """A crash: the state is what its files hold."""
        self.sm.close()
        self.sm = NodeStateMachine(self.path / "state", map_size=SM_MAP_BYTES)

    def close(self) -> None:
        self.sm.close()


SM_MAP_BYTES = 64 << 20
REGION = bbox_region(11.4, 48.05, 11.75, 48.25).geojson


def proposal_command(n: int, leader_ms: int) -> bytes:
    """Proposal ``n`` for the real state machine: one in four creates topic
    ``p<n>`` (its answer describes the topic), the others add ``p<n>`` to
    the replicated address book (cheaper: no region to parse)."""
    if n % 4 == 0:
        spec = topics_pb2.TopicSpec(name=f"p{n}", region_geojson=REGION, partitions=1)
        op = command_pb2.Op(create_topic=command_pb2.CreateTopicOp(spec=spec))
    else:
        op = command_pb2.Op(add_peer=command_pb2.AddPeerOp(node_id=PEER_BASE + n, address=f"p{n}"))
    return command_pb2.Command(leader_ms=leader_ms, ops=[op]).SerializeToString()


PEER_BASE = 1 << 32  # proposals' address-book ids, far from the nodes'


def proposal_op(data: bytes) -> command_pb2.Op:
    op: command_pb2.Op = command_pb2.Command.FromString(data).ops[0]
    return op


# --------------------------------------------------------------------- options


@dataclass(slots=True)
class Options:
    """Everything a seed decides about its run."""

    n_nodes: int
    lmdb: bool
    chaos_ticks: int
    drop: float
    duplicate: float
    max_delay: int  # time units
    p_propose: float
    p_crash: float
    p_partition: float
    p_heal: float
    p_conf: float
    p_compact: float
    p_transfer: float
    p_read: float
    max_inflight: int
    max_msg_bytes: int
    max_msg_entries: int
    early_send: bool  # a leader's appends go out before its own write is durable
    write_delay: int  # time units a write takes; 0: synchronous
    p_crash_in_ready: float  # a crash in the middle of handling one Ready
    lazy_commit: bool  # the commit index rides on the next append or tick (as in the node)
    # While a write is in flight, a leader's appends go out and entries
    # committed and already on disk are applied (as in the node).
    mid_write: bool
    # The node daemon's StateMachine on LMDB instead of the toy hash chain
    # (decided by the seed alone, like lmdb: no draw from the seed's stream).
    real_sm: bool
    # Raft groups on the nodes: group 0 and groups-1 data groups (decided by
    # the seed alone: the other seeds' histories stay as they were).
    groups: int

    @classmethod
    def from_seed(cls, seed: int, rng: random.Random) -> Options:
        return cls(
            n_nodes=rng.choice([1, 3, 3, 3, 5, 5]),
            lmdb=seed % 8 == 0,  # one seed in eight runs on real LMDB files
            chaos_ticks=rng.randint(150, 350),
            drop=rng.choice([0.0, 0.02, 0.1, 0.2]),
            duplicate=rng.choice([0.0, 0.02, 0.1]),
            max_delay=rng.choice([2, 5, 15, 40]),
            p_propose=rng.uniform(0.1, 0.6),
            p_crash=rng.choice([0.0, 0.005, 0.02]),
            p_partition=rng.choice([0.0, 0.01, 0.03]),
            p_heal=rng.uniform(0.02, 0.1),
            p_conf=rng.choice([0.0, 0.01, 0.03]),
            p_compact=rng.choice([0.0, 0.02, 0.1]),
            p_transfer=rng.choice([0.0, 0.005, 0.02]),
            p_read=rng.choice([0.0, 0.05]),
            max_inflight=rng.choice([1, 4, 64]),
            max_msg_bytes=rng.choice([64, 1024, 1 << 20]),
            max_msg_entries=rng.choice([2, 4096]),
            early_send=rng.random() < 0.5,
            write_delay=rng.choice([0, 0, 3, 12]),
            p_crash_in_ready=rng.choice([0.0, 0.0005, 0.002]),
            lazy_commit=rng.random() < 0.5,
            mid_write=rng.random() < 0.5,
            real_sm=seed % 8 == 0,
            groups=3 if seed % 4 == 2 or seed % 16 == 8 else 1,
        )


# ------------------------------------------------------------------------ nodes


class SimNode:
    """One node: its storage and state machine (which survive a crash), and
    while it is up a RaftCore driven by the node daemon's ReadyDriver, whose
    I/O is simulated here: writes complete after ``write_delay`` (an event
    of their own), applies at once, sends go to the simulated network."""

    def __init__(self, sim: Simulation, node_id: int, storage_dir: Path | None) -> None:
        self.sim = sim
        self.id = node_id
        self.storage_dir = storage_dir
        self.storage: LogStorage = self._open_storage()
        self.sm: StateMachine | RealStateMachine = (
            RealStateMachine(sim.tmp / f"sm{node_id}")
            if sim.opts.real_sm and sim.tmp is not None
            else StateMachine()
        )
        self.core: RaftCore | None = None
        self.driver: ReadyDriver | None = None
        self.pending: LogWrite | None = None  # a write in flight
        self.restarts = 0

    def _open_storage(self) -> LogStorage:
        if self.storage_dir is None:
            return MemoryStorage()
        return LmdbLogStorage(self.storage_dir, map_size=8 << 20)

    def start(self) -> None:
        snap = self.storage.snapshot()
        if self.sm.applied < snap.meta.index:
            # Crashed between saving a snapshot and installing it: install it now.
            self.sm.restore(snap.data)
            self.sim.checker.on_snapshot_installed(self, snap)
        opts = self.sim.opts
        cfg = Config(
            self.id,
            election_tick=10,
            heartbeat_tick=1,
            max_size_per_msg=opts.max_msg_bytes,
            max_entries_per_msg=opts.max_msg_entries,
            max_inflight_msgs=opts.max_inflight,
            applied=self.sm.applied,
            lazy_commit=opts.lazy_commit,
        )
        rng = random.Random(self.sim.seed * 7919 + self.id * 104729 + self.restarts)
        self.core = RaftCore(cfg, self.storage, rng)
        self.driver = ReadyDriver(
            self.core,
            write_log=self._write_log,
            apply=self._apply,
            send=self._send,
            clock=lambda: float(self.sim.now),
            on_ready_done=self._ready_done,
            early_send=opts.early_send,
            work_during_write=opts.mid_write,
        )
        self.sim.front.connect(self)  # its worker's stream to the queue server

    def crash(self) -> None:
        """Lose everything in memory; the storage keeps what it persisted."""
        if self.driver is not None:
            self.driver.stop()
        self.sim.front.disconnect(self)
        self.core = None
        self.driver = None
        self.pending = None
        self.restarts += 1
        self.sm.reopen()
        if isinstance(self.storage, LmdbLogStorage):
            self.storage.close()
            self.storage = self._open_storage()

    def close(self) -> None:
        self.sm.close()
        if isinstance(self.storage, LmdbLogStorage):
            self.storage.close()

    def process(self) -> None:
        """Let the driver do what it can: Readys until there are none or a
        write is in flight; while one is (``mid_write``), what the core lets
        go before it is durable."""
        if self.driver is not None:
            self.driver.pump()

    # -- the driver's I/O ------------------------------------------------------

    def _send(self, msgs: list[Message]) -> None:
        for m in msgs:
            self.sim.net.send(m)

    def _write_log(self, w: LogWrite) -> bool:
        if self._crash_point():
            return False  # before the write: it is lost
        if self.sim.opts.write_delay:
            self.pending = w
            self.sim.net.schedule_write(self)
            return False
        return self._persist(w)

    def complete_write(self) -> None:
        assert self.pending is not None and self.driver is not None
        w, self.pending = self.pending, None
        if self._persist(w):
            self.driver.write_done(w)
            self.driver.pump()

    def _persist(self, w: LogWrite) -> bool:
        """The write lands; False when the node crashes right after it."""
        self.storage.save(w.hard_state, w.entries, w.snapshot, sync=w.sync)
        self.sim.checker.on_persist(self, w.entries)
        return not self._crash_point()  # written, but nothing else happened

    def _apply(self, job: ApplyJob) -> bool:
        check = self.sim.checker
        if job.snapshot is not None:
            self.sm.restore(job.snapshot.data)
            check.on_snapshot_installed(self, job.snapshot)
        for e in job.entries:
            self.sm.apply(e)
            check.on_apply(self, e)
        return True

    def _ready_done(self, rd: Ready, w: LogWrite) -> None:
        for rs in rd.read_states:
            self.sim.checker.on_read_state(self, rs.index, rs.context)
            waiter = self.sim.read_waiters.pop(rs.context, None)
            if waiter is not None:  # a ReadIndex taken for someone (consumers.py)
                waiter(rs.index)
        self.sim.front.on_log_written(self, rd)

    def _crash_point(self) -> bool:
        sim = self.sim
        if sim.chaos and sim.rng.random() < sim.opts.p_crash_in_ready:
            sim.crash(self)
            return True
        return False


# ---------------------------------------------------------------------- network


@dataclass(frozen=True, slots=True)
class WriteDone:
    """The write of a node's in-flight Ready completes (unless it crashed)."""

    node: int
    incarnation: int
    group: int = 0


@dataclass(frozen=True, slots=True)
class SnapshotReport:
    """The transport's word to a leader on a snapshot it sent."""

    node: int
    incarnation: int
    to: int
    ok: bool
    group: int = 0


Sent = Message | tuple[int, Message]  # a data group's message travels with its group


class Network:
    """One network for every group: a partition cuts all of them; a data
    group's messages are queued as ``(group, message)``."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.queue: list[tuple[int, int, Sent | WriteDone | SnapshotReport]] = []
        self.seq = 0
        self.cut: set[frozenset[int]] = set()

    def send(self, m: Message, group: int = 0) -> None:
        sim, rng = self.sim, self.sim.group_rng(group)
        if rng.random() < sim.fault_rate(sim.opts.drop):
            self._lost(m, group)
            return
        copies = 2 if rng.random() < sim.fault_rate(sim.opts.duplicate) else 1
        item: Sent = m if group == 0 else (group, m)
        for _ in range(copies):
            delay = rng.randint(1, sim.opts.max_delay if sim.chaos else 2)
            self.seq += 1
            heapq.heappush(self.queue, (sim.now + delay, self.seq, item))

    def schedule_write(self, node: SimNode, group: int = 0) -> None:
        self.seq += 1
        due = self.sim.now + self.sim.group_rng(group).randint(1, self.sim.opts.write_delay)
        heapq.heappush(self.queue, (due, self.seq, WriteDone(node.id, node.restarts, group)))

    def _lost(self, m: Message, group: int = 0) -> None:
        if m.type == MessageType.SNAPSHOT:
            self._report_snapshot(m, False, group)

    def _report_snapshot(self, m: Message, ok: bool, group: int = 0) -> None:
        """The transport tells the sender how its snapshot went, as a later
        event (never from inside the sender's own Ready handling)."""
        sender = self.sim.group_nodes(group).get(m.frm)
        if sender is not None:
            self.seq += 1
            report = SnapshotReport(m.frm, sender.restarts, m.to, ok, group)
            heapq.heappush(self.queue, (self.sim.now + 1, self.seq, report))

    def deliver_due(self) -> None:
        sim = self.sim
        while self.queue and self.queue[0][0] <= sim.now:
            _, _, item = heapq.heappop(self.queue)
            if isinstance(item, WriteDone):
                node = sim.group_nodes(item.group)[item.node]
                if node.restarts == item.incarnation and node.pending is not None:
                    node.complete_write()
                    sim.after_event()
                continue
            if isinstance(item, SnapshotReport):
                node = sim.group_nodes(item.group)[item.node]
                if node.restarts == item.incarnation and node.core is not None:
                    node.core.report_snapshot(item.to, item.ok)
                    node.process()
                continue
            group, m = item if isinstance(item, tuple) else (0, item)
            dst = sim.group_nodes(group).get(m.to)
            if dst is None or dst.core is None or frozenset((m.frm, m.to)) in self.cut:
                self._lost(m, group)
                continue
            dst.core.step(m)
            dst.process()
            if m.type == MessageType.SNAPSHOT:
                self._report_snapshot(m, True, group)
            sim.after_event()


# ---------------------------------------------------------------------- checker


@dataclass
class Checker:
    """The Raft invariants (Figure 3 of the paper), checked as the run goes."""

    sim: Simulation
    leader_of_term: dict[int, int] = field(default_factory=dict)
    entry_at: dict[tuple[int, int], tuple[bytes, int]] = field(default_factory=dict)
    applied_at: dict[int, tuple[int, bytes]] = field(default_factory=dict)
    digest_at: dict[int, bytes] = field(default_factory=dict)
    max_committed: tuple[int, int] = (0, 0)  # (index, term) committed somewhere
    commit_seen: dict[int, int] = field(default_factory=dict)
    leaders_checked: set[tuple[int, int]] = field(default_factory=set)
    reads: dict[bytes, int] = field(default_factory=dict)  # context -> floor index
    reads_served: int = 0
    label: str = ""  # which group, in a multi-group seed ("" for group 0)

    def fail(self, what: str) -> None:
        raise Violation(f"seed {self.sim.seed} at t={self.sim.now}: {self.label}{what}")

    def on_persist(self, node: SimNode, entries: list[Entry]) -> None:
        """Log matching: one (index, term) names one entry and one history."""
        st = node.storage
        for e in entries:
            if e.index < st.first_index():
                continue
            try:
                prev = st.term(e.index - 1)
            except Exception:
                prev = -1
            key = (e.index, e.term)
            seen = self.entry_at.setdefault(key, (e.data, prev))
            if seen[0] != e.data:
                self.fail(f"log matching: two entries at {key} on node {node.id}")
            if prev >= 0 and seen[1] >= 0 and seen[1] != prev:
                self.fail(
                    f"log matching: {key} follows term {prev} on node {node.id}, "
                    f"{seen[1]} elsewhere"
                )

    def on_apply(self, node: SimNode, e: Entry) -> None:
        """State machine safety: every node applies the same entry at an index."""
        seen = self.applied_at.setdefault(e.index, (e.term, e.data))
        if seen != (e.term, e.data):
            self.fail(
                f"state machine safety: node {node.id} applied a different entry at {e.index}"
            )
        d = self.digest_at.setdefault(e.index, node.sm.digest)
        if d != node.sm.digest:
            self.fail(f"state machine safety: node {node.id} diverged at {e.index}")
        if e.index > self.max_committed[0]:
            self.max_committed = (e.index, e.term)
        self.sim.on_applied(node, e)

    def on_snapshot_installed(self, node: SimNode, snap: Snapshot) -> None:
        i = snap.meta.index
        d = self.digest_at.get(i)
        if d is not None and d != node.sm.digest:
            self.fail(f"snapshot at {i} installed on node {node.id} differs from the applied state")
        if node.sm.applied != i:
            self.fail(f"snapshot says {i} but carries state applied to {node.sm.applied}")

    def on_read_state(self, node: SimNode, index: int, ctx: bytes) -> None:
        floor = self.reads.pop(ctx, None)
        if floor is None:
            return
        if index < floor:
            self.fail(f"ReadIndex {index} on node {node.id} misses write acknowledged at {floor}")
        self.reads_served += 1

    def after_event(self) -> None:
        for node in self.sim.nodes.values():
            core = node.core
            if core is None:
                continue
            c = core.log.committed
            # Commit only moves forward while the node is up.
            prev = self.commit_seen.get(node.id, 0)
            if c < prev:
                self.fail(f"commit index of node {node.id} went back from {prev} to {c}")
            self.commit_seen[node.id] = c
            if c > self.max_committed[0] and c >= core.log.first_index():
                self.max_committed = (c, core.log.term(c))
            if core.role != Role.LEADER:
                continue
            # Election safety: at most one leader per term.
            owner = self.leader_of_term.setdefault(core.term, node.id)
            if owner != node.id:
                self.fail(
                    f"election safety: nodes {owner} and {node.id} both lead term {core.term}"
                )
            key = (node.id, core.term)
            if key not in self.leaders_checked:
                self.leaders_checked.add(key)
                self._check_leader_completeness(node, core)

    def _check_leader_completeness(self, node: SimNode, core: RaftCore) -> None:
        index, term = self.max_committed
        if index == 0 or index < core.log.first_index() - 1:
            return  # covered by the leader's snapshot
        if index > core.log.last_index() or core.log.term_or_zero(index) != term:
            self.fail(
                f"leader completeness: leader {node.id} of term {core.term} lacks committed "
                f"entry {index} (term {term})"
            )


# ------------------------------------------------------------------- simulation


@dataclass
class Result:
    seed: int
    ok: bool
    message: str = ""
    ticks: int = 0
    acked: int = 0
    applied: int = 0
    snapshots: int = 0
    crashes: int = 0
    conf_changes: int = 0
    reads: int = 0
    writes: int = 0  # client writes acknowledged through the queue server
    resent: int = 0  # writes a client sent again after a failure
    fetches: int = 0  # fenced reads through the queue server, answered and checked
    refetched: int = 0  # reads sent again by their client or handed to another node
    data_groups: int = 0  # Raft groups beside group 0 on the same nodes
    data_acked: int = 0  # proposals acknowledged in the data groups
    data_writes: int = 0  # client writes acknowledged in the data groups
    multi_led: int = 0  # ticks at whose end one node led more than one group
    split_acked: int = 0  # publishes over several data groups acknowledged (split.py)
    split_refused: int = 0  # split publishes refused for sure (a ping outside the region)
    split_resent: int = 0  # split publishes sent again after an unknown outcome
    split_parts: int = 0  # parts handed to the data groups' leaders
    offset_commits: int = 0  # consumers' offset commits acknowledged (consumers.py)
    offset_refused: int = 0  # refused as past the partition's end
    offset_read_index: int = 0  # judged again after a ReadIndex of the data group
    offset_missing_group: int = 0  # refused NOT_FOUND by a leader lagging the group's join
    offset_not_caught_up: int = 0  # sent back by a new leader not yet caught up


class GroupOps:
    """What a Raft group of the simulation does and is checked for, the
    same for group 0 (``Simulation``) and a data group (``DataGroup``)."""

    nodes: dict[int, SimNode]
    opts: Options
    rng: random.Random
    proposed: dict[bytes, tuple[int, int, int]]  # id -> (node, index, term)
    acked: set[bytes]
    next_proposal: int
    checker: Checker
    stats: Result
    label: str = ""
    # ReadIndex contexts someone waits on (consumers.py): context -> who
    # hears the index, when the read state reaches the node that asked.
    read_waiters: dict[bytes, Callable[[int], None]]

    now: int

    def leader(self) -> SimNode | None:
        best: SimNode | None = None
        for n in self.nodes.values():
            if (
                n.core is not None
                and n.core.role == Role.LEADER
                and (best is None or best.core is None or n.core.term > best.core.term)
            ):
                best = n
        return best

    def _live(self) -> list[SimNode]:
        return [n for n in self.nodes.values() if n.core is not None]

    def _propose(self, count: int) -> None:
        lead = self.leader()
        if lead is None or lead.core is None:
            return
        ids = []
        for _ in range(count):
            self.next_proposal += 1
            n = self.next_proposal
            if self.opts.real_sm:
                ids.append(proposal_command(n, self.now))
            else:
                ids.append(b"%sp%d" % (self.label.encode(), n))
        try:
            first = lead.core.propose_many(ids)
        except ProposalDropped:
            return
        for i, pid in enumerate(ids):
            self.proposed[pid] = (lead.id, first + i, lead.core.term)
        lead.process()

    def _compact(self) -> None:
        live = self._live()
        if not live:
            return
        node = self.rng.choice(live)
        core = node.core
        assert core is not None
        index = node.sm.applied  # the snapshot holds the state machine as applied now
        if node.pending is not None or index < node.storage.first_index():
            return  # nothing new to compact, or a write (maybe a snapshot) in flight
        snap = Snapshot(core.snapshot_meta_at(index), node.sm.serialize())
        node.storage.compact(snap)
        self.stats.snapshots += 1

    def _transfer(self) -> None:
        lead = self.leader()
        if lead is None or lead.core is None:
            return
        voters = sorted(lead.core.conf.voters - {lead.id})
        if voters:
            try:
                lead.core.transfer_leader(self.rng.choice(voters))
            except ProposalDropped:
                return
            lead.process()

    def _members(self) -> list[SimNode]:
        lead = self.leader()
        if lead is None or lead.core is None:
            return []
        return [self.nodes[i] for i in sorted(lead.core.conf.members) if i in self.nodes]

    def _group_converged(self) -> bool:
        lead = self.leader()
        if lead is None or lead.core is None:
            return False
        core = lead.core
        if (
            core.log.committed != core.log.last_index()
            or core.log.term(core.log.committed) != core.term
        ):
            return False
        target = core.log.committed
        return all(n.core is not None and n.sm.applied == target for n in self._members())

    def _group_final_checks(self) -> list[SimNode]:
        """The group's replicas agree and hold every acknowledged write; its members."""
        members = self._members()
        digests = {n.sm.digest for n in members}
        if len(digests) != 1:
            self.checker.fail(f"replicas differ at the end: {self._describe_group()}")
        if len({n.sm.state_digest() for n in members}) != 1:
            self.checker.fail(f"replicas' state differs at the end: {self._describe_group()}")
        for n in members:
            missing = n.sm.lacks(self.acked)
            if missing:
                self.checker.fail(
                    f"node {n.id} lacks {len(missing)} acknowledged proposals, "
                    f"e.g. {sorted(missing)[:3]}"
                )
        return members

    def _describe_group(self) -> str:
        parts = [self.label] if self.label else []
        for n in self.nodes.values():
            c = n.core
            if c is None:
                parts.append(f"n{n.id}:down")
            else:
                parts.append(
                    f"n{n.id}:{c.role.name[0]} t{c.term} c{c.log.committed} a{n.sm.applied} "
                    f"l{c.log.last_index()} conf={sorted(c.conf.voters)}/{sorted(c.conf.learners)}"
                )
        return "; ".join(parts)


class Simulation(GroupOps):
    MAX_NODES = 7

    def __init__(self, seed: int, opts: Options | None = None, clients: bool = True) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.opts = opts or Options.from_seed(seed, self.rng)
        self.now = 0
        self.chaos = True
        self.net = Network(self)
        self.checker = Checker(self)
        self.nodes: dict[int, SimNode] = {}
        self.tmp: Path | None = (
            Path(tempfile.mkdtemp(prefix="roadlog-sim-", dir=SCRATCH)) if self.opts.lmdb else None
        )
        self.proposed: dict[bytes, tuple[int, int, int]] = {}  # id -> (node, index, term)
        self.acked: set[bytes] = set()
        self.next_proposal = 0
        self.read_waiters = {}
        self.down_until: dict[int, int] = {}
        self.stats = Result(seed, True)
        # The clients and the queue server draw from a stream of their own.
        self.front = Front(self, random.Random(seed * 1_000_003 + 0xF2), with_clients=clients)
        voters = list(range(1, self.opts.n_nodes + 1))
        for i in voters:
            node = self._add_node(i)
            bootstrap(node.storage, voters)
            node.start()
        # Data groups: a replica on each founding node, over the same network.
        self.data = [DataGroup(self, g) for g in range(1, self.opts.groups)]
        self.stats.data_groups = len(self.data)
        # Publishes split across the data groups (split.py), with a stream
        # of their own: only in seeds with data groups and clients.
        self.split: SplitFront | None = None
        if self.data and clients:
            self.split = SplitFront(self, random.Random(seed * 1_000_039 + 0x5B))
            for dg in self.data:
                if self.opts.real_sm:
                    dg.front.extra_create_ops = creation_ops(self.split.producers)
        # Consumers of the split topic, committing offsets through group 0
        # (consumers.py), with a stream of their own: with the split clients.
        self.consumers: ConsumerFront | None = None
        if self.split is not None:
            self.consumers = ConsumerFront(self, random.Random(seed * 1_000_039 + 0xC0))
            if self.opts.real_sm:
                self.front.extra_create_ops = self.consumers.creation_ops()

    def group_nodes(self, group: int) -> dict[int, SimNode]:
        """Group ``group``'s replicas by node id."""
        return self.nodes if group == 0 else self.data[group - 1].nodes

    def group_rng(self, group: int) -> random.Random:
        """The random stream of what happens to group ``group``'s messages
        and writes (a data group's own: group 0's history is as it would
        be without data groups, but where a crash of theirs meets it)."""
        return self.rng if group == 0 else self.data[group - 1].rng

    def after_event(self) -> None:
        """Every group's invariants, after anything happened."""
        self.checker.after_event()
        for dg in self.data:
            dg.checker.after_event()

    def _add_node(self, node_id: int) -> SimNode:
        d = self.tmp / f"n{node_id}" if self.tmp is not None else None
        node = SimNode(self, node_id, d)
        self.nodes[node_id] = node
        return node

    def fault_rate(self, p: float) -> float:
        return p if self.chaos else 0.0

    # -- what clients see ------------------------------------------------------

    def on_applied(self, node: SimNode, e: Entry) -> None:
        self.front.on_applied(node, e, lambda: self._result_of(node))
        p = self.proposed.get(e.data)
        if p is not None and p[0] == node.id and p[1] == e.index and p[2] == e.term:
            self.acked.add(e.data)  # the proposer applied it: the client got its ack
            if isinstance(node.sm, RealStateMachine):
                self._check_ack(node.sm.last_results, e)

    def _result_of(self, node: SimNode) -> OpResult:
        """What the worker answers for the entry the node just applied: its
        first op's result (a client's command is one op, or a topic create
        followed by the producer ids it issues); an append's is its span's."""
        if not isinstance(node.sm, RealStateMachine):
            return node.sm.last_result
        r = node.sm.last_results[0]
        return r.spans[0] if r.spans else r

    def _check_ack(self, results: list[OpResult], e: Entry) -> None:
        """What the client is told: its topic, created at the entry's index."""
        ok = OpResult().code  # a result's code when the operation succeeded
        if len(results) != 1 or results[0].code != ok:
            self.checker.fail(f"proposal at {e.index} acknowledged with {results}")
        op = proposal_op(e.data)
        if not op.HasField("create_topic"):
            return
        desc = topics_pb2.TopicDescription.FromString(results[0].response)
        if desc.topic.spec.name != op.create_topic.spec.name or desc.applied_index != e.index:
            self.checker.fail(
                f"acknowledgement of {e.index} says topic {desc.topic.spec.name!r} "
                f"at {desc.applied_index}"
            )

    # -- the run ---------------------------------------------------------------

    def run(self) -> Result:
        try:
            self._run()
        except Violation as v:
            self.stats.ok = False
            msg = str(v)
            self.stats.message = msg if msg.startswith("seed ") else f"seed {self.seed}: {msg}"
        except Exception as e:  # a crash of the core is a violation too
            self.stats.ok = False
            self.stats.message = f"seed {self.seed} at t={self.now}: {type(e).__name__}: {e}"
        finally:
            self.close()
        self.stats.ticks = self.now // TICK
        self.stats.acked = len(self.acked)
        self.stats.writes = len(self.front.acked)
        self.stats.resent = self.front.retries
        self.stats.fetches = self.front.reads_ok
        self.stats.refetched = self.front.reads_resent + self.front.reads_handed_again
        self.stats.reads = self.checker.reads_served
        return self.stats

    def close(self) -> None:
        """Close every node's files and remove the run's directory (``run``
        does it; a simulation built and not run must be closed)."""
        for n in self.nodes.values():
            n.close()
        for dg in self.data:
            for n in dg.nodes.values():
                n.close()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _run(self) -> None:
        for _ in range(self.opts.chaos_ticks):
            self._tick()
            self._chaos()
        self._heal()
        for _ in range(600):
            self._tick()
            if self._converged():
                self._final_checks()
                return
        raise Violation(
            f"seed {self.seed}: no convergence 600 ticks after healing: {self._describe()}"
        )

    def _tick(self) -> None:
        end = self.now + TICK
        while self.now < end:
            self.now += 1
            self.net.deliver_due()
        for nid in sorted(self.down_until):
            if self.down_until[nid] <= self.now:
                del self.down_until[nid]
                self._restart(nid)
        for group in (self, *self.data):
            for n in group.nodes.values():
                if n.core is not None:
                    n.core.tick()
                    n.process()
        self.front.step()
        for dg in self.data:
            dg.front.step()
        if self.split is not None:
            self.split.step()
        if self.consumers is not None:
            self.consumers.step()
        self.after_event()
        if self.data:
            led = [g.leader() for g in (self, *self.data)]
            ids = [n.id for n in led if n is not None]
            if len(ids) != len(set(ids)):
                self.stats.multi_led += 1

    def _restart(self, nid: int) -> None:
        """Node ``nid`` comes back: its replica of every group."""
        for group in (self, *self.data):
            node = group.nodes.get(nid)
            if node is None or node.core is not None:
                continue  # not a replica here, or one that runs (never started twice)
            node.start()
            group.checker.commit_seen.pop(nid, None)
            node.process()

    def _chaos(self) -> None:
        o, rng = self.opts, self.rng
        if rng.random() < o.p_propose:
            self._propose(rng.randint(1, 4))
        if rng.random() < o.p_crash:
            self._crash_one()
        if rng.random() < o.p_partition:
            self._partition()
        if self.net.cut and rng.random() < o.p_heal:
            self.net.cut.clear()
        if rng.random() < o.p_conf:
            self._conf_change()
        if rng.random() < o.p_compact:
            self._compact()
        if rng.random() < o.p_transfer:
            self._transfer()
        if rng.random() < o.p_read:
            self._read()
        for dg in self.data:  # the data groups' own proposals, compactions, transfers
            if dg.rng.random() < o.p_propose:
                dg._propose(dg.rng.randint(1, 4))
            if dg.rng.random() < o.p_compact:
                dg._compact()
            if dg.rng.random() < o.p_transfer:
                dg._transfer()
        self.after_event()

    def _crash_one(self) -> None:
        live = self._live()
        if not live:
            return
        lead = self.leader()
        node = lead if lead is not None and self.rng.random() < 0.4 else self.rng.choice(live)
        self.crash(node)

    def crash(self, node: SimNode, rng: random.Random | None = None) -> None:
        """Node ``node.id`` goes down: its replica of every group at once
        (for a time drawn from ``rng``: the stream of the group that crashed it)."""
        node = self.nodes[node.id]
        node.crash()
        for dg in self.data:
            replica = dg.nodes.get(node.id)
            if replica is not None and replica.core is not None:
                replica.crash()
        self.stats.crashes += 1
        self.down_until[node.id] = self.now + (rng or self.rng).randint(1, 60) * TICK

    def _partition(self) -> None:
        ids = sorted(self.nodes)
        if len(ids) < 2:
            return
        side = set(self.rng.sample(ids, self.rng.randint(1, len(ids) - 1)))
        for a in side:
            for b in ids:
                if b not in side:
                    self.net.cut.add(frozenset((a, b)))

    def _conf_change(self) -> None:
        lead = self.leader()
        if lead is None or lead.core is None:
            return
        conf = lead.core.conf
        rng = self.rng
        choice = rng.random()
        if choice < 0.4 and len(self.nodes) < self.MAX_NODES:
            cc = ConfChange(ConfChangeType.ADD_LEARNER, max(self.nodes) + 1)
        elif choice < 0.7 and conf.learners:
            cc = ConfChange(ConfChangeType.ADD_VOTER, rng.choice(sorted(conf.learners)))
        elif len(conf.voters) >= 3:
            cc = ConfChange(ConfChangeType.REMOVE_NODE, rng.choice(sorted(conf.voters)))
        else:
            return
        try:
            lead.core.propose_conf_change(cc)
        except ProposalDropped:
            return
        self.stats.conf_changes += 1
        if cc.type == ConfChangeType.ADD_LEARNER:
            node = self._add_node(cc.node_id)
            node.start()
        lead.process()

    def _read(self) -> None:
        live = self._live()
        if not live:
            return
        node = self.rng.choice(live)
        assert node.core is not None
        self.next_proposal += 1
        ctx = b"r%d" % self.next_proposal
        floor = max((self.proposed[p][1] for p in self.acked), default=0)
        try:
            node.core.read_index(ctx)
        except ProposalDropped:
            return
        self.checker.reads[ctx] = floor
        node.process()

    def _heal(self) -> None:
        self.chaos = False
        self.net.cut.clear()
        for nid in sorted(self.down_until):
            self._restart(nid)
        self.down_until.clear()

    # -- the end ---------------------------------------------------------------

    def _converged(self) -> bool:
        if self.front.busy() or any(dg.front.busy() for dg in self.data):
            return False
        if self.split is not None and self.split.busy():
            return False
        if self.consumers is not None and self.consumers.busy():
            return False
        return self._group_converged() and all(dg._group_converged() for dg in self.data)

    def _final_checks(self) -> None:
        members = self._group_final_checks()
        for dg in self.data:
            dg.front.final_checks(dg._group_final_checks())
            self.stats.data_acked += len(dg.acked)
            self.stats.data_writes += len(dg.front.acked)
        self.front.final_checks(members)
        if self.split is not None:
            self.split.final_checks()
            self.stats.split_acked = len(self.split.history.acked)
            self.stats.split_refused = len(self.split.history.refused)
            self.stats.split_resent = self.split.resent
            self.stats.split_parts = self.split.parts_sent
        if self.consumers is not None:
            self.consumers.final_checks(members)
            self.stats.offset_commits = len(self.consumers.history.acked)
            self.stats.offset_refused = len(self.consumers.history.refused)
            self.stats.offset_read_index = self.consumers.read_indexes
            self.stats.offset_missing_group = self.consumers.missing_groups
            self.stats.offset_not_caught_up = self.consumers.not_caught_up
        self.stats.applied = members[0].sm.applied if members else 0

    def _describe(self) -> str:
        return "; ".join([self._describe_group(), *(dg._describe_group() for dg in self.data)])


class GroupNet:
    """The simulation's one network as a data group's replicas use it."""

    def __init__(self, net: Network, group: int) -> None:
        self.net = net
        self.group = group

    def send(self, m: Message) -> None:
        self.net.send(m, self.group)

    def schedule_write(self, node: SimNode) -> None:
        self.net.schedule_write(node, self.group)


class DataGroup(GroupOps):
    """One data group of a multi-group seed: a replica on each founding
    node (toy state machine), its own checker, proposals and random stream;
    the clock, network, partitions and crashes are the simulation's. To its
    SimNodes and its Checker it stands where the Simulation stands."""

    def __init__(self, sim: Simulation, group: int) -> None:
        self.sim = sim
        self.group = group
        self.label = f"g{group}:"
        self.opts = sim.opts
        self.rng = random.Random(sim.seed * 1_000_033 + group)  # its own stream
        self.net = GroupNet(sim.net, group)
        # Its own clients and queue (the real WorkQueues), as a topic placed
        # in data groups is written: each group's leader takes its writes.
        self.front = Front(
            self,  # type: ignore[arg-type]
            random.Random(sim.seed * 1_000_037 + group),
            with_clients=sim.front.with_clients,
        )
        self.checker = Checker(self, label=f"group {group}: ")  # type: ignore[arg-type]
        self.tmp = sim.tmp / f"g{group}" if sim.tmp is not None else None
        self.proposed = {}
        self.acked = set()
        self.next_proposal = 0
        self.read_waiters = {}
        self.nodes = {}
        voters = sorted(sim.nodes)
        for i in voters:
            node = SimNode(self, i, self.tmp / f"n{i}" if self.tmp is not None else None)  # type: ignore[arg-type]
            self.nodes[i] = node
            bootstrap(node.storage, voters)
            node.start()

    # -- where the Simulation's own stand ------------------------------------

    @property
    def now(self) -> int:  # type: ignore[override]
        return self.sim.now

    @property
    def seed(self) -> int:
        return self.sim.seed

    @property
    def chaos(self) -> bool:
        return self.sim.chaos

    @property
    def stats(self) -> Result:  # type: ignore[override]
        return self.sim.stats

    def fault_rate(self, p: float) -> float:
        return self.sim.fault_rate(p)

    def crash(self, node: SimNode) -> None:
        self.sim.crash(node, self.rng)  # the node, so every group's replica on it

    def on_applied(self, node: SimNode, e: Entry) -> None:
        self.front.on_applied(node, e, lambda: self.sim._result_of(node))
        p = self.proposed.get(e.data)
        if p is not None and p == (node.id, e.index, e.term):
            self.acked.add(e.data)  # the proposer applied it: acknowledged


def run_seed(seed: int) -> Result:
    return Simulation(seed).run()


def options_of(seed: int) -> Options:
    """What ``Simulation(seed)`` decides, without building it (no files)."""
    return Options.from_seed(seed, random.Random(seed))
