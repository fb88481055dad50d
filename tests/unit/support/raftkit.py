"""Helpers to drive RaftCores by hand in unit tests (no I/O, no clock).

The Ready loop is the node daemon's ``ReadyDriver`` with synchronous I/O: a
write lands in the core's MemoryStorage at once, applies are recorded, and
every message of a Ready leaves after its write, in the Ready's order."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence

from node_daemon.raft import (
    ApplyJob,
    Config,
    ConfState,
    Entry,
    HardState,
    LogStorage,
    LogWrite,
    MemoryStorage,
    Message,
    RaftCore,
    ReadyDriver,
    Snapshot,
    SnapshotMeta,
)


def storage_with(
    voters: Iterable[int],
    log_terms: Sequence[int] = (),
    term: int = 0,
    learners: Iterable[int] = (),
) -> MemoryStorage:
    """A store whose configuration is ``voters`` and whose log has entries
    1..n with the given terms."""
    st = MemoryStorage()
    conf = ConfState(frozenset(voters), frozenset(learners))
    st.save(None, [], Snapshot(SnapshotMeta(0, 0, conf)))
    ents = [Entry(t, i + 1, data=b"e%d" % (i + 1)) for i, t in enumerate(log_terms)]
    st.save(HardState(term=max([term, *log_terms])), ents)
    return st


def new_core(
    node_id: int,
    voters: Iterable[int] = (1, 2, 3),
    *,
    log_terms: Sequence[int] = (),
    term: int = 0,
    learners: Iterable[int] = (),
    election_tick: int = 10,
    heartbeat_tick: int = 1,
    pre_vote: bool = False,
    check_quorum: bool = False,
    seed: int = 0,
    storage: MemoryStorage | None = None,
    applied: int = 0,
    lazy_commit: bool = False,
) -> RaftCore:
    st = storage or storage_with(voters, log_terms, term, learners)
    cfg = Config(
        node_id,
        election_tick=election_tick,
        heartbeat_tick=heartbeat_tick,
        pre_vote=pre_vote,
        check_quorum=check_quorum,
        applied=applied,
        lazy_commit=lazy_commit,
    )
    return RaftCore(cfg, st, random.Random(seed))


def sync_driver(
    core: RaftCore,
    sent: list[Message],
    applied: Callable[[], list[Entry]] | None = None,
) -> ReadyDriver:
    """A ReadyDriver whose writes land in ``core``'s storage at once, whose
    messages go to ``sent`` and whose committed entries go to the list
    ``applied()`` returns."""
    storage: LogStorage = core.log.storage

    def write(w: LogWrite) -> bool:
        storage.save(w.hard_state, w.entries, w.snapshot, w.sync)
        return True

    def apply(job: ApplyJob) -> bool:
        if applied is not None:
            applied().extend(job.entries)
        return True

    return ReadyDriver(
        core, write_log=write, apply=apply, send=sent.extend, clock=lambda: 0.0, early_send=False
    )


def persist(core: RaftCore) -> list[Message]:
    """Do what a Ready asks (persist; apply nothing); return its messages."""
    msgs: list[Message] = []
    sync_driver(core, msgs).pump()
    return msgs


def tick_until_campaign(core: RaftCore) -> None:
    for _ in range(3 * core.cfg.election_tick):
        core.tick()
        if core.role != 0:
            return
    raise AssertionError("no campaign within the election timeout")


class Net:
    """Cores wired together; messages are delivered until all is quiet."""

    def __init__(self, cores: Iterable[RaftCore]) -> None:
        self.cores = {c.id: c for c in cores}
        self.applied: dict[int, list[Entry]] = {i: [] for i in self.cores}
        self.cut: set[tuple[int, int]] = set()
        self.delivered: list[Message] = []
        self._queue: list[Message] = []
        self._drivers: dict[int, ReadyDriver] = {}

    def _driver(self, i: int, core: RaftCore) -> ReadyDriver:
        d = self._drivers.get(i)
        if d is None or d.core is not core:  # a test put a new core in place
            d = self._drivers[i] = sync_driver(core, self._queue, lambda: self.applied[i])
        return d

    def isolate(self, node: int) -> None:
        for other in self.cores:
            if other != node:
                self.cut |= {(node, other), (other, node)}

    def heal(self) -> None:
        self.cut.clear()

    def stabilize(self, max_rounds: int = 10_000) -> None:
        for _ in range(max_rounds):
            for i, c in self.cores.items():
                self._driver(i, c).pump()
            queue = self._queue.copy()
            self._queue.clear()
            if not queue:
                return
            for m in queue:
                if (m.frm, m.to) in self.cut or m.to not in self.cores:
                    continue
                self.delivered.append(m)
                self.cores[m.to].step(m)
        raise AssertionError("network did not become quiet")

    def tick_all(self, n: int = 1) -> None:
        for _ in range(n):
            for c in self.cores.values():
                c.tick()
            self.stabilize()

    def elect(self, node: int) -> None:
        self.cores[node].campaign()
        self.stabilize()
