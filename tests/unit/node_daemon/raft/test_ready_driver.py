"""The ReadyDriver's rules, one test each, scripted step by step: writes and
applies complete only when the test says so, so every window the node meets
under load (a fsync in flight, an apply on its thread) is reached on purpose.

The invariants are numbered as in ``node_daemon/raft/driver.py``."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

from node_daemon.raft import (
    ApplyJob,
    Config,
    ConfState,
    Entry,
    LogWrite,
    MemoryStorage,
    Message,
    MessageType,
    RaftCore,
    Ready,
    ReadyDriver,
    Role,
    Snapshot,
    SnapshotMeta,
)
from tests.unit.support.raftkit import storage_with

pytestmark = pytest.mark.unit
MT = MessageType


class TracedCore(RaftCore):
    """A RaftCore that notes when it is advanced."""

    def __init__(self, config: Config, storage: MemoryStorage, trace: list[str]) -> None:
        super().__init__(config, storage, random.Random(config.id))
        self.trace = trace

    def advance(self, rd: Ready) -> None:
        self.trace.append("advance")
        super().advance(rd)


class Script:
    """One core and its driver; the test plays the disk and the state
    machine: a write lands in the MemoryStorage when ``finish_write`` says
    so, an apply (with ``async_apply``) when ``finish_apply`` does. ``trace``
    is what happened, in order."""

    def __init__(
        self,
        node_id: int,
        *,
        log_terms: tuple[int, ...] = (),
        term: int = 0,
        max_apply_bytes: int | None = 64 << 20,
        async_apply: bool = False,
        early_send: bool = True,
        work_during_write: bool = True,
    ) -> None:
        self.trace: list[str] = []
        self.storage = storage_with((1, 2, 3), log_terms, term)
        cfg = Config(node_id, pre_vote=False, check_quorum=False, max_apply_bytes=max_apply_bytes)
        self.core = TracedCore(cfg, self.storage, self.trace)
        self.writes: list[LogWrite] = []
        self.jobs: list[ApplyJob] = []  # handed out, in order
        self.in_flight: ApplyJob | None = None
        self.sent: list[Message] = []
        self.applied: list[int] = []  # indexes, in the order applied
        self.async_apply = async_apply
        self.now = 0.0
        self.driver = ReadyDriver(
            self.core,
            write_log=self._write,
            apply=self._apply,
            send=self._send,
            clock=lambda: self.now,
            on_ready_done=lambda rd, w: self.trace.append("ready_done"),
            early_send=early_send,
            work_during_write=work_during_write,
        )

    # -- the I/O the driver asks for ---------------------------------------

    def _write(self, w: LogWrite) -> bool:
        self.writes.append(w)
        what = [e.index for e in w.entries]
        self.trace.append(f"write {what}" + (" +snapshot" if w.snapshot else ""))
        return False  # durable when the test says so

    def _apply(self, job: ApplyJob) -> bool:
        assert self.in_flight is None, "a second apply job while one is in flight"
        self.jobs.append(job)
        if self.async_apply:
            self.in_flight = job
            return False
        self._do_apply(job)
        return True

    def _do_apply(self, job: ApplyJob) -> None:
        if job.snapshot is not None:
            self.trace.append(f"install {job.snapshot.meta.index}")
            self.applied = [job.snapshot.meta.index]
        for e in job.entries:
            last = self.applied[-1] if self.applied else 0
            assert e.index == last + 1, f"applied {e.index} after {last}"
            self.applied.append(e.index)
        if job.entries:
            self.trace.append(f"apply {[e.index for e in job.entries]}")

    def _send(self, msgs: list[Message]) -> None:
        self.sent.extend(msgs)
        self.trace.append("send " + " ".join(f"{m.type.name}->{m.to}" for m in msgs))

    # -- what the test does -------------------------------------------------

    def step(self, m: Message) -> None:
        self.core.step(m)
        self.driver.pump()

    def finish_write(self) -> None:
        w = self.driver.writing
        assert w is not None, "no write in flight"
        self.storage.save(w.hard_state, w.entries, w.snapshot, w.sync)
        self.driver.write_done(w)
        self.driver.pump()

    def finish_apply(self) -> None:
        job, self.in_flight = self.in_flight, None
        assert job is not None, "no apply in flight"
        self._do_apply(job)
        self.driver.apply_done(job)
        self.driver.pump()

    def settle(self) -> None:
        """Complete writes and applies until nothing is in flight."""
        for _ in range(100):
            if self.in_flight is not None:
                self.finish_apply()
            elif self.driver.writing is not None:
                self.finish_write()
            else:
                return
        raise AssertionError("the driver never settled")

    def take_sent(self) -> list[Message]:
        sent, self.sent = self.sent, []
        return sent


def _leader() -> Script:
    """Node 1, leader of term 1 with its empty entry (index 1) committed and
    applied, nothing in flight."""
    s = Script(1)
    s.core.campaign()
    s.driver.pump()
    s.settle()
    s.step(Message(MT.VOTE_RESP, 1, 2, 1))
    s.settle()
    assert s.core.role == Role.LEADER
    s.step(Message(MT.APPEND_RESP, 1, 2, 1, index=1))
    s.step(Message(MT.APPEND_RESP, 1, 3, 1, index=1))
    s.settle()
    assert s.applied == [1]
    s.take_sent()
    s.trace.clear()
    return s


def _append(to: int, prev: int, indexes: range, commit: int, term: int = 1) -> Message:
    ents = tuple(Entry(term, i, data=b"e%d" % i) for i in indexes)
    return Message(MT.APPEND, to, 1, term, term if prev else 0, prev, ents, commit)


# --------------------------------------------------- the order of one Ready


def test_a_ready_is_persisted_then_sent_then_applied_then_advanced() -> None:
    """Follower with entries 1..3 on disk gets 4..5 and commit 5: 1..3 may
    be applied while the write runs (invariant 3), the response and 4..5
    wait for the write (2, 3), advance comes last (6)."""
    s = Script(2, log_terms=(1, 1, 1), term=1)
    s.step(_append(2, 3, range(4, 6), commit=5))
    assert s.trace == ["write [4, 5]", "apply [1, 2, 3]"]
    assert s.sent == [] and s.applied == [1, 2, 3]
    s.finish_write()
    assert s.trace == [
        "write [4, 5]",
        "apply [1, 2, 3]",
        "send APPEND_RESP->1",
        "apply [4, 5]",
        "ready_done",
        "advance",
    ]
    assert s.applied == [1, 2, 3, 4, 5] and s.core.log.applied == 5


def test_the_write_is_timed_by_the_injected_clock() -> None:
    s = Script(2, log_terms=(1,), term=1)
    s.now = 5.0
    s.step(_append(2, 1, range(2, 3), commit=1))
    s.now = 12.0
    s.finish_write()
    (w,) = s.writes
    assert (w.started, w.durable_at, w.seconds) == (5.0, 12.0, 7.0)
    assert w.sync and [e.index for e in w.entries] == [2]


# --------------------------------------------- one Ready, one write (rule 1)


def test_proposals_made_during_a_write_share_the_next_write() -> None:
    s = _leader()
    s.core.propose(b"a")
    s.driver.pump()
    n = len(s.writes)
    assert [e.data for e in s.writes[-1].entries] == [b"a"]
    s.core.propose(b"b")
    s.driver.pump()
    s.core.propose(b"c")
    s.driver.pump()
    assert len(s.writes) == n, "a second write began while one was in flight"
    s.finish_write()
    assert len(s.writes) == n + 1
    assert [e.data for e in s.writes[-1].entries] == [b"b", b"c"]
    assert s.trace.count("advance") == 1


# ----------------------------------------- what may go before the write (2)


def test_a_leaders_appends_go_before_its_write_responses_after() -> None:
    lead = _leader()
    lead.core.propose(b"a")
    lead.driver.pump()
    assert lead.driver.writing is not None
    appends = [m for m in lead.take_sent() if m.type == MT.APPEND]
    assert sorted(m.to for m in appends) == [2, 3], "appends waited for the leader's fsync"

    follower = Script(2)
    follower.step(next(m for m in appends if m.to == 2))
    assert follower.driver.writing is not None
    assert follower.sent == [], "an append response left before the entries were durable"
    follower.finish_write()
    assert [m.type for m in follower.sent] == [MT.APPEND_RESP]


def test_appends_stepped_during_a_write_go_out_before_it_is_durable() -> None:
    s = _leader()
    s.core.propose(b"a")
    s.driver.pump()
    s.take_sent()
    s.core.propose(b"b")
    s.driver.pump()
    assert s.driver.writing is not None
    sent = s.take_sent()
    assert {m.to for m in sent if m.type == MT.APPEND and m.entries} == {2, 3}


def test_nothing_goes_early_in_a_ready_that_changes_the_term() -> None:
    s = Script(1)
    s.core.campaign()
    s.core.step(Message(MT.VOTE_RESP, 1, 2, 1))  # leader in the same Ready
    assert s.core.role == Role.LEADER
    s.driver.pump()
    assert s.driver.writing is not None
    assert s.sent == [], "a leader spoke for a term it could still forget"
    s.finish_write()
    assert {m.type for m in s.sent} == {MT.VOTE, MT.APPEND}


def test_messages_stepped_during_a_write_wait_for_the_term_to_be_durable() -> None:
    s = Script(1)
    s.core.campaign()
    s.driver.pump()  # the write of term 1 and the vote is in flight
    s.step(Message(MT.VOTE_RESP, 1, 2, 1))
    assert s.core.role == Role.LEADER
    assert s.sent == [], "appends of a term not yet durable went out"
    s.finish_write()
    types = [m.type for m in s.sent]
    assert MT.VOTE in types and MT.APPEND in types
    assert types.index(MT.VOTE) < types.index(MT.APPEND)


def test_without_early_send_every_message_waits_for_its_write() -> None:
    s = Script(1, early_send=False)
    s.core.campaign()
    s.driver.pump()
    s.finish_write()
    s.step(Message(MT.VOTE_RESP, 1, 2, 1))  # the empty entry's Ready: appends
    assert s.driver.writing is not None
    assert not [m for m in s.sent if m.type == MT.APPEND]
    s.finish_write()
    assert [m for m in s.sent if m.type == MT.APPEND]


# --------------------------------------------- applying during a write (3, 4)


def test_entries_in_the_write_are_applied_only_after_it() -> None:
    s = Script(2)
    s.step(_append(2, 0, range(1, 4), commit=3))
    assert s.applied == [], "entries applied before they were on this node's disk"
    s.finish_write()
    assert s.applied == [1, 2, 3]


def test_without_work_during_write_nothing_is_applied_while_it_runs() -> None:
    s = Script(2, log_terms=(1, 1, 1), term=1, work_during_write=False)
    s.step(_append(2, 3, range(4, 6), commit=5))
    assert s.applied == []
    s.finish_write()
    assert s.applied == [1, 2, 3, 4, 5]


def test_entries_committed_during_a_write_are_applied_if_already_on_disk() -> None:
    """Leader: "a" (2) is durable but not committed; "b" (3) is being
    written when a follower acknowledges 2: 2 is applied at once, 3 only
    after its write, each once."""
    s = _leader()
    s.core.propose(b"a")
    s.driver.pump()
    s.finish_write()
    s.core.propose(b"b")
    s.driver.pump()
    assert s.driver.writing is not None
    s.step(Message(MT.APPEND_RESP, 1, 2, 1, index=2))
    assert s.applied == [1, 2]
    assert s.jobs[-1].during_write
    s.step(Message(MT.APPEND_RESP, 1, 2, 1, index=3))
    assert s.applied == [1, 2], "an entry was applied before the leader's own write of it"
    s.finish_write()
    assert s.applied == [1, 2, 3]


def test_each_entry_is_applied_once_across_ready_and_take_committed() -> None:
    """A small apply budget splits the committed entries between the Ready
    and take_committed while the write runs: still each once, in order."""
    s = Script(2, log_terms=(1,) * 6, term=1, max_apply_bytes=40)
    s.step(_append(2, 6, range(7, 9), commit=6))
    assert s.driver.writing is not None
    assert s.applied == [1, 2, 3, 4, 5, 6]
    assert len(s.jobs) > 1
    s.finish_write()
    s.step(_append(2, 8, range(9, 9), commit=8))
    s.settle()
    assert s.applied == list(range(1, 9))


def test_one_apply_job_at_a_time_and_advance_waits_for_it() -> None:
    s = Script(2, log_terms=(1, 1, 1), term=1, async_apply=True)
    s.step(_append(2, 3, range(4, 6), commit=5))
    assert s.in_flight is not None and [e.index for e in s.in_flight.entries] == [1, 2, 3]
    s.finish_write()
    assert [m.type for m in s.sent] == [MT.APPEND_RESP]  # durable: the response goes
    assert len(s.jobs) == 1, "4..5 began while 1..3 was still being applied"
    assert "advance" not in s.trace
    s.finish_apply()
    assert len(s.jobs) == 2 and "advance" not in s.trace
    s.finish_apply()
    assert s.trace[-2:] == ["ready_done", "advance"]
    assert s.core.log.applied == 5


# ------------------------------------------------------------ snapshots (5)


def _snapshot(index: int) -> Message:
    meta = SnapshotMeta(index, 1, ConfState(frozenset({1, 2, 3})))
    return Message(MT.SNAPSHOT, 2, 1, 1, snapshot=Snapshot(meta, b"state"))


def test_a_snapshot_is_installed_after_its_write_and_before_later_entries() -> None:
    s = Script(2)
    s.step(_snapshot(10))
    assert s.trace == ["write [] +snapshot"]
    # The leader goes on while the snapshot is being written.
    s.step(_append(2, 10, range(11, 12), commit=11))
    assert s.jobs == [], "applied something while a snapshot was being written"
    s.finish_write()
    s.settle()
    assert s.jobs[0].snapshot is not None and s.jobs[0].snapshot.meta.index == 10
    assert s.applied == [10, 11]
    assert s.trace.index("install 10") < s.trace.index("apply [11]")
    assert s.trace.index("write [] +snapshot") < s.trace.index("install 10")


# ------------------------------------------------------------ stopping (7)


def test_after_stop_completions_are_ignored() -> None:
    s = Script(2)
    s.step(_append(2, 0, range(1, 3), commit=2))
    w = s.driver.writing
    assert w is not None
    s.driver.stop()
    s.driver.write_done(w)
    s.driver.pump()
    assert s.sent == [] and s.applied == [] and "advance" not in s.trace


def test_a_completion_for_another_write_is_refused() -> None:
    s = Script(2)
    s.step(_append(2, 0, range(1, 2), commit=0))
    with pytest.raises(ValueError):
        s.driver.write_done(LogWrite(None, [], None, True))
    with pytest.raises(ValueError):
        s.driver.apply_done(ApplyJob())


# --------------------------------------------------------- the layer rule


ALLOWED = {"__future__", "collections", "dataclasses", "enum", "random", "struct", "typing"}


def test_the_raft_package_imports_nothing_with_io() -> None:
    """node_daemon/raft (the core and the driver) imports only itself and a
    few pure standard modules: no asyncio, lmdb, grpc, threads or files."""
    pkg = Path(__file__).resolve().parents[4] / "node_daemon" / "raft"
    found: dict[str, set[str]] = {}
    for path in sorted(pkg.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                if not name.startswith("node_daemon.raft") and name.split(".")[0] not in ALLOWED:
                    found.setdefault(path.name, set()).add(name)
    assert "driver.py" in {p.name for p in pkg.glob("*.py")}
    assert found == {}
