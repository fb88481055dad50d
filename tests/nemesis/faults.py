"""The fault injectors: each fault of a schedule is started at its time,
against targets resolved then (who leads now), and healed ``duration``
later; every start, heal and skip is recorded in the history.

Invariants: a process is under at most one process fault at a time (kill,
power cut, wipe, corruption or pause); a heal only undoes what its own start did (a pause is
continued only if the same process is still there; a restart only starts
what this fault killed); ``heal_all`` leaves every process running, every
network rule, ballast file and clock offset removed; the loop ends by the
deadline whatever happens.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.nemesis.cluster import NemesisCluster, Service, proc_start
from tests.nemesis.history import Recorder
from tests.nemesis.schedule import (
    CLOCK,
    CORRUPT,
    DISK,
    KILL,
    LOSS,
    MEMBER,
    PARTITION,
    PAUSE,
    POWER,
    SLOW,
    WIPE,
    WORKER_KILL,
    WORKER_PAUSE,
    Fault,
)

log = logging.getLogger("nemesis.faults")
# node_daemon.replica.catching_up.CATCHING_UP_FILE (the nemesis imports no daemon)
CATCHING_UP_FILE = "catching-up"

Heal = Callable[[], None]

LEADER_TTL_S = 1.0  # who leads is asked again after this long
LATE_S = 30.0  # a fault this far behind its time is skipped: the loop never drags on
# Faults that wait for a state of the cluster (a leader known, every node a
# voter holding its copy) are tried again this often, up to LATE_S after
# their time, instead of being skipped at once: under every other fault
# that state is brief, and a long run would see few of them otherwise.
RETRY_S = 0.5


def known_finding(f: Fault) -> str:
    """Why a fault is left out under ``skip_known`` ('' if it is not): the
    faults that trigger findings not fixed yet, so that a run can check
    everything else (RELIABILITY.md). Wipes (finding 2) and clocks stepped
    ahead (finding 4) were left out until their fixes; finding 8 depends on
    the target's state, and membership changes (finding 12) were left out
    until their fixes: nothing is left out today."""
    del f
    return ""


# A node that cannot start for want of room (finding 8's fix: it says so and
# exits 1) is started again as systemd does (Restart=on-failure,
# RestartSec=2): the deployment's behaviour, not a crash.
START_REFUSED = "cannot start: the disk is full"
RESTART_SEC = 2.0


RETRIED = (WIPE, MEMBER, CORRUPT)
FAIR_LEAD = 2  # how far one RETRIED kind may run ahead of the least started
# Worker faults find no target while their node starts its workers again
# (after a kill or a power cut of the node, or a worker kill): tried again
# as the RETRIED kinds are, but only this long after their time, and with
# no turns to take (they wait for no quiet cluster).
TARGET_RETRIED = (WORKER_KILL, WORKER_PAUSE)
TARGET_LATE_S = 6.0


class Skip(Exception):
    """No target fits now (say, every follower is down already)."""


def _holds_a_copy(cluster: NemesisCluster, svc: Service, groups: list[int]) -> bool:
    """The node's disk holds its copy of every group's log (``groups``):
    not wiped, or caught up since (a group keeps ``raft/catching-up`` while
    it is not)."""
    mine = cluster.group_dirs(svc)
    for g in groups:
        raft = mine[g] / "raft" if g in mine else None
        if raft is None or not raft.is_dir() or (raft / CATCHING_UP_FILE).exists():
            return False
    return True


def keeps_a_majority(
    nodes: set[int], removed: set[int], lost: set[int], take: int, remove: bool
) -> bool:
    """Whether a quiet fault may take node ``take``'s copy (or, ``remove``,
    its place in the configuration) while the nodes in ``removed`` are out of
    the configuration and those in ``lost`` hold no copy: ``take`` is a voter
    holding its copy, and after the fault more than half the voters still
    hold theirs; one member out at a time. With 3 nodes that is: every node
    a voter holding its copy; with 5, two copies may be gone at once, or one
    copy and one member."""
    voters = nodes - removed
    if take not in voters or take in lost or (remove and removed):
        return False
    after = voters - {take} if remove else voters
    holding = after - lost - {take}
    return len(holding) > len(after) // 2


@dataclass
class Nemesis:
    cluster: NemesisCluster
    rec: Recorder
    faults: list[Fault]
    seed: int
    offset: float = 0.0  # the schedule's 0, on the recorder's clock
    skip_known: bool = False  # leave out faults that trigger known, unfixed findings
    down: dict[str, str] = field(default_factory=dict)  # service -> the fault that killed it
    paused: dict[str, tuple[str, int]] = field(default_factory=dict)  # -> (fault, pid)
    # Worker processes stopped by a worker-pause: fault -> (node, pid, start time).
    paused_workers: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    crashed: set[str] = field(default_factory=set)
    removed: set[int] = field(default_factory=set)  # node ids taken out of the configuration
    held_out: set[int] = field(default_factory=set)  # of those, the ones whose fault lasts still
    # Nodes whose copy a wipe or a corruption took, until the node itself says
    # it is caught up: its files show nothing until it has started and found
    # the damage, and a fault in between would take a second copy (finding 12).
    lost: set[str] = field(default_factory=set)
    _heals: dict[str, Heal] = field(default_factory=dict)
    _waits_on: dict[str, str] = field(default_factory=dict)  # kind -> why its last try skipped
    _refused: dict[str, float] = field(default_factory=dict)  # node -> when its start was refused
    _leader_id: int = 0
    _group_leaders: dict[int, int] = field(default_factory=dict)  # data group -> node
    _leader_at: float = float("-inf")
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.rng = random.Random(f"{self.seed}:targets")

    # ---------------------------------------------------------------- loop

    def run(self, stop: threading.Event) -> None:
        """Start and heal the faults at their times until the schedule ends
        or ``stop`` is set."""
        queue: list[tuple[float, int, str, Fault]] = []
        for k, f in enumerate(self.faults):
            heapq.heappush(queue, (self.offset + f.at, k, "start", f))
        seq = len(self.faults)
        # One fault of each RETRIED kind waits for a quiet cluster at a time:
        # the others of its kind due meanwhile are skipped at once, or dense
        # lanes would pile up retries (each asks the cluster) and clog the loop.
        waiting: dict[str, str] = {}
        # And they take turns: a kind that started FAIR_LEAD more than the
        # least started of them lets the others go first (the first retry
        # after a storm would otherwise win every quiet moment).
        started: dict[str, int] = {k: 0 for k in RETRIED if any(x.kind == k for x in self.faults)}
        while queue and not stop.is_set():
            at, _, what, f = queue[0]
            if stop.wait(max(0.0, at - self.rec.now())):
                break
            heapq.heappop(queue)
            due = self.offset + f.at
            if what == "start" and waiting.get(f.kind, f.id) != f.id:
                self.rec.event("nemesis", "info", "nemesis", phase="skip", fault=f.id,
                               kind=f.kind, target=f.target,
                               reason=f"another {f.kind} waits for a quiet cluster")  # fmt: skip
            elif what == "start" and self.rec.now() - due > LATE_S:
                waiting.pop(f.kind, None)
                self.rec.event("nemesis", "info", "nemesis", phase="skip", fault=f.id,
                               kind=f.kind, target=f.target, reason="late")  # fmt: skip
            elif (
                what == "start"
                and f.kind in started
                and started[f.kind] > min(started.values()) + FAIR_LEAD
                and self.rec.now() + RETRY_S - due <= LATE_S
            ):
                waiting[f.kind] = f.id  # the others' turn first
                seq += 1
                heapq.heappush(queue, (self.rec.now() + RETRY_S, seq, "start", f))
            elif what == "start":
                late = TARGET_LATE_S if f.kind in TARGET_RETRIED else LATE_S
                retried = f.kind in RETRIED or f.kind in TARGET_RETRIED
                last_try = not retried or self.rec.now() + RETRY_S - due > late
                seq += 1
                if self.start(f, record_skip=last_try):  # healed its duration after it began
                    if f.kind in started:
                        started[f.kind] += 1
                    waiting.pop(f.kind, None)
                    heapq.heappush(queue, (self.rec.now() + f.duration, seq, "heal", f))
                elif not last_try:
                    if f.kind in RETRIED:  # one at a time; target retries ask little
                        waiting[f.kind] = f.id
                    heapq.heappush(queue, (self.rec.now() + RETRY_S, seq, "start", f))
                else:
                    waiting.pop(f.kind, None)
            else:
                self.heal(f)
            self.check_alive()

    def start(self, f: Fault, record_skip: bool = True) -> bool:
        """Start one fault; False when it was skipped (recorded as such if
        ``record_skip``: its last try)."""
        starter = {
            KILL: self._kill,
            PAUSE: self._pause,
            PARTITION: self._partition,
            LOSS: self._loss,
            SLOW: self._slow,
            DISK: self._disk,
            CLOCK: self._clock,
            WIPE: self._wipe,
            MEMBER: self._member,
            POWER: self._power,
            CORRUPT: self._corrupt,
            WORKER_KILL: self._worker_kill,
            WORKER_PAUSE: self._worker_pause,
        }[f.kind]
        leader = self._leader()
        try:
            if self.skip_known and known_finding(f):
                raise Skip(known_finding(f))
            heal, detail = starter(f, leader)
        except Skip as e:
            if record_skip:
                self.rec.event("nemesis", "info", "nemesis", phase="skip", fault=f.id,
                               kind=f.kind, target=f.target, reason=str(e))  # fmt: skip
            elif self._waits_on.get(f.kind) != str(e):  # what a retried kind waits on, as it moves
                log.info("waiting", extra={"fault": f.id, "kind": f.kind, "why": str(e)})
            self._waits_on[f.kind] = str(e)
            return False
        with self._lock:
            self._heals[f.id] = heal
        self._waits_on.pop(f.kind, None)
        self.rec.event("nemesis", "info", "nemesis", phase="start", fault=f.id, kind=f.kind,
                       target=f.target, leader=leader, **detail)  # fmt: skip
        log.info("fault", extra={"fault": f.id, "target": f.target, "leader": leader, **detail})
        return True

    def _leader(self) -> int:
        """Who leads, asked at most every LEADER_TTL_S: asking takes up to a
        timeout when nodes are paused, and faults start several a second."""
        now = time.monotonic()
        if now - self._leader_at >= LEADER_TTL_S:
            views = self.cluster.views()
            self._leader_id = self.cluster.leader(views)
            self._group_leaders = self.cluster.group_leaders(views)
            self._leader_at = time.monotonic()
        return self._leader_id

    def _group_leader(self, leader: int) -> tuple[int, int]:
        """(a data group drawn now, the node leading it): among the groups
        whose leader is known, as last asked (``_leader``); (0, group 0's
        leader) in a cluster of one group or with none known."""
        known = sorted(g for g, n in self._group_leaders.items() if n)
        if not known:
            return 0, leader
        g = self.rng.choice(known)
        return g, self._group_leaders[g]

    def heal(self, f: Fault) -> None:
        with self._lock:
            heal = self._heals.pop(f.id, None)
        if heal is None:
            return
        heal()
        self.rec.event("nemesis", "info", "nemesis", phase="heal", fault=f.id, kind=f.kind)

    def heal_all(self) -> None:
        """Undo every fault under way, then make sure of it: no network
        rules, no ballast, true clocks, every process continued and running."""
        with self._lock:
            pending = list(self._heals)
        for fid in pending:
            f = next(x for x in self.faults if x.id == fid)
            self.heal(f)
        c = self.cluster
        c.heal_partitions()
        for fid, (name, pid, started) in list(self.paused_workers.items()):
            c.signal_worker(c.services[name], pid, started, signal.SIGCONT)
            del self.paused_workers[fid]
        for svc in c.services.values():
            c.heal_loss(svc.host)
            c.heal_slow(svc.host)
            svc.signal(signal.SIGCONT)
            if svc.kind == "node":
                c.free_disk(svc)
                c.set_clock(svc, 0)
        self.paused.clear()
        self.check_alive()
        for svc in c.services.values():
            if not svc.running() and svc.name not in self.crashed:
                c.start(svc)
        self.down.clear()
        self._add_back(tries=30)
        self.rec.event("nemesis", "info", "nemesis", phase="heal-all")

    def check_alive(self) -> None:
        """Record any process that should run and does not (once each); a
        node that refused to start for want of room is started again
        RESTART_SEC after it exited, as systemd would (recorded as such)."""
        now = time.monotonic()
        for s in self.cluster.node_services:
            if s.name in self.down or s.name in self.crashed or s.running():
                continue
            if s.popen is not None and s.popen.returncode == 1 and START_REFUSED in s.tail(3):
                since = self._refused.setdefault(s.name, now)
                if now - since >= RESTART_SEC:
                    del self._refused[s.name]
                    self.rec.event("nemesis", "info", "restart", service=s.name,
                                   why=START_REFUSED)  # fmt: skip
                    self.cluster.start(s)
        dead = {
            s.name: s.tail()
            for s in self.cluster.services.values()
            if s.name not in self.down
            and s.name not in self.crashed
            and s.name not in self._refused
            and not s.running()
        }
        if dead:
            self.crashed |= set(dead)
            self.rec.event("run", "info", "crashed", dead=dead)
            log.error("crashed", extra={"dead": sorted(dead)})

    # ------------------------------------------------------------- targets

    def _up(self, svc: Service) -> bool:
        return svc.running() and svc.name not in self.down and svc.name not in self.crashed

    def _nodes(
        self,
        target: str,
        leader: int,
        *,
        allow_paused: bool = True,
        exclude: set[int] | None = None,
    ) -> list[Service]:
        """The nodes a target names, among those up (and not paused unless
        allowed) and not in ``exclude`` (node ids; a leader excluded is no
        pick); raises Skip when none fits."""
        out = exclude or set()
        nodes = [
            s
            for s in self.cluster.node_services
            if self._up(s) and (allow_paused or s.name not in self.paused) and s.ident not in out
        ]
        if target in ("leader", "group-leader"):
            if target == "group-leader":
                leader = self._group_leader(leader)[1]
            pick = [s for s in nodes if s.ident == leader] or nodes[:0]
            if not pick and nodes and leader not in out:  # no leader known: any node
                pick = [self.rng.choice(nodes)]
        elif target == "follower":
            others = [s for s in nodes if s.ident != leader]
            pick = [self.rng.choice(others)] if others else []
        elif target == "minority":
            k = (len(self.cluster.node_services) - 1) // 2
            pick = self.rng.sample(nodes, min(k, len(nodes)))
        elif target == "all":
            pick = nodes
        elif target == "node":
            pick = [self.rng.choice(nodes)] if nodes else []
        else:
            raise ValueError(target)
        if not pick:
            raise Skip(f"no node up for {target}")
        return pick

    def _queues(self, target: str, *, allow_paused: bool = True) -> list[Service]:
        qs = [
            s
            for s in self.cluster.queue_services
            if self._up(s) and (allow_paused or s.name not in self.paused)
        ]
        if not qs:
            raise Skip("no queue server up")
        return qs if target in ("queues", "all") else [self.rng.choice(qs)]

    # ------------------------------------------------------------- faults

    def _kill(self, f: Fault, leader: int) -> tuple[Heal, dict[str, Any]]:
        if f.target in ("queue", "queues"):
            victims = self._queues(f.target)
        elif f.target == "all":
            victims = self._nodes("all", leader)
            with contextlib.suppress(Skip):
                victims += self._queues("queues")
        else:
            victims = self._nodes(f.target, leader)
        for svc in victims:
            self.cluster.kill(svc)
            self.down[svc.name] = f.id
            self.paused.pop(svc.name, None)
        return self._restart_at_heal(victims, f), {"services": [s.name for s in victims]}

    def _power(self, f: Fault, leader: int) -> tuple[Heal, dict[str, Any]]:
        """Power cuts: each victim's process stops, its disk loses what was
        not on the device yet, and it stays off until heal."""
        victims = self._nodes(f.target, leader)
        lost: dict[str, int] = {}
        for svc in victims:
            self.down[svc.name] = f.id
            self.paused.pop(svc.name, None)
            lost[svc.name] = self.cluster.power_cut(svc)
        detail = {"services": [s.name for s in victims], "lost_bytes": lost}
        return self._restart_at_heal(victims, f), detail

    def _wipe(self, f: Fault, leader: int) -> tuple[Heal, dict[str, Any]]:
        # A wipe is a minority losing its disk (see ``_lose_a_copy``).
        def wipe(svc: Service) -> dict[str, Any]:
            self.cluster.wipe(svc)
            return {}

        return self._lose_a_copy(f, leader, wipe)

    def _corrupt(self, f: Fault, leader: int) -> tuple[Heal, dict[str, Any]]:
        """A follower's Raft log of one group (drawn among those on its
        disk) damaged while it is down: it loses its copy of that group."""
        how, at = f.params["how"], float(f.params["at"])
        draw = float(f.params.get("group_draw", 0.0))

        def damage(svc: Service) -> dict[str, Any]:
            groups = list(self.cluster.group_dirs(svc))
            group = groups[min(len(groups) - 1, int(draw * len(groups)))]
            return self.cluster.corrupt_log(svc, how, at, group)

        return self._lose_a_copy(f, leader, damage)

    def _worker(self, f: Fault, leader: int) -> tuple[Service, int, tuple[int, ...], int]:
        """The worker process a worker fault names: (its node, PID, groups,
        the data group aimed at or 0). ``group-leader``: the worker running
        a data group drawn now on the node leading it; ``any``: a worker of
        a node drawn among those up. Skip when there is none (a cluster of
        one group has no workers; a worker being started again has none)."""
        group = 0
        if f.target == "group-leader" and any(self._group_leaders.values()):
            group, ident = self._group_leader(leader)
            nodes = [s for s in self.cluster.node_services if s.ident == ident and self._up(s)]
        else:  # "any", or no data group's leader known (in a storm): any node's worker
            nodes = [s for s in self.cluster.node_services if self._up(s)]
            self.rng.shuffle(nodes)
        busy = {pid for _, pid, _ in self.paused_workers.values()}
        for svc in nodes:
            workers = {p: g for p, g in self.cluster.workers(svc).items() if p not in busy}
            if group:
                workers = {p: g for p, g in workers.items() if group in g}
            if workers:
                pid = self.rng.choice(sorted(workers))
                return svc, pid, workers[pid], group
        raise Skip(f"no worker process for {f.target} (group {group})")

    def _worker_kill(self, f: Fault, leader: int) -> tuple[Heal, dict[str, Any]]:
        """SIGKILL one worker process; its node starts it again (after its
        backoff): nothing to heal, the node's own supervision is the test."""
        svc, pid, groups, group = self._worker(f, leader)
        if not self.cluster.signal_worker(svc, pid, proc_start(pid), signal.SIGKILL):
            raise Skip(f"worker {pid} of {svc.name} ended before its fault")
        detail = {"services": [svc.name], "pid": pid, "groups": list(groups), "group": group}
        return (lambda: None), detail

    def _worker_pause(self, f: Fault, leader: int) -> tuple[Heal, dict[str, Any]]:
        """SIGSTOP one worker process (its node and other workers run on);
        SIGCONT at heal, if it is still that process."""
        svc, pid, groups, group = self._worker(f, leader)
        started = proc_start(pid)
        if not self.cluster.signal_worker(svc, pid, started, signal.SIGSTOP):
            raise Skip(f"worker {pid} of {svc.name} ended before its fault")
        self.paused_workers[f.id] = (svc.name, pid, started)

        def heal() -> None:
            if self.paused_workers.pop(f.id, None) is not None:
                self.cluster.signal_worker(svc, pid, started, signal.SIGCONT)

        detail = {"services": [svc.name], "pid": pid, "groups": list(groups), "group": group}
        return heal, detail

    def _lose_a_copy(
        self, f: Fault, leader: int, damage: Callable[[Service], dict[str, Any]]
    ) -> tuple[Heal, dict[str, Any]]:
        """Kill one follower of a known leader, ``damage`` its disk, start it
        at heal: only while the leader's configuration is settled and a
        majority of its voters keeps its copy without this one (a node still
        empty or catching up holds none), or the run would take a majority's
        copies of acknowledged writes, which nothing survives. With 3 nodes:
        every node a voter holding its copy; with 5, two may lose theirs at
        once (``keeps_a_majority``). (With two voters, one wiped before it
        has learned that configuration cannot vote for the other: see
        RELIABILITY.md, finding 2.)"""
        if not leader:
            raise Skip("no leader known: any node may hold the only copies")
        lost = self._lost_copies()
        self._configuration_settled(leader, lost)
        svc = self._quiet_target(f.target, leader, lost, remove=False)
        self.cluster.kill(svc)
        self.down[svc.name] = f.id
        self.paused.pop(svc.name, None)
        self.lost.add(svc.name)
        detail = damage(svc)
        return self._restart_at_heal([svc], f), {"services": [svc.name], **detail}

    def _restart_at_heal(self, victims: list[Service], f: Fault) -> Heal:
        """The heal of a fault that took ``victims`` down: start each that
        this fault still holds down."""

        def heal() -> None:
            for svc in victims:
                if self.down.get(svc.name) == f.id:
                    del self.down[svc.name]
                    self.cluster.start(svc)

        return heal

    def _pause(self, f: Fault, leader: int) -> tuple[Heal, dict[str, Any]]:
        if f.target == "queue":
            (svc,) = self._queues("queue", allow_paused=False)
        else:
            (svc,) = self._nodes(f.target, leader, allow_paused=False)
        pid = svc.pid
        svc.signal(signal.SIGSTOP)
        self.paused[svc.name] = (f.id, pid)

        def heal() -> None:
            if self.paused.get(svc.name) == (f.id, pid) and svc.pid == pid:
                svc.signal(signal.SIGCONT)
                del self.paused[svc.name]

        return heal, {"services": [svc.name]}

    def _partition(self, f: Fault, leader: int) -> tuple[Heal, dict[str, Any]]:
        c = self.cluster
        nodes = c.node_services
        ip = {s.name: s.host.ip for s in c.services.values()}
        if f.target == "group-leader-isolated":
            leader = self._group_leader(leader)[1]
        lead = next((s for s in nodes if s.ident == leader), None) or self.rng.choice(nodes)
        others = [s for s in nodes if s is not lead]
        if f.target in ("leader-isolated", "group-leader-isolated"):
            sides = [[lead], others]  # queue servers reach both sides
        elif f.target == "majority-minority":
            minority = self.rng.sample(nodes, (len(nodes) - 1) // 2)
            qs = list(c.queue_services)
            self.rng.shuffle(qs)
            # A queue server on each side: clients reach both.
            sides = [[*minority, *qs[:1]], [s for s in nodes if s not in minority] + qs[1:]]
        elif f.target == "bridge":
            a, b = self.rng.sample(nodes, 2)  # a and b cut, the rest reach both
            sides = [[a], [b]]
        elif f.target == "one-way":
            follower = self.rng.choice(others)
            deaf, source = (follower, lead) if f.params.get("from_leader") else (lead, follower)
            c.block(deaf.host, {source.host.ip}, set())
            return c.heal_partitions, {"deaf": deaf.name, "to": source.name}
        else:
            raise ValueError(f.target)
        names = [[s.name for s in side] for side in sides]
        for k, side in enumerate(sides):
            away = {ip[s.name] for j, other in enumerate(sides) if j != k for s in other}
            for s in side:
                c.block(s.host, away, away)
        return c.heal_partitions, {"sides": names}

    def _loss(self, f: Fault, leader: int) -> tuple[Heal, dict[str, Any]]:
        c = self.cluster
        if f.target == "all":
            victims = list(c.services.values())
        else:
            victims = [self.rng.choice(c.node_services)]
        pct = int(f.params["percent"])
        for s in victims:
            c.lossy(s.host, pct)

        def heal() -> None:
            for s in victims:
                c.heal_loss(s.host)

        return heal, {"services": [s.name for s in victims], "percent": pct}

    def _slow(self, f: Fault, leader: int) -> tuple[Heal, dict[str, Any]]:
        c = self.cluster
        if f.target == "queue":
            (svc,) = self._queues("queue")
        else:
            (svc,) = self._nodes(f.target, leader)
        kbit, queue_ms = int(f.params["kbit"]), int(f.params["queue_ms"])
        c.slow(svc.host, kbit, queue_ms)
        return (lambda: c.heal_slow(svc.host)), {
            "services": [svc.name],
            "kbit": kbit,
            "queue_ms": queue_ms,
        }

    def _member(self, f: Fault, leader: int) -> tuple[Heal, dict[str, Any]]:
        """Remove a voter (it keeps running, outside the configuration); at
        heal, add it back as a learner for the leader to promote. One
        member out at a time, and only while a majority of the voters left
        holds its copy (with 3 nodes: none catching up)."""
        c = self.cluster
        self._add_back(tries=1)  # one left out by a heal that found no leader
        if self.removed:
            raise Skip("a member is out or not promoted yet")
        lost = self._lost_copies()
        self._configuration_settled(leader, lost)
        svc = self._quiet_target(f.target, leader, lost, remove=True)
        # Whatever the answer (a timeout may come after the change), the node
        # may be out now: it is added back at heal (adding a member is a no-op).
        self.removed.add(svc.ident)
        self.held_out.add(svc.ident)
        acked = self._admin_op("remove_node", svc.ident, c.remove_node)

        def heal() -> None:
            self.held_out.discard(svc.ident)
            self._add_back(tries=2)

        return heal, {"services": [svc.name], "acked": acked}

    def _quiet_target(self, target: str, leader: int, lost: set[int], remove: bool) -> Service:
        """The node a quiet fault takes (its copy, or with ``remove`` its
        place): among those neither out of the configuration nor without
        their copy; Skip unless a majority of the voters keeps its copy
        after (``keeps_a_majority``)."""
        (svc,) = self._nodes(target, leader, exclude=lost | self.removed)
        everyone = {s.ident for s in self.cluster.node_services}
        if not keeps_a_majority(everyone, self.removed, lost, svc.ident, remove):
            names = sorted(f"n{k}" for k in lost)
            out = sorted(f"n{k}" for k in self.removed)
            raise Skip(
                f"{names} not caught up since a wipe or a damaged log, {out} out of the "
                "configuration: a majority would not keep its copy"
            )
        return svc

    def _configuration_settled(self, leader: int, lost: set[int]) -> None:
        """Skip unless the leader's configuration is every node but those
        out by a membership fault, no learner, and committed (a newer leader
        may lack one that is not), and every data group has followed it with
        none catching up in it but the nodes in ``lost``."""
        voters = {s.ident for s in self.cluster.node_services} - self.removed
        conf = self.cluster.voters(leader, committed=True) if leader else None
        if conf is None:
            raise Skip("no leader answers, or its configuration is not committed")
        if conf != (voters, set()):
            raise Skip(
                f"a member is out or not promoted yet: voters {sorted(conf[0])}, learners "
                f"{sorted(conf[1])}, not {sorted(voters)}"
            )
        if not self.cluster.data_groups_settled(voters, lost):
            raise Skip("a data group has not followed the membership yet, or has no leader")

    def _lost_copies(self) -> set[int]:
        """The nodes without their copy: catching up since a wipe or a
        damaged log, or having lost it and not said since that they caught
        up (down, starting, or not asked yet)."""
        for s in self.cluster.node_services:
            if s.name in self.lost and s.running() and self.cluster.catching_up(s) is False:
                self.lost.discard(s.name)
        groups = self.cluster.groups()
        return {
            s.ident
            for s in self.cluster.node_services
            if not _holds_a_copy(self.cluster, s, groups) or s.name in self.lost
        }

    def _admin_op(self, f: str, ident: int, call: Callable[[int], bool]) -> bool:
        """A membership change, recorded as an operation (ok when the
        cluster acknowledged it, else unknown)."""
        op = self.rec.invoke("nemesis", f, node=ident)
        ok = call(ident)
        self.rec.complete("nemesis", op, "ok" if ok else "info", f, node=ident)
        return ok

    def _add_back(self, tries: int) -> None:
        """Add the removed nodes back as learners (not those whose fault
        still lasts), each tried up to ``tries`` times a second apart (an
        election may be under way); what is still out is tried again by the
        next start and by ``heal_all``."""
        for ident in sorted(self.removed - self.held_out):
            for k in range(tries):
                if self._admin_op("add_node", ident, self.cluster.add_node):
                    self.removed.discard(ident)
                    break
                if k + 1 < tries:
                    threading.Event().wait(1.0)

    def settle_membership(self, timeout: float = 60.0) -> None:
        """At the end: record the leader's configuration as found (the
        ``membership`` property judges it), then add back every node it
        lacks until it has them all (bounded by ``timeout``)."""
        c = self.cluster
        everyone = {s.ident for s in c.node_services}
        deadline = time.monotonic() + timeout
        first = True
        while time.monotonic() < deadline:
            leader = c.leader()
            conf = c.voters(leader) if leader else None
            if conf is not None:
                if first:
                    self.rec.event("run", "ok", "config", leader=leader,
                                   voters=sorted(conf[0]), learners=sorted(conf[1]))  # fmt: skip
                    first = False
                missing = everyone - conf[0] - conf[1]
                if not missing:
                    return
                self.removed |= missing
                self._add_back(tries=1)
            threading.Event().wait(1.0)

    def _disk(self, f: Fault, leader: int) -> tuple[Heal, dict[str, Any]]:
        c = self.cluster
        (svc,) = self._nodes(f.target, leader)
        leave = 0 if f.params["fill"] == "full" else c.min_free_bytes // 2
        written = c.fill_disk(svc, leave)
        return (lambda: c.free_disk(svc)), {
            "services": [svc.name],
            "fill": f.params["fill"],
            "ballast_bytes": written,
        }

    def _clock(self, f: Fault, leader: int) -> tuple[Heal, dict[str, Any]]:
        c = self.cluster
        (svc,) = self._nodes(f.target, leader)
        offset = float(f.params["offset_s"])
        c.set_clock(svc, offset)
        return (lambda: c.set_clock(svc, 0)), {"services": [svc.name], "offset_s": offset}
