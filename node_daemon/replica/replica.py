"""Replica: the Raft core driven by asyncio, a leader's LMDB off the event loop.

One driver task owns the core (a data group in a Store: the process's
round, ``replica.round``, which turns every woken group once a pass and
then flushes frames and the group commit once for all). Everything else
(peer messages, proposals, timer ticks, admin requests) reaches it as a
callable in the inbox. The
Ready loop itself (send what may go early, persist, send the rest, apply,
advance; apply committed entries already on disk while a write runs) is
``raft.driver.ReadyDriver``, shared with the simulation and the unit tests;
this module gives it its I/O: one LMDB transaction and one fsync per Ready
in the log's thread, applies inline or in the state machine's thread, the
peer transport. While no group on the event loop leads, a Ready's write is
done on the loop itself (``_writes_inline``): a follower has nothing else to do
meanwhile, and saves the thread hops and their wake-ups of every round.
Completions come back as ``write_done``/``apply_done`` on the event loop.
While a write is in flight the driver task keeps stepping the core with
what arrives, and proposals that arrive pile up into the next Ready: group
commit comes from that, one fsync for all of them.

Writes are batched on the way in too: publish operations that arrive
together are packed into one entry (at most ``max_ops_per_entry`` ops and
``limits.ENTRY_BYTES`` bytes, or one bigger op alone).

Callers wait for their proposals in ``raft.PendingProposals`` (answered when
applied, or failed when their entry leaves the log); when to snapshot and
compact the log is ``snapshots.Snapshots``.

A replica that starts with an empty log (a new node, or one whose disk was
wiped or replaced) catches up before it votes: ``catching_up``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from node_daemon import metrics
from node_daemon.config import NodeConfig
from node_daemon.raft import (
    ApplyJob,
    ConfChange,
    Config,
    ConfState,
    Entry,
    LogWrite,
    Message,
    MessageType,
    PendingProposals,
    ProposalDropped,
    RaftCore,
    Ready,
    ReadyDriver,
    Role,
    StorageFullError,
)
from node_daemon.replica import catching_up
from node_daemon.replica.commands import Proposal, in_time, packed
from node_daemon.replica.gauges import GroupGauges
from node_daemon.replica.held_back import answer_held_back
from node_daemon.replica.log_clock import (
    ANCHOR_FILE,
    LogClock,
    Reading,
    decode_reading,
    encode_reading,
)
from node_daemon.replica.opening import open_group
from node_daemon.replica.remote import ReplicaView
from node_daemon.replica.round import Round
from node_daemon.replica.snapshots import Snapshots
from node_daemon.replica.tick_due import LazyTicks, tick_n
from node_daemon.state import unsynced
from node_daemon.state.clients import UsedNames
from node_daemon.state.machine import trim_op
from node_daemon.state.op_gate import admit
from node_daemon.state.responses import OpResult
from node_daemon.storage import damage
from node_daemon.storage.disk import DiskGuard
from node_daemon.storage.group_commit import GroupCommit
from node_daemon.storage.group_logs import group_data_dir
from node_daemon.storage.io_thread import IoThread
from node_daemon.transport.peer_transport import GroupEndpoint, PeerTransport
from roadlog import round_trace
from roadlog.errors import Code, RoadlogError
from roadlog.v1 import command_pb2

log = logging.getLogger("roadlog.node")


# Committed entries up to this size are applied on the event loop (see _apply).
INLINE_APPLY_BYTES = 256 << 10
# While no group on the event loop leads, log writes up to this size are
# done on it (see _writes_inline).
FOLLOWER_INLINE_BYTES = 4 << 20
# A leader alone on its loop whose proposals come one at a time writes up to
# this size on the loop too (see _writes_inline).
LEADER_INLINE_BYTES = 256 << 10
# Entries answered as they commit are stored this many turns of the event
# loop later: their answers reach the queue server's link in the third turn
# (the proposal's callbacks, the call's task, the link's writer), so the
# store is off the write path (see _apply_job).
STORE_AFTER_TURNS = 4


_REPLICATE_SECONDS = metrics.STAGE_SECONDS.labels("replicate")


class NotLeader(Exception):
    def __init__(self, leader: int, reason: str = "not the leader") -> None:
        super().__init__(reason)
        self.leader = leader


_Futures = list[asyncio.Future[OpResult]]  # one per op of a proposed entry


class Replica:
    """One Raft group's replica on this node. ``group`` 0 (the default) is
    the metadata group, which owns the peer transport unless one is given;
    a data group is given group 0's ``transport`` and shares its links."""

    def __init__(
        self,
        cfg: NodeConfig,
        group: int = 0,
        transport: PeerTransport | None = None,
        commits: GroupCommit | None = None,
        round: Round | None = None,
    ) -> None:
        """``round``: driven by the process's round with its other groups
        (``replica.round``: one Ready pass a turn for all), not by a driver
        task of its own."""
        self.cfg = cfg
        self._round = round
        self.id = cfg.node_id
        self.group = group
        # Every group this node runs, by number (Store fills it in; a
        # node run alone runs its own group only).
        self.raft_groups: dict[int, ReplicaView] = {group: self}
        # The groups whose I/O shares this node's event loop (Store
        # sets them; see _writes_inline).
        self.loop_mates: list[Replica] = [self]
        data = group_data_dir(Path(cfg.data_dir), group)
        # A data group's log is in its process's log store (``commits``),
        # written with its other groups' (group commit across groups).
        self._commits = commits
        store = commits.store if commits is not None else None
        opened = open_group(cfg, group, data, store)  # the log, the state, catching up
        self.log_store, self.log_set_aside, self.boot = opened.log, opened.set_aside, opened.boot
        self.state_rebuilt, self.sm = opened.state_rebuilt, opened.sm
        self._others = sorted(set(cfg.peers) - {self.id})  # peers to ask whether all is new
        behind = opened.behind
        # Set while catching up; None once that is over for good.
        self._catching_up_file: Path | None = opened.catching_up_file
        self._snapshot_gauge = opened.snapshot_gauge
        # What this node stamps its entries with as a leader: its wall clock,
        # but never a step of it (see log_clock); it goes on from the log's.
        self.log_clock = LogClock(self.sm.log_ms, data / ANCHOR_FILE, boot=lambda: self.boot)
        # The log clock readings granted votes carried in the term of
        # ``_readings_term`` (voter -> reading), and the term the log clock
        # last took them up in (``LogClock.lead``): once per leadership.
        self._vote_readings: dict[int, Reading] = {}
        self._readings_term = 0
        self._clock_led_term = 0
        self.core = RaftCore(
            Config(
                self.id,
                election_tick=cfg.election_ticks,
                heartbeat_tick=cfg.heartbeat_ticks,
                applied=self.sm.applied_index,
                lazy_commit=True,
                catching_up=behind,
                # A granted vote carries this node's log clock reading (what
                # a leader without a measure takes up: log_clock.py).
                vote_context=lambda: encode_reading(self.log_clock.reading()),
            ),
            self.log_store,
            random.Random(int.from_bytes(os.urandom(8), "big")),
        )
        # The log's writes, in order (the store's thread: every group's of it).
        self._log_io = store.io if store is not None else IoThread("raft-log")
        self.snapshots = Snapshots(
            data / "snapshots",
            self.log_store,
            self.sm,
            self.core.snapshot_meta_at,
            self._log_io,
            lambda: self._wake(),
            cfg.snapshot_entries,
            cfg.snapshot_bytes,
            index_gauge=self._snapshot_gauge,
            write_rate=cfg.snapshot_mib_per_s * (1 << 20) or None,
        )
        self.addresses: dict[int, str] = dict(cfg.peers)
        self.addresses[self.id] = cfg.address
        endpoint = GroupEndpoint(
            on_message=self._on_message,
            on_unreachable=lambda to: self.submit(lambda core: core.report_unreachable(to)),
            on_snapshot_status=lambda to, ok: self.submit(
                lambda core: core.report_snapshot(to, ok)
            ),
            snapshot_file=self.snapshots.shipped,
            snapshot_dir=self.snapshots.directory,
        )
        self._owns_transport = transport is None
        if transport is None:
            if group != 0:
                raise ValueError("a data group shares group 0's transport")
            transport = PeerTransport(
                self.id,
                cfg.cluster_name,
                cfg.secret(),
                endpoint.snapshot_dir,
                endpoint.on_message,
                endpoint.on_unreachable,
                endpoint.on_snapshot_status,
                endpoint.snapshot_file,
            )
            transport.set_addresses(self.addresses)
        else:
            transport.add_group(group, endpoint)
        self.transport = transport
        self._inbox: deque[Callable[[RaftCore], None]] = deque()
        self._wakeup: asyncio.Event = asyncio.Event()
        # Proposals waiting for the driver: (op, its future, its deadline).
        self._ops: list[Proposal] = []
        self._ops_taken = asyncio.Event()  # set while no proposal waits for the driver
        self._ops_taken.set()
        self._pending: PendingProposals[_Futures] = PendingProposals()
        # The last proposal came while an earlier one was still unanswered
        # (see _writes_inline).
        self._proposals_overlap = False
        self._reads: dict[bytes, asyncio.Future[int]] = {}
        self._read_seq = 0
        # Who waits for the applied index to move: (until what, told by).
        self._applied_waiters: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []
        self._busy: asyncio.Task[None] | None = None  # a round's group compacting its log
        self._apply_io = IoThread("apply")
        self._stopping = False
        self._tasks: list[asyncio.Task[None]] = []
        self._failure: BaseException | None = None  # of a write or an apply: fatal
        # Answers told for entries being written: (index and term of each,
        # the state's generation, the answers or None where only their apply
        # can tell); see _predict.
        self._predicted: tuple[list[tuple[int, int]], int, list[list[OpResult]] | None] | None = (
            None
        )
        # Out of space is not fatal: the write or apply is retried until it
        # goes through, and growing proposals are refused meanwhile.
        self.disk = DiskGuard(str(data), cfg.min_free_bytes, time.monotonic)
        self._full_logged = float("-inf")
        self._notified_applied = self.sm.applied_index
        self._loop: asyncio.AbstractEventLoop
        # The one Ready loop (persist, send, apply, advance); this class gives
        # it its I/O: LMDB writes on the log's thread, applies inline or on the
        # apply thread, the peer transport, and the clock that times writes.
        self.driver = ReadyDriver(
            self.core,
            write_log=self._write_log,
            apply=self._apply_job,
            send=self.transport.sender(group),
            clock=time.perf_counter,
            on_ready_done=self._ready_done,
        )
        self.state_listeners: list[Callable[[], None]] = []
        self.last_heard: dict[int, float] = {}  # peer -> when a message last came from it
        self._last_soft = (0, Role.FOLLOWER, 0)
        self._gauges = GroupGauges(group, self.id)
        self._next_trim = 0.0  # set at the first tick
        self.clients_used = UsedNames()  # group 0's: identities seen used, for the next trim
        self.ticks = LazyTicks(cfg.tick_ms / 1000)  # with the Store's ticker (``owe_ticks``)

    # --------------------------------------------------------------- inputs

    def _on_message(self, m: Any) -> None:
        self.last_heard[m.frm] = time.monotonic()
        if m.type == MessageType.VOTE_RESP and not m.reject:
            self._heard_vote(m)
        self.submit(lambda core: core.step(m))

    def _heard_vote(self, m: Message) -> None:
        """Keep the log clock reading a granted vote carries (for
        ``LogClock.lead``)."""
        reading = decode_reading(m.context)
        if reading is None:
            return
        if m.term != self._readings_term:
            self._readings_term, self._vote_readings = m.term, {}
        self._vote_readings[m.frm] = reading

    def update_addresses(self, known: dict[int, str]) -> None:
        """Learn peer addresses (from the replicated address book and from
        discovery); this node's own address always stays its own. The
        transport's are set by the group that owns it."""
        merged = {**self.addresses, **known, self.id: self.cfg.address}
        if merged != self.addresses:
            self.addresses = merged
            if self._owns_transport:
                self.transport.set_addresses(merged)

    def _wake(self) -> None:
        """There is work for the driver: its task's, or the round's pass."""
        if self._round is not None:
            self._round.wake(self)
        else:
            self._wakeup.set()

    def submit(self, fn: Callable[[RaftCore], None]) -> None:
        """Run ``fn(core)`` on the driver (the only place the core is touched)."""
        if self.ticks.on:
            self.owe_ticks(time.monotonic())
        self._inbox.append(fn)
        self._wake()

    def owe_ticks(self, now: float) -> None:
        """Lazy ticks: a tick queued for every tick boundary that passed by
        ``now``, before any input after it (``tick_due.LazyTicks``)."""
        n = self.ticks.owed(now)
        if n:
            self._inbox.append(lambda core: tick_n(core, n))
            self._wake()

    def lazy_tick(self, now: float) -> None:
        """The Store's ticker, at or after ``ticks.due_at`` (or for the
        chores, at least every LAZY_CHORES_S): the ticks owed, and the
        chores that ride on ticks (``chores``)."""
        self.owe_ticks(now)
        self.chores(now)

    def propose_op(
        self, op: command_pb2.Op, deadline: float | None = None
    ) -> asyncio.Future[OpResult]:
        """Replicate one operation: a future of its result once applied here
        (await it), or of NotLeader when this node cannot take it (the
        client retries). ``deadline`` (monotonic): if the op has not entered
        the log by then (the loop was paused, or busy), it never does:
        DEADLINE_EXCEEDED. A future, not a coroutine: a caller that hangs a
        callback on it (the merged publishes) runs in the loop turn after
        the apply, with no task between (bench/profiles/write-path.md,
        session 26)."""
        fut: asyncio.Future[OpResult] = asyncio.get_running_loop().create_future()
        try:
            if self.core.role != Role.LEADER:
                raise NotLeader(self.core.lead)
            kind = op.WhichOneof("op")
            self.disk.refuse(kind, self.id)
            # What a member's older release would skip (issue 39, op_gate).
            conf = self.core.conf
            levels = self.transport.peer_op_levels
            admit(op, kind, self.id, conf.voters, conf.learners, levels)
        except Exception as e:
            fut.set_exception(e)
            return fut
        if self.ticks.on:
            self.owe_ticks(time.monotonic())  # the ticks before it, first
        self._ops.append((op, fut, deadline))
        self._ops_taken.clear()
        self._wake()
        t0 = time.perf_counter()
        fut.add_done_callback(lambda _: _REPLICATE_SECONDS.observe(time.perf_counter() - t0))
        return fut

    async def proposals_taken(self) -> None:
        """Wait until the driver has taken every proposal made so far into
        the log (or refused it). While it is busy persisting the previous
        entries, callers can gather more work for the next entry."""
        await self._ops_taken.wait()

    async def read_barrier(self) -> int:
        """A linearizable read point (ReadIndex): wait until this node has
        applied it, then return it."""
        self._read_seq += 1
        ctx = f"{self.id}:{self._read_seq}".encode()
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._reads[ctx] = fut

        def ask(core: RaftCore) -> None:
            try:
                core.read_index(ctx)
            except ProposalDropped as e:
                self._reads.pop(ctx, None)
                if not fut.done():
                    fut.set_exception(NotLeader(e.leader, e.reason))

        self.submit(ask)
        try:
            index = await fut
        finally:
            self._reads.pop(ctx, None)
        await self.wait_applied(index)
        return index

    @property
    def caught_up_as_leader(self) -> bool:
        """Leading, and every write committed before this term is applied
        here (``RaftCore.leads_caught_up``)."""
        return self.core.leads_caught_up(self.sm.applied_index)

    async def wait_caught_up_as_leader(self, timeout: float) -> None:
        """Wait until ``caught_up_as_leader``, or until this node is not the
        leader (the caller then refuses as it would); UNAVAILABLE (try
        again) if it does not catch up within ``timeout`` seconds."""

        if self.caught_up_as_leader or not self.is_leader:
            return
        try:
            await self._until_applied(
                lambda: self.caught_up_as_leader or not self.is_leader, timeout
            )
        except TimeoutError:
            if self.is_leader:
                raise RoadlogError(
                    Code.UNAVAILABLE, "a new leader is still applying what was committed: try again"
                ) from None

    async def wait_applied(self, index: int, timeout: float | None = None) -> None:
        await self._until_applied(lambda: self.sm.applied_index >= index, timeout)

    async def _until_applied(self, done: Callable[[], bool], timeout: float | None) -> None:
        """Wait until ``done()``, asked again whenever the applied index
        moves (TimeoutError after ``timeout`` seconds)."""
        if done():
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._applied_waiters.append((done, fut))
        await asyncio.wait_for(fut, timeout)

    def _notify_applied(self) -> None:
        """The applied index moved: answer the waiters it satisfies (and
        forget those that gave up)."""
        waiting, self._applied_waiters = self._applied_waiters, []
        for done, fut in waiting:
            if fut.done():
                continue
            if done():
                fut.set_result(None)
            else:
                self._applied_waiters.append((done, fut))

    async def conf_change(self, cc: ConfChange) -> int:
        """Propose a configuration change; returns its index once that very
        entry is applied. Waiting for the applied index alone is not enough:
        if leadership changes first, another entry may take that index, and
        the change never happened. Like an op's, the entry waits in
        ``PendingProposals`` by (index, term); a lost one raises NotLeader."""
        loop = asyncio.get_running_loop()
        proposed: asyncio.Future[int] = loop.create_future()
        done: asyncio.Future[OpResult] = loop.create_future()

        def do(core: RaftCore) -> None:
            try:
                index = core.propose_conf_change(cc)
            except ProposalDropped as e:
                proposed.set_exception(NotLeader(e.leader, e.reason))
                return
            self._pending.add(index, core.term, [done])
            proposed.set_result(index)

        self.submit(do)
        index = await proposed
        await asyncio.wait_for(asyncio.shield(done), 30)
        return index

    async def transfer_leader(self, target: int) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def do(core: RaftCore) -> None:
            try:
                core.transfer_leader(target)
                fut.set_result(None)
            except ProposalDropped as e:
                fut.set_exception(NotLeader(e.leader, e.reason))

        self.submit(do)
        await fut

    # ----------------------------------------------------------------- state

    @property
    def is_leader(self) -> bool:
        return self.core.role == Role.LEADER

    @property
    def serving(self) -> bool:
        """Ready to serve (what /readyz and NodeStatus.ready say): knows a
        leader, heard from it lately, and has applied what it knows committed.
        (Not ``RaftCore.ready()``, the core's next batch of work.)"""
        core = self.core
        if core.lead == 0:
            return False
        heard = core.role == Role.LEADER or core.election_elapsed < 2 * core.cfg.election_tick
        return heard and self.sm.applied_index >= core.log.committed

    def address_of(self, node: int) -> str:
        return self.addresses.get(node, "")

    # What another group of this node reads of this one (the same calls as a
    # replica run by another process answers: ``remote.RemoteReplica``).

    def committed_index(self) -> int:
        """The commit index this replica knows of."""
        return self.core.log.committed

    def conf_state(self) -> ConfState:
        """The group's latest configuration (voters, learners)."""
        return self.core.conf

    # ----------------------------------------------------------------- driver

    async def start(
        self,
        on_failure: Callable[[BaseException], None] | None = None,
        own_ticker: bool = True,
        lazy_ticks: bool = False,
    ) -> None:
        """Start ticking and driving. If the driver fails (a log write or an
        apply failed: the node cannot go on safely), ``on_failure`` is told,
        so the process stops instead of living on with a dead Raft loop.
        ``own_ticker`` False: whoever runs this node's groups calls
        ``tick()`` for all of them at once (their heartbeats then leave
        together, Store), or with ``lazy_ticks``, ``lazy_tick`` at
        ``ticks.due_at`` (``owe_ticks``)."""
        loop = self._loop = asyncio.get_running_loop()
        if lazy_ticks and not own_ticker:
            self.ticks.start(time.monotonic())
        self._tasks = []
        if self._round is not None:
            self._round.add(self, on_failure)
        else:
            drive = loop.create_task(self._drive())
            self._tasks.append(drive)
        if own_ticker:
            self._tasks.append(loop.create_task(self._ticker()))
        if self.core.catching_up and self._others:
            ask = catching_up.ask_if_new(
                self.core, self.cfg.peers, self._others, self.group, self.submit
            )
            self._tasks.append(loop.create_task(ask))

        def done(t: asyncio.Task[None]) -> None:
            if t.cancelled() or t.exception() is None:
                return
            log.critical("the Raft driver failed", exc_info=t.exception())
            if on_failure is not None:
                on_failure(t.exception())  # type: ignore[arg-type]

        if self._round is None:
            drive.add_done_callback(done)

    async def stop(self) -> None:
        self._stopping = True
        self.driver.stop()
        if self._round is not None:
            self._round.remove(self)
        if self._busy is not None:
            self._tasks.append(self._busy)
        self._fail_lost(self._pending.drain())
        self._wake()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t  # a failed driver was reported when it failed
        if self._owns_transport:
            await self.transport.close()
        else:  # the group's snapshot timers and fetches die with the transport's
            self.transport.groups.pop(self.group, None)
        await self.snapshots.taken()
        self.snapshots.close()
        if self._commits is None:  # a store's thread is the store's to end
            self._log_io.shutdown(wait=True)
        self._apply_io.shutdown(wait=True)
        self.sm.checkpoint()
        self.sm.close()
        unsynced.synced(self.sm.path)
        self.log_store.close()

    def _caught_up(self) -> None:
        """Catching up ended and is on disk: forget it for good."""
        path, self._catching_up_file = self._catching_up_file, None
        assert path is not None
        catching_up.caught_up(path, self.core.term)

    async def _ticker(self) -> None:
        period = self.cfg.tick_ms / 1000
        nxt = time.monotonic()
        while True:
            nxt += period
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))
            self.tick()

    def tick(self) -> None:
        """One Raft tick (every ``tick_ms``), and the chores that ride on it:
        the log clock's anchor, and retention as leader."""
        self.submit(lambda core: core.tick())
        self.chores(time.monotonic())

    def chores(self, now: float) -> None:
        """What rides on ticks: the log clock's anchor (saved at most every
        second), and retention as leader (every ``trim_interval_s``)."""
        self.log_clock.save()  # at most every second
        if self._next_trim == 0.0:
            self._next_trim = now + self.cfg.trim_interval_s
        elif self.is_leader and now >= self._next_trim:
            self._next_trim = now + self.cfg.trim_interval_s
            self._trim()

    def _trim(self) -> None:
        """Retention goes through the log, so every replica trims the same
        (pings, heat maps but each topic's newest windows, per-client
        records, the producer ids found expired, group 0's idle identities)."""

        async def trim() -> None:
            expired = await asyncio.to_thread(self.sm.expirable_producers)
            used, zero = self.clients_used.take(), self.group == 0
            op = trim_op(expired_producers=expired, clients_used=used, forget_idle_clients=zero)
            await self.propose_op(op)

        fut = asyncio.get_running_loop().create_task(trim())
        fut.add_done_callback(lambda f: f.exception())  # a lost trim is retried next time

    def _drain(self) -> None:
        core = self.core
        while self._inbox:
            fn = self._inbox.popleft()
            fn(core)
        if self._ops:
            self._propose_ops()

    def _propose_ops(self) -> None:
        round_trace.mark("propose")
        ops, self._ops = self._ops, []
        self._ops_taken.set()
        core = self.core
        if core.role != Role.LEADER:
            for _, fut, _ in ops:
                if not fut.done():
                    fut.set_exception(NotLeader(core.lead))
            return
        ops = in_time(ops, time.monotonic())
        if not ops:
            return
        if self._clock_led_term != core.term:
            # The first stamp of this leadership: a leader that has no
            # measure of the log's clock takes one from its voters.
            self._clock_led_term = core.term
            readings = self._vote_readings if self._readings_term == core.term else {}
            self.log_clock.lead(readings.values())
        now_ms = self.log_clock.stamp()  # not time.time(): a step of it is not believed
        groups, datas = packed(ops, now_ms, self.cfg.max_ops_per_entry)
        self._proposals_overlap = len(self._pending) > 0
        try:
            first = core.propose_many(datas)
        except ProposalDropped as e:
            for _, fut, _ in ops:
                if not fut.done():
                    fut.set_exception(NotLeader(e.leader, e.reason))
            return
        for i, g in enumerate(groups):
            self._pending.add(first + i, core.term, [fut for _, fut, _ in g])
        metrics.PROPOSED_OPS.inc(len(ops))
        if self.sm.applied_index == first - 1:
            # Nothing before them is left to apply: their answers can be
            # told now, off the write path (the next turn of the loop, once
            # the APPENDs are out), and sent the moment they commit.
            entries = [Entry(core.term, first + i, data=d) for i, d in enumerate(datas)]
            self._loop.call_soon(self._predict, entries)

    async def _drive(self) -> None:
        """The driver task of a replica run without a round."""
        loop = asyncio.get_running_loop()
        while not self._stopping:
            await self._wakeup.wait()
            self._wakeup.clear()
            if self._turn():
                await self.snapshots.between_readys(loop)

    def _turn(self) -> bool:
        """Step the core with what came, pump the driver, and what follows
        an applied index that moved; True when between Readys (the log may
        be compacted: ``snapshots.between_readys``). Raises the failure of
        a write or an apply: the node cannot go on safely."""
        driver = self.driver
        self._drain()
        driver.pump()
        if self.ticks.on:
            self.ticks.moved(self.core)
        if self._failure is not None:
            raise self._failure
        if self.sm.applied_index != self._notified_applied:
            self._notified_applied = self.sm.applied_index
            self.log_clock.learn(self.sm.log_ms)
            self._notify_applied()
        if self._catching_up_file is not None and self.core.caught_up_durably():
            self._caught_up()
        if not driver.idle:
            return False
        self._observe()
        return True

    def round_turn(self) -> None:
        """This group's part of the round's pass (``replica.round``): as a
        wake of its driver task. A log compaction due between Readys runs
        as a task, during which the group is not turned."""
        if self._stopping or self._busy is not None:
            return
        if not self._turn():
            return
        if self.snapshots.between_readys_now(self._loop):
            return
        self._busy = self._loop.create_task(self.snapshots.between_readys(self._loop))

        def compacted(t: asyncio.Task[None]) -> None:
            self._busy = None
            if not t.cancelled() and t.exception() is not None:
                self._failure = t.exception()
            self._wake()

        self._busy.add_done_callback(compacted)

    # The driver's I/O: the log's thread, the state machine (inline or on the
    # apply thread), the transport. Completions come back on the event loop.

    def _writes_inline(self, nbytes: int) -> bool:
        """Whether a log write of ``nbytes`` is done right here on the event
        loop rather than handed to the log's thread, saving a thread hop
        each way and their wake-ups per Raft round. Only while the log's
        thread is idle (a snapshot's log compaction may be running there).

        - A follower, when no group on this loop leads, up to
          FOLLOWER_INLINE_BYTES (a catch-up's big writes keep the loop
          free): nothing else waits on the loop meanwhile but its own next
          message, which must wait for the write anyway.
        - A leader alone on its loop, up to LEADER_INLINE_BYTES, while its
          proposals come one at a time (the last came when none was
          unanswered): nothing would be validated or proposed during the
          write anyway, and the hops were 0.4-0.5 ms of a 4.3 ms round at
          100 pings a message (bench/profiles/write-path.md, session 25).
          Once proposals overlap, the thread lets the next be validated and
          proposed while the write runs."""
        if not self._log_io.idle:
            return False
        if self.is_leader:
            return (
                nbytes <= LEADER_INLINE_BYTES
                and len(self.loop_mates) == 1
                and not self._proposals_overlap
            )
        return nbytes <= FOLLOWER_INLINE_BYTES and not any(n.is_leader for n in self.loop_mates)

    def _write_log(self, w: LogWrite) -> bool:
        # Only the commit index moved: nothing touches the disk, no thread hop.
        touches_disk = self.log_store.writes(w.entries, w.snapshot, w.sync)
        if (
            touches_disk
            and self._commits is not None
            and (self._commits.groups > 1 or self._round is not None)
        ):
            inline = w.snapshot is None and self._writes_inline(sum(e.size() for e in w.entries))
            self._commit(w, inline)
            return False
        if not touches_disk or (
            w.snapshot is None and self._writes_inline(sum(e.size() for e in w.entries))
        ):
            return self._save_here(w, touches_disk)
        self._save(w)
        return False

    def _save_here(self, w: LogWrite, touches_disk: bool) -> bool:
        """Persist ``w`` on the event loop: True once durable; False when it
        failed (for want of space: tried again on the log's thread after a
        backoff; otherwise fatal, raised by the driver task)."""
        if touches_disk:
            self.transport.flush()  # what is queued for peers does not wait on the disk
        try:
            self.log_store.save(w.hard_state, w.entries, w.snapshot, w.sync)
        except StorageFullError as e:
            self._out_of_space(e, "log write", lambda: self._save(w))
            return False
        except Exception as e:
            self._failure = e
            return False
        if touches_disk:
            self.disk.write_succeeded()
        return True

    def _save(self, w: LogWrite) -> None:
        """Persist ``w`` on the log's thread; report it, or try it again
        after a backoff while there is no room for it."""
        if self._stopping:
            return
        fut = self._log_io.call(
            self._loop, self.log_store.save, w.hard_state, w.entries, w.snapshot, w.sync
        )
        fut.add_done_callback(
            lambda f: self._completed(
                f, lambda _: self._written(w), retry=("log write", lambda: self._save(w))
            )
        )

    def _commit(self, w: LogWrite, inline: bool) -> None:
        """Persist ``w`` with the store's other groups' writes of this turn
        (``GroupCommit``), on the loop when ``inline``; as ``_save`` else."""
        if self._stopping or self._commits is None:
            return
        if inline and self._round is None:
            # What is queued for peers does not wait on the disk (a round
            # flushes the transport before the commit anyway).
            self.transport.flush()

        def done(exc: BaseException | None) -> None:
            if self._stopping:
                return
            if exc is None:
                self._written(w)
                if inline and self._round is None:
                    # Written at the turn's end: its acks leave now, not a
                    # turn later (in a round, the pass goes on with it).
                    self.driver.pump()
            elif isinstance(exc, StorageFullError):
                self._out_of_space(exc, "log write", lambda: self._commit(w, False))
                return
            else:
                self._failure = exc
            self._wake()

        save = (self.log_store, w.hard_state, w.entries, w.snapshot)
        self._commits.submit(self._loop, save, inline, done)

    def _written(self, w: LogWrite) -> None:
        round_trace.mark("written")
        self.disk.write_succeeded()
        self.driver.write_done(w)

    def _apply_job(self, job: ApplyJob) -> bool:
        """Install a snapshot (on the apply thread, once a snapshot being
        taken is done), or apply committed entries: small ones right here
        (LMDB without fsync takes less than a thread hop), big ones on the
        apply thread, on a follower too: applied on its loop, they held up
        its next write and its ack (ack p99 at 1000 pings per message 29-33
        ms against 26-29, bench/profiles/write-path.md, session 23). The
        driver hands out one job at a time."""
        if job.snapshot is not None:
            self._install(job)
            return False
        if self._round is not None and sum(len(e.data) for e in job.entries) <= INLINE_APPLY_BYTES:
            self._round.defer(lambda: self._apply_deferred(job))
            return False
        return self._apply_now(job)

    def _apply_deferred(self, job: ApplyJob) -> None:
        """A round's small apply, once the pass's frames have left."""
        if self._stopping:
            return
        try:
            if self._apply_now(job):
                self.driver.apply_done(job)
        except Exception as e:
            self._failure = e
        self._wake()

    def _apply_now(self, job: ApplyJob) -> bool:
        """``_apply_job`` for entries (see there)."""
        entries = job.entries
        # Results are built only while a proposal of this node waits (every
        # entry it proposes is in the log, so in PendingProposals, before it
        # can be applied): a follower's applies answer nobody.
        wanted = len(self._pending) > 0
        if sum(len(e.data) for e in entries) <= INLINE_APPLY_BYTES:
            # What is queued for peers (a follower's append response) leaves
            # first: it would otherwise wait for this apply, and the commit
            # with it (bench/profiles/write-path.md, session 25).
            self.transport.flush()
            early = None
            if wanted:
                round_trace.mark("answers0")
                told, early = self._told_for(entries)
                if not told:
                    early = self.sm.answers(entries)
                round_trace.mark("answers1")
            if early is not None:
                # Committed, so stored on a majority: answered now, and
                # stored here a few turns later, once the answers are out
                # (the state is the same then: the driver hands out the
                # next apply only after apply_done). Reads fenced at these
                # entries wait for the store, as for any apply.
                self._resolve(entries, early)
                self._after_turns(STORE_AFTER_TURNS, lambda: self._store_answered(job))
                return False
            try:
                round_trace.mark("apply0")
                self._resolve(entries, self.sm.apply(entries, wanted))
                round_trace.mark("apply1")
                return True
            except StorageFullError as e:  # nothing of it applied: again, on the thread
                self._out_of_space(e, "apply", lambda: self._apply_on_thread(job))
                return False
        self._apply_on_thread(job)
        return False

    def _predict(self, entries: list[Entry]) -> None:
        """Tell the answers of entries just proposed (``StateMachine.answers``)
        while they are written and replicated; ``_apply_job`` sends them if
        the entries that commit are these and the state is still the one
        they were told from."""
        if self._stopping or self.sm.applied_index != entries[0].index - 1:
            return
        round_trace.mark("predict0")
        told = self.sm.answers(entries)
        round_trace.mark("predict1")
        # None is kept too: at commit the apply answers them, unasked again.
        keys = [(e.index, e.term) for e in entries]
        self._predicted = (keys, self.sm.generation, told)

    def _told_for(self, entries: list[Entry]) -> tuple[bool, list[list[OpResult]] | None]:
        """Whether ``_predict`` told for exactly ``entries`` and it still
        holds (the same entries, by index and term; the same state), and
        what it told: their answers, or None where only the apply can tell."""
        told, self._predicted = self._predicted, None
        if told is None:
            return False, None
        keys, generation, answers = told
        if generation != self.sm.generation or keys != [(e.index, e.term) for e in entries]:
            return False, None
        return True, answers

    def _after_turns(self, turns: int, fn: Callable[[], None]) -> None:
        """Call ``fn`` ``turns`` turns of the event loop from now."""
        if turns <= 0:
            fn()
        else:
            self._loop.call_soon(self._after_turns, turns - 1, fn)

    def _store_answered(self, job: ApplyJob) -> None:
        """Apply entries whose answers were sent at commit (``_apply_job``);
        on the apply thread after a backoff while there is no room."""
        if self._stopping:
            return  # committed: applied from the log when the node starts again
        try:
            round_trace.mark("store0")
            self.sm.apply(job.entries, False)
            round_trace.mark("store1")
        except StorageFullError as e:  # nothing of it applied
            self._out_of_space(e, "apply", lambda: self._apply_on_thread(job))
            return
        except Exception as e:
            self._failure = e
        else:
            self.driver.apply_done(job)
        self._wake()

    def _apply_on_thread(self, job: ApplyJob) -> None:
        if self._stopping:
            return
        entries = job.entries

        def applied(results: list[list[OpResult]]) -> None:
            self.disk.write_succeeded()
            self._resolve(entries, results)
            self.driver.apply_done(job)

        fut = self._apply_io.call(self._loop, self.sm.apply, entries, len(self._pending) > 0)
        fut.add_done_callback(
            lambda f: self._completed(
                f, applied, retry=("apply", lambda: self._apply_on_thread(job))
            )
        )

    def _install(self, job: ApplyJob) -> None:
        if self._stopping or job.snapshot is None:
            return
        task = self._loop.create_task(self.snapshots.install(job.snapshot, self._apply_io))
        task.add_done_callback(
            lambda t: self._completed(
                t,
                lambda _: self.driver.apply_done(job),
                retry=("snapshot install", lambda: self._install(job)),
            )
        )

    def _completed(
        self,
        fut: asyncio.Future[Any],
        report: Callable[[Any], None],
        retry: tuple[str, Callable[[], None]] | None = None,
    ) -> None:
        """A write or an apply finished: report it to the driver (or keep
        its error for the driver task to raise; or, when it failed for want
        of space and can be retried, try it again later), and wake the
        driver task."""
        if self._stopping:
            return
        if fut.cancelled():
            self._failure = asyncio.CancelledError()
        elif (exc := fut.exception()) is not None:
            if isinstance(exc, StorageFullError) and retry is not None:
                self._out_of_space(exc, *retry)
                return
            self._failure = exc
        else:
            report(fut.result())
        self._wake()

    def _out_of_space(self, err: StorageFullError, what: str, retry: Callable[[], None]) -> None:
        """No room for a write or an apply: nothing of it was stored. Try it
        again after a backoff (Raft cannot skip it); refuse growing writes
        meanwhile (DiskGuard). Logged at most every 10 s."""
        wait = self.disk.write_failed()
        answer_held_back(
            self.core.role == Role.LEADER, self.disk, self._pending, self.id, self.group
        )
        metrics.STORAGE_FULL_RETRIES.labels(what.split()[0]).inc()
        # Post-mortem copies of damaged logs go first: data must not wait on them.
        damage.drop_set_aside(Path(self.cfg.data_dir))
        now = time.monotonic()
        if now - self._full_logged > 10:
            self._full_logged = now
            log.error(
                "out of space; retrying, and refusing growing writes",
                extra={"what": what, "error": str(err), "retry_s": wait},
            )
        self._loop.call_later(wait, retry)

    def _ready_done(self, rd: Ready, w: LogWrite) -> None:
        if w.sync:
            metrics.FSYNC_SECONDS.observe(w.seconds)
        if rd.entries:
            metrics.APPENDED_ENTRIES.inc(len(rd.entries))
        for rs in rd.read_states:
            fut = self._reads.get(rs.context)
            if fut is not None and not fut.done():
                fut.set_result(rs.index)
        if rd.soft_state is not None:
            self._on_soft_state()
        first = rd.entries[0].index if rd.entries else None
        if self._pending.may_be_lost(first, rd.snapshot is not None):
            # A newer leader's entries replaced this node's tail, or a
            # snapshot covered it: answer now, not when (if ever) some later
            # entry is applied at those indexes.
            self._fail_lost(self._pending.lost(self.core.log))

    def _resolve(self, entries: list[Entry], results: list[list[OpResult]]) -> None:
        assert len(results) == len(entries)  # one list per entry, in index order
        first = entries[0].index
        mine, lost = self._pending.applied(entries)
        for e, futures in mine:
            rs = results[e.index - first]  # none for a configuration change
            for i, fut in enumerate(futures):
                if not fut.done():
                    fut.set_result(rs[i] if i < len(rs) else OpResult())
        self._fail_lost(lost)

    def _fail_lost(self, lost: list[_Futures]) -> None:
        """Answer proposals whose entry another took the place of: the outcome
        is unknown to this node (see PendingProposals), the caller retries."""
        for futures in lost:
            for fut in futures:
                if not fut.done():
                    fut.set_exception(NotLeader(self.core.lead, "leadership changed"))

    def _on_soft_state(self) -> None:
        core = self.core
        log.info(
            "raft state",
            extra={
                "role": core.role.name.lower(),
                "term": core.term,
                "leader": core.lead,
                "group": self.group,
            },
        )
        if core.role != Role.LEADER:
            # Proposals not yet in the log cannot be taken any more.
            ops, self._ops = self._ops, []
            for _, fut, _ in ops:
                if not fut.done():
                    fut.set_exception(NotLeader(core.lead))
            answer_held_back(False, self.disk, self._pending, self.id, self.group)
        for fn in self.state_listeners:
            fn()

    def _observe(self) -> None:
        core = self.core
        self._gauges.observe(core, self.sm.applied_index, self.disk)
        soft = (core.lead, core.role, self.sm.applied_index)
        if soft != self._last_soft:
            self._last_soft = soft
            for fn in self.state_listeners:
                fn()

    async def snapshot_now(self) -> int:
        """Snapshot the state machine and compact the log now; the index of
        the snapshot that covers everything applied when asked."""
        return await self.snapshots.now()
