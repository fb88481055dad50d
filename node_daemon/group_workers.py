"""The main process's worker processes (docs/multiraft.md step 5): with
``workers`` above 1 the node runs group 0 itself and its data groups in
that many worker processes (``worker_process``), each on a core of its
own, group g in worker (g-1) mod W.

``GroupWorkers`` starts them, tells each group 0's figures as they move
(commit index, configuration, addresses, queue servers), keeps what each
tells of its groups (``RemoteGroup``: what group 0's handlers read, and the
node's status shows) and its ports (the peer transport's ``group_ports``,
so peers send each group's messages to its worker), and starts a worker
again when it dies (its groups' followers elsewhere carry on meanwhile).

Invariants: a worker is started again only after the last one of its
share exited (its locks on the groups are gone with it); a stop asks every
worker to hand over the groups it leads and stop, and kills what has not
stopped within STOP_WAIT_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from node_daemon import worker_process
from node_daemon.config import NodeConfig
from node_daemon.node import RaftNode, group_data_dir
from node_daemon.remote_group import RemoteGroup
from node_daemon.transport import PeerTransport
from node_daemon.worker_metrics import WorkerMetrics
from node_daemon.worker_process import WorkerSpec, shares

log = logging.getLogger("roadlog.node")

SUPERVISE_S = 0.05  # how often group 0's figures and the workers' lives are looked at
RESTART_FIRST_S = 0.5  # a dead worker is started again after this, doubling
RESTART_MAX_S = 30.0  # up to this
STEADY_S = 60.0  # a worker up this long starts its backoff over
STOP_WAIT_S = 15.0


def remote_groups(cfg: NodeConfig) -> dict[int, RemoteGroup]:
    """Each data group, as the main process reads it."""
    data = Path(cfg.data_dir)
    return {
        g: RemoteGroup(g, group_data_dir(data, g) / "state") for g in range(1, cfg.data_groups + 1)
    }


@dataclass
class _Worker:
    index: int
    groups: tuple[int, ...]
    process: BaseProcess | None = None
    conn: Connection | None = None
    grpc_port: int = 0
    frames_port: int = 0
    started: float = 0.0
    restarts: int = 0
    backoff: float = RESTART_FIRST_S
    due: float = 0.0  # when to start it again, once dead
    told: str = ""  # group 0's figures as last told


class GroupWorkers:
    def __init__(
        self,
        cfg: NodeConfig,
        meta: RaftNode,
        remote: dict[int, RemoteGroup],
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
        self.workers = [_Worker(i, s) for i, s in enumerate(shares(cfg.data_groups, cfg.workers))]
        self._ctx = multiprocessing.get_context("spawn")
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    # ------------------------------------------------------------ lifecycle

    def _tell_ports(self) -> None:
        """Peers learn where each data group runs (0: its worker is not
        listening yet, so they neither send its messages here nor give up)."""
        self.transport.set_group_ports({g: w.grpc_port for w in self.workers for g in w.groups})

    def start(self) -> None:
        self._tell_ports()
        for w in self.workers:
            self._spawn(w)
        self._task = asyncio.get_running_loop().create_task(self._supervise())

    def _spawn(self, w: _Worker) -> None:
        here, there = self._ctx.Pipe()
        spec = WorkerSpec(w.index, w.groups, self.cfg, w.grpc_port, w.frames_port)
        p = self._ctx.Process(
            target=worker_process.main,
            args=(spec, there, os.getpid()),
            name=f"roadlog-worker-{w.index}",
        )
        p.start()
        there.close()
        w.process, w.conn, w.started, w.told = p, here, time.monotonic(), ""
        asyncio.get_running_loop().add_reader(here.fileno(), self._readable, w)
        self._tell_group0(w)
        log.info(
            "worker process started",
            extra={"worker": w.index, "groups": list(w.groups), "pid": p.pid},
        )

    def _readable(self, w: _Worker) -> None:
        conn = w.conn
        if conn is None:
            return
        try:
            while conn.poll():
                self._take(w, conn.recv())
        except (EOFError, OSError):
            self._closed(w)

    def _closed(self, w: _Worker) -> None:
        if w.conn is not None:
            asyncio.get_running_loop().remove_reader(w.conn.fileno())
            w.conn.close()
            w.conn = None

    def _take(self, w: _Worker, msg: dict[str, Any]) -> None:
        kind = msg.get("kind")
        if kind == "ports":
            w.grpc_port, w.frames_port = int(msg["grpc"]), int(msg["frames"])
            self._tell_ports()
            log.info(
                "worker process listening",
                extra={"worker": w.index, "grpc": w.grpc_port, "frames": w.frames_port},
            )
        elif kind == "metrics":
            if self.metrics is not None:
                self.metrics.told(w.index, str(msg["text"]))
        elif kind == "groups":
            for g, fig in msg["groups"].items():
                rg = self.remote.get(int(g))
                if rg is not None:
                    rg.told(
                        fig["committed"],
                        fig["voters"],
                        fig["learners"],
                        fig["leader"],
                        fig["status"],
                    )

    def _send(self, w: _Worker, msg: dict[str, Any]) -> None:
        if w.conn is not None:
            try:
                w.conn.send(msg)
            except (OSError, ValueError):
                self._closed(w)

    def _group0(self) -> dict[str, Any]:
        core = self.meta.core
        return {
            "kind": "group0",
            "committed": core.log.committed,
            "voters": sorted(core.conf.voters),
            "learners": sorted(core.conf.learners),
            "addresses": dict(self.meta.addresses),
            "queue_servers": list(self.queue_servers()),
        }

    def _tell_group0(self, w: _Worker, msg: dict[str, Any] | None = None) -> None:
        msg = msg or self._group0()
        key = repr(sorted(msg.items()))
        if key != w.told:
            w.told = key
            self._send(w, msg)

    async def _supervise(self) -> None:
        while not self._stopping:
            await asyncio.sleep(SUPERVISE_S)
            msg = self._group0()
            now = time.monotonic()
            for w in self.workers:
                p = w.process
                if p is not None and p.is_alive():
                    self._tell_group0(w, msg)
                    continue
                if p is not None:  # it died: start it again after a backoff
                    self._closed(w)
                    if self.metrics is not None:
                        self.metrics.forget(w.index)
                    w.process = None
                    if now - w.started > STEADY_S:
                        w.backoff = RESTART_FIRST_S
                    w.due = now + w.backoff
                    w.backoff = min(w.backoff * 2, RESTART_MAX_S)
                    log.error(
                        "worker process died: starting it again",
                        extra={
                            "worker": w.index,
                            "exitcode": p.exitcode,
                            "in_s": round(w.due - now, 2),
                        },
                    )
                    for g in w.groups:
                        rg = self.remote.get(g)
                        if rg is not None:
                            rg.leader = False
                elif now >= w.due:
                    w.restarts += 1
                    self._spawn(w)

    def alive(self) -> bool:
        """Every worker runs and listens."""
        return all(
            w.process is not None and w.process.is_alive() and w.grpc_port for w in self.workers
        )

    async def hand_over(self, target: int = 0) -> None:
        """Ask every worker to hand the groups it leads to ``target`` (0: to
        each group's best follower)."""
        for w in self.workers:
            self._send(w, {"kind": "hand_over", "to": target})

    async def stop(self) -> None:
        """Ask every worker to hand over and stop; kill what does not."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for w in self.workers:
            self._send(w, {"kind": "stop"})
        deadline = time.monotonic() + STOP_WAIT_S
        for w in self.workers:
            p = w.process
            while p is not None and p.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if p is not None and p.is_alive():
                log.warning("worker process did not stop: killing it", extra={"worker": w.index})
                p.kill()
                p.join(5)
            self._closed(w)


def with_workers(cfg: NodeConfig) -> bool:
    """Whether this node runs its data groups in worker processes."""
    return cfg.workers > 1 and cfg.data_groups > 1
