"""ReadyDriver: the one Ready loop between a RaftCore and its I/O, without I/O.

The core says what to do (``ready()``); something must persist it, send the
messages, apply what is committed and then ``advance``, in an order that
keeps Raft safe while a slow fsync is in flight. That order is written here
once, for the node daemon (asyncio, LMDB in threads), the simulation
(virtual time, simulated disks) and the unit tests (all synchronous).

The idea is etcd-io/raft's asynchronous storage writes: a storage write and
a state-machine apply are units of work handed out (``LogWrite``,
``ApplyJob``) whose completion the caller reports back (``write_done``,
``apply_done``), so the same loop serves any I/O and a test can script it.
The driver imports nothing that does I/O and never blocks or waits.

Injected (all called on the caller's thread, from ``pump``):

- ``write_log(w: LogWrite) -> bool``: begin persisting ``w`` as one atomic
  write (fsynced when ``w.sync``). Return True when it is durable already;
  else return False and call ``write_done(w)`` once it is.
- ``apply(job: ApplyJob) -> bool``: install ``job.snapshot`` or apply
  ``job.entries`` to the state machine, in order. True when done; else
  call ``apply_done(job)`` once it is.
- ``send(messages)``: hand messages to the transport (only queues them).
- ``clock() -> float``: stamps writes (``LogWrite.started`` and
  ``durable_at``); real seconds in the node, virtual time in the simulation.
- ``on_ready_done(ready, write)`` (optional): the Ready is persisted, sent
  and applied and is about to be advanced: serve its read states, look at
  its soft state, count the write.

After reporting a completion, or after stepping the core (a message, a
tick, a proposal), the caller calls ``pump()``, which does every step the
rules allow now and returns when the next one waits on a completion.

Invariants (each has a test in tests/unit/node_daemon/raft/test_ready_driver.py):

1. One Ready at a time, one write per Ready: ``ready()`` is not called again
   before the previous Ready is advanced, so whatever is proposed while a
   write is in flight goes into the next Ready and its one write (group
   commit: one fsync for all of it).
2. Nothing that promises durability leaves early. Before the write of a
   Ready is durable only a leader's appends, heartbeats and snapshots may be
   sent (the leader counts its own entries only in ``advance``), and only
   when the Ready does not change the term or the vote
   (``Ready.split_messages``); while the write is in flight, messages
   stepped meanwhile leave only through ``RaftCore.take_early_messages``,
   which holds them back until term and vote are durable. Every other
   message (votes, append responses) is sent once the write is durable.
3. Only what is committed and durable here is applied: entries of a Ready
   that are in its own write are applied after that write is durable.
   Committed entries already on disk before the write (the Ready's, then
   ``take_committed``'s) may be applied while it runs.
4. Each committed entry is applied exactly once, in index order: one
   ``ApplyJob`` in flight at a time, each after the previous is reported
   done; ``take_committed`` hands out only entries never handed out, and
   only once everything handed out before is reported applied.
5. A snapshot is installed after its write is durable and before any entry
   after it; nothing is applied while a write carrying a snapshot runs.
6. ``advance(ready)`` comes last: after the write is durable, every message
   of the Ready is sent, the snapshot installed, every committed entry of
   the Ready and every entry applied during the write is reported applied,
   and ``on_ready_done`` ran.
7. After ``stop()`` nothing more is done: no I/O is begun, completions are
   ignored (a crashed or closing node).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from node_daemon.raft.core import RaftCore
from node_daemon.raft.types import Entry, HardState, Message, Ready, Snapshot


@dataclass(slots=True, eq=False)
class LogWrite:
    """One atomic write of the Raft log: what one Ready asks to persist, in
    this order: ``snapshot`` (replaces the log), ``entries`` (truncating any
    stored suffix from the first on), ``hard_state``; fsync when ``sync``."""

    hard_state: HardState | None
    entries: list[Entry]
    snapshot: Snapshot | None
    sync: bool
    started: float = 0.0  # clock() when handed to write_log
    durable_at: float | None = None  # clock() when reported durable

    @property
    def seconds(self) -> float:
        """How long the write took (0 until it is durable)."""
        return 0.0 if self.durable_at is None else self.durable_at - self.started


@dataclass(slots=True, eq=False)
class ApplyJob:
    """One step for the state machine: install ``snapshot`` (then
    ``entries`` is empty) or apply ``entries`` (committed, in index order)."""

    entries: list[Entry] = field(default_factory=list)
    snapshot: Snapshot | None = None
    during_write: bool = False  # handed out while a log write was in flight


@dataclass(slots=True)
class DriverStats:
    readys: int = 0
    writes_in_flight: int = 0  # writes that were not durable at once
    applied_during_write: int = 0  # entries applied while a write ran
    early_messages: int = 0  # messages sent before their write was durable


WriteLog = Callable[[LogWrite], bool]
Apply = Callable[[ApplyJob], bool]
Send = Callable[[list[Message]], None]
Clock = Callable[[], float]
ReadyDone = Callable[[Ready, LogWrite], None]


class ReadyDriver:
    """Drives one RaftCore through its Readys; see the module docstring."""

    def __init__(
        self,
        core: RaftCore,
        *,
        write_log: WriteLog,
        apply: Apply,
        send: Send,
        clock: Clock,
        on_ready_done: ReadyDone | None = None,
        early_send: bool = True,
        work_during_write: bool = True,
    ) -> None:
        """``early_send``: a Ready's leader-stream messages go before its
        write is durable (invariant 2 still holds when off: all wait).
        ``work_during_write``: while a write is in flight, send what
        ``take_early_messages`` lets go and apply committed entries already
        on disk (off: the core waits for the write)."""
        self.core = core
        self._write_log = write_log
        self._apply = apply
        self._send = send
        self._clock = clock
        self._on_ready_done = on_ready_done
        self.early_send = early_send
        self.work_during_write = work_during_write
        self.stats = DriverStats()
        self._rd: Ready | None = None  # the Ready in progress
        self._write: LogWrite | None = None  # its write
        self._durable = False
        self._late: list[Message] = []  # its messages that wait for the write
        self._todo: deque[ApplyJob] = deque()  # its own apply jobs, in order
        self._applying: ApplyJob | None = None  # the one job in flight
        self._stopped = False

    # ------------------------------------------------------------ state

    @property
    def idle(self) -> bool:
        """No Ready in progress (between Readys: the log may be compacted)."""
        return self._rd is None

    @property
    def writing(self) -> LogWrite | None:
        """The write in flight, if any."""
        return self._write if self._rd is not None and not self._durable else None

    @property
    def applying(self) -> ApplyJob | None:
        """The apply job in flight, if any."""
        return self._applying

    # ------------------------------------------------------ completions

    def write_done(self, w: LogWrite) -> None:
        """``w`` is durable. Call ``pump()`` next."""
        if self._stopped:
            return
        if w is not self._write or self._durable:
            raise ValueError("write_done for a write that is not in flight")
        self._durable = True
        w.durable_at = self._clock()

    def apply_done(self, job: ApplyJob) -> None:
        """``job`` is applied (or installed). Call ``pump()`` next."""
        if self._stopped:
            return
        if job is not self._applying:
            raise ValueError("apply_done for a job that is not in flight")
        self._finish_apply(job)

    def stop(self) -> None:
        """Do nothing more (the node crashed or is closing)."""
        self._stopped = True

    # ------------------------------------------------------------- loop

    def pump(self) -> None:
        """Do every step the rules allow now; return when the next one
        waits on a completion or there is nothing to do."""
        core = self.core
        while not self._stopped:
            if self._rd is None:
                if not core.has_ready():
                    return
                self._begin(core.ready())
            elif not self._step():
                return

    def _begin(self, rd: Ready) -> None:
        self.stats.readys += 1
        self._rd = rd
        self._durable = False
        if self.early_send:
            early, self._late = rd.split_messages()
        else:
            early, self._late = [], rd.messages
        todo = self._todo
        ents = rd.committed_entries
        if rd.snapshot is not None:
            todo.append(ApplyJob(snapshot=rd.snapshot))
            if ents:
                todo.append(ApplyJob(ents))
        elif ents:
            # Entries on disk before this write may be applied while it runs.
            stable = rd.entries[0].index - 1 if rd.entries else self.core.log.last_index()
            n = 0
            if self.work_during_write:
                while n < len(ents) and ents[n].index <= stable:
                    n += 1
            if n:
                todo.append(ApplyJob(ents[:n], during_write=True))
            if n < len(ents):
                todo.append(ApplyJob(ents[n:]))
        if early:
            self.stats.early_messages += len(early)
            self._send(early)
            if self._stopped:
                return
        w = LogWrite(rd.hard_state, rd.entries, rd.snapshot, rd.must_sync, self._clock())
        self._write = w
        if self._write_log(w):
            if not self._stopped:
                self._durable = True
                w.durable_at = w.started
        else:
            self.stats.writes_in_flight += 1

    def _step(self) -> bool:
        """One step of the Ready in progress; False when it must wait."""
        core = self.core
        if self.work_during_write:
            msgs = core.take_early_messages()
            if msgs:
                if not self._durable:
                    self.stats.early_messages += len(msgs)
                self._send(msgs)
                return True
        if not self._durable:
            if self._applying is not None or not self.work_during_write:
                return False
            todo = self._todo
            if todo:
                if not todo[0].during_write:
                    return False  # in this write, or a snapshot: after it
                job = todo.popleft()
            else:
                ents = core.take_committed()
                if not ents:
                    return False
                job = ApplyJob(ents, during_write=True)
            self.stats.applied_during_write += len(job.entries)
            self._start_apply(job)
            return True
        if self._late:
            late, self._late = self._late, []
            self._send(late)
            return True
        if self._applying is not None:
            return False
        if self._todo:
            self._start_apply(self._todo.popleft())
            return True
        rd, w = self._rd, self._write
        assert rd is not None and w is not None
        self._rd = self._write = None
        if self._on_ready_done is not None:
            self._on_ready_done(rd, w)
        if not self._stopped:
            core.advance(rd)
        return True

    def _start_apply(self, job: ApplyJob) -> None:
        self._applying = job
        if self._apply(job) and not self._stopped:
            self._finish_apply(job)

    def _finish_apply(self, job: ApplyJob) -> None:
        self._applying = None
        if job.entries:
            self.core.applied_to(job.entries[-1].index)
