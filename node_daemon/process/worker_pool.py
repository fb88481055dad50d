"""The main process's worker processes (docs/multiraft.md step 5): with
``workers`` above 1 the node runs group 0 itself and its data groups in
that many worker processes (``worker_process``), each on a core of its
own, group g in worker (g-1) mod W.

``WorkerPool`` starts them, tells each group 0's figures as they move
(commit index, configuration, addresses, queue servers), keeps what each
tells of its groups (``RemoteReplica``: what group 0's handlers read, and the
node's status shows) and its ports (the peer transport's ``group_ports``,
so peers send each group's messages to its worker), and starts a worker
again when it dies (its groups' followers elsewhere carry on meanwhile).

A worker is forked by the node's zygote (``zygote``: preloaded, so it
starts without importing the node again) and is the node's child, watched
with a pidfd; where the zygote is not there or fails, it is spawned with
``multiprocessing`` (logged), as before.

Invariants: a worker is started again only after the last one of its
share exited (its locks on the groups are gone with it, ``store.data_group_lock``);
the pipes never block the main process's event loop (``pipe``); a
stop asks every worker to hand over the groups it leads and stop (workers
ignore the unit's SIGTERM: the main process decides), starts none again,
and kills what has not stopped within STOP_WAIT_S.

Invariant (idle cost): the pool looks at group 0's figures and its workers'
lives when something moved, not on a short timer: when group 0's leader,
role or applied index moves (its state listeners; a commit and a
configuration change are applied), when a worker exits (its process's
sentinel turns readable), when a dead worker is due to start again, and
otherwise every LOOK_EVERY_S (addresses and queue servers, which move
without a state change); never more often than every SUPERVISE_S, so a
loaded group 0 (its applied index moving all the time) costs what the
50 ms poll did, and an idle node a look a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from node_daemon.config import NodeConfig
from node_daemon.process import worker_process, zygote
from node_daemon.process.pipe import BarrierAsks, ProcessPipe
from node_daemon.process.pipe_messages import (
    AskMetrics,
    Barrier,
    Group0,
    Groups,
    HandOver,
    Message,
    Metrics,
    Ports,
    ReadBarrier,
    Stop,
)
from node_daemon.process.worker_metrics import WorkerMetrics
from node_daemon.process.worker_process import WorkerSpec, barrier_answer, shares
from node_daemon.replica.remote import RemoteReplica
from node_daemon.replica.replica import Replica
from node_daemon.replica.status import group_figures
from node_daemon.storage.group_logs import group_data_dir
from node_daemon.transport.peer_transport import PeerTransport
from roadlog.errors import Code, RoadlogError

log = logging.getLogger("roadlog.node")

SUPERVISE_S = 0.05  # group 0's figures and the workers' lives are looked at most this often
LOOK_EVERY_S = 1.0  # and at least this often (what moves without a word: addresses, queue servers)
RESTART_FIRST_S = 0.5  # a dead worker is started again after this, doubling
RESTART_MAX_S = 30.0  # up to this
STEADY_S = 60.0  # a worker up this long starts its backoff over
STOP_WAIT_S = 15.0


def remote_replicas(cfg: NodeConfig) -> dict[int, RemoteReplica]:
    """Each data group, as the main process reads it."""
    data = Path(cfg.data_dir)
    return {
        g: RemoteReplica(g, group_data_dir(data, g) / "state")
        for g in range(1, cfg.data_groups + 1)
    }


class WorkerProc(Protocol):
    """A worker process as the pool reads it: a ``multiprocessing`` Process
    (spawned) or a ``zygote.Forked`` (forked by the zygote)."""

    @property
    def pid(self) -> int | None: ...
    @property
    def sentinel(self) -> int: ...
    @property
    def exitcode(self) -> int | None: ...
    def is_alive(self) -> bool: ...
    def kill(self) -> None: ...


@dataclass
class _Worker:
    index: int
    groups: tuple[int, ...]
    process: WorkerProc | None = None
    pipe: ProcessPipe | None = None
    reader: asyncio.Task[None] | None = None
    grpc_port: int = 0  # where it listens now (0: not listening)
    frames_port: int = 0
    last_grpc_port: int = 0  # where it listened last: a restart asks for it again
    last_frames_port: int = 0
    started: float = 0.0
    restarts: int = 0
    backoff: float = RESTART_FIRST_S
    due: float = 0.0  # when to start it again, once dead
    told: Group0 | None = None  # group 0's figures as last told
    asks: BarrierAsks = field(default_factory=BarrierAsks)  # its groups' ReadIndexes asked


class WorkerPool:
    def __init__(
        self,
        cfg: NodeConfig,
        meta: Replica,
        remote: dict[int, RemoteReplica],
        queue_servers: Callable[[], list[str]],
        metrics: WorkerMetrics | None = None,
    ) -> None:
        """``metrics``: where the workers' metrics go (the node's /metrics)."""
        self.cfg = cfg
        self.metrics = metrics
        self.meta = meta
        self.remote = remote
        self.queue_servers = queue_servers
        self.transport: PeerTransport = meta.transport
        self.workers = [
            _Worker(i, s) for i, s in enumerate(shares(cfg.data_groups, cfg.worker_processes))
        ]
        if cfg.worker_ports:  # fixed, for the firewall: two each
            for w in self.workers:
                w.last_grpc_port = cfg.worker_ports + 2 * w.index
                w.last_frames_port = w.last_grpc_port + 1
        self._ctx = multiprocessing.get_context("spawn")
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._answering: set[asyncio.Task[None]] = set()
        for g, rg in remote.items():
            rg.ask_barrier = functools.partial(self._ask_barrier, g)
        self.tell_ports()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poked = asyncio.Event()  # something moved: look (``_supervise``)
        self._poked.set()  # the first look comes at once
        self._watched: dict[int, int] = {}  # worker index -> the sentinel fd read for its exit

    def _ask_metrics_soon(self) -> None:
        """From the scrape thread: ``ask_metrics`` on the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            if self.metrics is not None:
                self.metrics.asked(())  # no loop: nobody to wait for
            return
        loop.call_soon_threadsafe(self.ask_metrics)

    def ask_metrics(self) -> None:
        """Ask every worker that runs for its metrics (a scrape waits for
        their answers, ``WorkerMetrics.refresh``)."""
        asked = [w.index for w in self.workers if self._send(w, AskMetrics(), droppable=True)]
        if self.metrics is not None:
            self.metrics.asked(asked)

    # ------------------------------------------------------------ lifecycle

    def tell_ports(self) -> None:
        """Peers learn where each data group runs (0: its worker is not
        listening yet, so they neither send its messages to the main process
        nor give up). Set before the node's gRPC server answers anyone."""
        self.transport.set_group_ports({g: w.grpc_port for w in self.workers for g in w.groups})

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.metrics is not None:
            self.metrics.asks_with(self._ask_metrics_soon)
        for w in self.workers:
            await self._spawn(w)
        self.meta.state_listeners.append(self.poke)
        self._task = asyncio.get_running_loop().create_task(self._supervise())

    def poke(self) -> None:
        """Something moved: the pool looks (within SUPERVISE_S)."""
        self._poked.set()

    def _watch(self, w: _Worker, p: WorkerProc) -> None:
        """Poke when ``p`` exits (its sentinel turns readable)."""
        self._unwatch(w)
        fd = p.sentinel
        asyncio.get_running_loop().add_reader(fd, self._exited, w)
        self._watched[w.index] = fd

    def _exited(self, w: _Worker) -> None:
        self._unwatch(w)  # readable for good from now on: read once
        self.poke()

    def _unwatch(self, w: _Worker) -> None:
        fd = self._watched.pop(w.index, None)
        if fd is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(fd)

    def _next_look_in(self, now: float) -> float:
        """Seconds until the pool must look without a poke: LOOK_EVERY_S, or
        sooner when a dead worker is due to start again."""
        due = [w.due - now for w in self.workers if w.process is None]
        return max(0.0, min([LOOK_EVERY_S, *due]))

    async def _spawn(self, w: _Worker) -> None:
        """Start ``w``: forked by the zygote, else spawned (logged)."""
        here, there = self._ctx.Pipe()
        spec = WorkerSpec(w.index, w.groups, self.cfg, w.last_grpc_port, w.last_frames_port)
        p: WorkerProc | None = None
        how = "forked"
        z = zygote.current()
        if z is not None:
            try:
                p = zygote.Forked(await z.fork(worker_process.main, spec, there, os.getpid()))
            except (zygote.ZygoteError, OSError) as e:
                log.warning(
                    "the zygote could not start a worker: spawning it",
                    extra={"worker": w.index, "error": str(e)},
                )
                # A fresh pipe: a worker forked too late reads the end of
                # this one and stops, its groups' locks with it.
                here.close()
                there.close()
                here, there = self._ctx.Pipe()
        if p is None:
            how = "spawned"
            spawned = self._ctx.Process(
                target=worker_process.main,
                args=(spec, there, os.getpid()),
                name=f"roadlog-worker-{w.index}",
            )
            spawned.start()
            p = spawned
        there.close()
        log.info(
            "worker process started",
            extra={"worker": w.index, "groups": list(w.groups), "pid": p.pid, "how": how},
        )
        self._watch(w, p)
        pipe = await ProcessPipe.open(here, peer=f"worker {w.index}")
        w.process, w.pipe, w.started, w.told = p, pipe, time.monotonic(), None
        w.reader = asyncio.get_running_loop().create_task(self._read(w, pipe))
        self._tell_group0(w)

    async def _read(self, w: _Worker, pipe: ProcessPipe) -> None:
        while True:
            try:
                msg = await pipe.recv()
            except EOFError:
                return  # it exited (or is about to): _supervise sees to it
            try:
                self._take(w, msg)
            except Exception:  # one message's failure stops nothing else
                log.exception(
                    "a worker's message could not be taken",
                    extra={"worker": w.index, "kind": type(msg).__name__},
                )

    def _closed(self, w: _Worker) -> None:
        if w.reader is not None:
            w.reader.cancel()
            w.reader = None
        if w.pipe is not None:
            w.pipe.close()
            w.pipe = None

    def _take(self, w: _Worker, msg: Message) -> None:
        match msg:
            case Ports():
                w.grpc_port, w.frames_port = msg.grpc, msg.frames
                w.last_grpc_port, w.last_frames_port = w.grpc_port, w.frames_port
                self.tell_ports()
                log.info(
                    "worker process listening",
                    extra={"worker": w.index, "grpc": w.grpc_port, "frames": w.frames_port},
                )
            case ReadBarrier():  # a worker asks for group 0's ReadIndex
                task = asyncio.get_running_loop().create_task(self._answer_barrier(w, msg))
                self._answering.add(task)
                task.add_done_callback(self._answering.discard)
            case Barrier():
                w.asks.answered(msg)
            case Metrics():
                if self.metrics is not None:
                    self.metrics.told(w.index, msg.text)
            case Groups():
                for fig in msg.figures:
                    rg = self.remote.get(fig.group)
                    if rg is not None:
                        rg.told(fig)
            case _:
                log.error(
                    "a message a worker does not send: ignored",
                    extra={"worker": w.index, "kind": type(msg).__name__},
                )

    def _send(self, w: _Worker, msg: Message, droppable: bool = False) -> bool:
        return w.pipe is not None and w.pipe.send(msg, droppable)

    def _group0(self) -> Group0:
        f = group_figures(self.meta)
        return Group0(
            commit_index=f.commit_index,
            voters=f.voters,
            learners=f.learners,
            addresses=dict(self.meta.addresses),
            queue_servers=tuple(self.queue_servers()),
        )

    def _tell_group0(self, w: _Worker, msg: Group0 | None = None) -> None:
        """Group 0's figures, if they moved since last told (and the worker
        keeps up: the latest are told at the next look otherwise)."""
        msg = msg or self._group0()
        if msg != w.told and self._send(w, msg, droppable=True):
            w.told = msg

    async def _supervise(self) -> None:
        while not self._stopping:
            await asyncio.sleep(SUPERVISE_S)  # at most this often
            if not self._poked.is_set():
                with contextlib.suppress(TimeoutError):
                    timeout = self._next_look_in(time.monotonic())
                    await asyncio.wait_for(self._poked.wait(), timeout)
            self._poked.clear()
            try:
                await self._look()
            except Exception:  # keep supervising: a worker must not stay dead
                log.exception("supervising the worker processes failed")

    async def _look(self) -> None:
        msg = self._group0()
        now = time.monotonic()
        for w in self.workers:
            if self._stopping:
                return
            p = w.process
            if p is not None and p.is_alive():
                self._tell_group0(w, msg)
                continue
            if p is not None:  # it died: start it again after a backoff
                self._died(w, p, now)
            elif now >= w.due:
                w.restarts += 1
                await self._spawn(w)

    async def _answer_barrier(self, w: _Worker, ask: ReadBarrier) -> None:
        answer = await barrier_answer(self.meta if ask.group == 0 else None, ask)
        self._send(w, answer)

    async def _ask_barrier(self, group: int) -> int:
        """A ReadIndex of ``group``, taken by the worker that runs it."""
        w = next((x for x in self.workers if group in x.groups), None)
        if w is None or w.pipe is None:
            raise RoadlogError(Code.UNAVAILABLE, f"no worker runs group {group} now")
        return await w.asks.ask(w.pipe, group)

    def _died(self, w: _Worker, p: WorkerProc, now: float) -> None:
        w.asks.fail_all("its worker process died")
        self._unwatch(w)
        if isinstance(p, zygote.Forked):
            p.close()  # its pidfd, no longer watched
        self._closed(w)
        w.process = None
        w.grpc_port = w.frames_port = 0
        self.tell_ports()  # peers hold its groups' messages until it listens again
        # Its read transactions on group 0's state died with it: their
        # slots would pin old pages for good.
        self.meta.sm.env.reader_check()
        if self.metrics is not None:
            self.metrics.forget(w.index)
        if now - w.started > STEADY_S:
            w.backoff = RESTART_FIRST_S
        w.due = now + w.backoff
        w.backoff = min(w.backoff * 2, RESTART_MAX_S)
        log.error(
            "worker process died: starting it again",
            extra={"worker": w.index, "exitcode": p.exitcode, "in_s": round(w.due - now, 2)},
        )
        for g in w.groups:
            rg = self.remote.get(g)
            if rg is not None:
                rg.leader = False

    def alive(self) -> bool:
        """Every worker runs and listens (asked from the health thread)."""
        for w in list(self.workers):
            p = w.process
            if p is None or not w.grpc_port or not p.is_alive():
                return False
        return True

    async def hand_over(self, target: int = 0) -> None:
        """Ask every worker to hand the groups it leads to ``target`` (0: to
        each group's best follower)."""
        for w in self.workers:
            self._send(w, HandOver(target))

    def begin_stop(self) -> None:
        """Start none again; ask every worker to hand over and stop."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
        for w in self.workers:
            self._send(w, Stop())

    async def stop(self) -> None:
        """``begin_stop``, then wait for the workers; kill what does not stop."""
        self.begin_stop()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        deadline = time.monotonic() + STOP_WAIT_S
        for w in self.workers:
            self._unwatch(w)
            p = w.process
            while p is not None and p.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if p is not None and p.is_alive():
                log.warning("worker process did not stop: killing it", extra={"worker": w.index})
                p.kill()
                for _ in range(100):  # bounded: 5 s
                    if not p.is_alive():
                        break
                    await asyncio.sleep(0.05)
            if isinstance(p, zygote.Forked) and not p.is_alive():
                p.close()  # reaped: its pidfd
            self._closed(w)


def with_workers(cfg: NodeConfig) -> bool:
    """Whether this node runs its data groups in worker processes."""
    return cfg.worker_processes > 1
