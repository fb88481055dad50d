"""A worker process: a share of this node's data groups, on a core of its
own (docs/multiraft.md step 5).

The node's main process (``worker_pool``) starts one per ``workers``,
forked by the node's zygote (``zygote``: forked from the main process
before any gRPC object, LMDB environment or thread existed, so a worker
starts from a clean, preloaded process), or spawned with
``multiprocessing`` where the zygote fails, and tells it which groups are
its (group g in worker (g-1) mod W). Either way it is a child of the main
process, named ``zygote.WORKER_NAME``, and makes its gRPC objects, LMDB
environments, event loop and threads itself.
A worker runs each of its groups as a ``Replica``, with its own event
loop, log store (its groups' Raft logs in one LMDB environment,
``logs/worker-<i>/``), state environments (``groups/<g>/``), peer transport (its own gRPC and
framed ports, which the main process tells peers: ``group_ports``) and
Work links to every queue server (``data_groups_only``). It reads group 0
as a ``RemoteReplica``: the main process's replica, read-only, and group 0's
commit index, configuration, addresses and queue servers as the main
process tells them over the pipe.

Over the pipe (``pipe``; the messages are ``pipe_messages``'s dataclasses):
- main -> worker: ``Group0``, group 0's figures (first before anything
  starts, then as they move); ``HandOver(n)``, hand every group it leads
  to node n (0: each to its best follower); ``Stop``, hand over, then stop.
- worker -> main: ``Ports`` once listening; ``Groups``, the figures of
  each group that moved, once (``GroupFigures``, at most every
  ``TELL_EVERY_S``); ``Metrics``, only as the answer to an ``AskMetrics``
  (a scrape of the main process: an idle worker makes no exposition).
- either way: ``ReadBarrier``, answered by a ``Barrier``.

Invariants: a worker dies with its main process (``PR_SET_PDEATHSIG``, set
once the main process is its parent; it exits at once if it is not),
and holds an exclusive lock on each of its groups' directories for its
whole life, so no two processes ever run one group of a node; it never
writes group 0's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from prometheus_client import generate_latest

from node_daemon.config import NodeConfig
from node_daemon.process import zygote
from node_daemon.process.grpc_server import node_grpc_server
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
from node_daemon.replica.remote import RemoteReplica
from node_daemon.replica.replica import NotLeader, Replica
from node_daemon.replica.status import GroupFigures, group_figures
from node_daemon.storage.group_logs import group_data_dir
from node_daemon.store.leader_balance import successor
from node_daemon.store.store import Store
from node_daemon.transport.peer_transport import PeerTransport
from node_daemon.work.handler import WorkHandler
from node_daemon.work.queue_link import QueueServerLink
from node_daemon.work.routing import WorkRouter
from roadlog.runtime import eventloop, tls
from roadlog.runtime.auth import cluster_token
from roadlog.runtime.logs import setup_logging
from roadlog.v1 import raft_pb2_grpc

log = logging.getLogger("roadlog.node.worker")

TELL_EVERY_S = 0.05  # group figures to the main process at most this often
BARRIER_WAIT_S = 2.0  # a ReadIndex for the main process: given up after this
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker is started with. ``grpc_port``/``frames_port``: the
    ports it had before a restart (0: any), so peers find it where it was."""

    index: int
    groups: tuple[int, ...]
    cfg: NodeConfig
    grpc_port: int = 0
    frames_port: int = 0


def worker_of(group: int, workers: int) -> int:
    """The worker (0-based) that runs data group ``group`` (>= 1)."""
    return (group - 1) % workers


def shares(data_groups: int, workers: int) -> list[tuple[int, ...]]:
    """Each worker's data groups; no worker is empty (at most one per group)."""
    count = max(1, min(workers, data_groups))
    return [
        tuple(g for g in range(1, data_groups + 1) if worker_of(g, count) == w)
        for w in range(count)
    ]


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies (Linux); exit at once if it
    already has."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def main(spec: WorkerSpec, conn: Connection, parent: int) -> None:
    """The worker's entry point (forked by the zygote, or spawned)."""
    _die_with_parent(parent)
    zygote.set_name(zygote.WORKER_NAME)  # a forked one is already; a spawned one now
    cfg = spec.cfg
    setup_logging(f"node-worker-{spec.index}", cfg.log_level)
    tls.install(tls.load_security(cfg.certs_dir, cfg.insecure, "node"))
    # A terminal's ^C and systemd's SIGTERM (sent to every process of the
    # unit) are the main process's to act on: it tells each worker to hand
    # over and stop, and a worker it would not see stop is not restarted.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        eventloop.run(_serve(spec, conn))
    except Exception:
        log.exception("worker failed", extra={"worker": spec.index})
        sys.exit(1)


async def _serve(spec: WorkerSpec, conn: Connection) -> None:
    cfg = spec.cfg
    pipe = await ProcessPipe.open(conn, peer="main process")
    inbox: asyncio.Queue[Message | None] = asyncio.Queue()  # None: the pipe closed

    async def read_pipe() -> None:
        try:
            while True:
                inbox.put_nowait(await pipe.recv())
        except EOFError:
            inbox.put_nowait(None)

    reading = asyncio.get_running_loop().create_task(read_pipe())
    secret = cfg.secret()
    token = cluster_token(secret, cfg.cluster_name)
    group0 = RemoteReplica(0, group_data_dir(Path(cfg.data_dir), 0) / "state")
    first = await inbox.get()
    if not isinstance(first, Group0):
        if first is not None:
            log.error(
                "the main process's first message is not group 0's figures: stopping",
                extra={"worker": spec.index, "kind": type(first).__name__},
            )
        return  # the main process went away before it said anything
    _take_group0(group0, first)
    transport = PeerTransport.bare(cfg.node_id, cfg.cluster_name, secret)
    groups = Store(
        cfg, local=spec.groups, group0=group0, transport=transport,
        log_store=f"worker-{spec.index}",
    )  # fmt: skip
    groups.update_addresses(first.addresses)
    server = node_grpc_server(token)
    raft_pb2_grpc.add_RaftPeerServicer_to_server(transport, server)
    host = cfg.listen.rpartition(":")[0]
    port = 0
    for want in dict.fromkeys((spec.grpc_port, 0)):  # where it was, else anywhere
        with contextlib.suppress(RuntimeError):
            port = tls.current().add_port(server, f"{host}:{want}", mutual=True)
        if port:
            break
    if not port:
        raise RuntimeError(f"cannot listen on {host}")
    if spec.grpc_port and port != spec.grpc_port:
        log.warning(
            "worker's gRPC port taken: listening on another (peers learn it; a firewall may not)",
            extra={"wanted": spec.grpc_port, "port": port},
        )
    await server.start()
    frames_port = 0
    if cfg.peer_frames_port >= 0:
        bare_host = host.strip("[]")
        frames_port = await transport.start_frames(bare_host, spec.frames_port)
        if not frames_port and spec.frames_port:
            frames_port = await transport.start_frames(bare_host, 0)
    pipe.send(Ports(port, frames_port))
    failed: list[BaseException] = []
    stop = asyncio.Event()

    def driver_failed(e: BaseException) -> None:
        failed.append(e)
        stop.set()

    await groups.start(driver_failed)
    executor = WorkRouter({g: WorkHandler(n) for g, n in groups.data.items()})
    any_node = next(iter(groups.data.values()))
    links: dict[str, QueueServerLink] = {}

    def link_queue_servers(addresses: tuple[str, ...]) -> None:
        for q in addresses:
            if q not in links:
                links[q] = QueueServerLink(
                    q,
                    any_node,
                    executor,
                    token,
                    secret,
                    data_groups=groups.data,
                    data_groups_only=True,
                )
                links[q].start()

    teller = _Teller(pipe, groups.data)

    def on_state() -> None:
        for link in links.values():
            link.state_changed()
        teller.moved()

    for node in groups.data.values():
        node.state_listeners.append(on_state)
    link_queue_servers(first.queue_servers)
    teller.moved()
    loop = asyncio.get_running_loop()
    log.info(
        "worker started",
        extra={
            "worker": spec.index,
            "groups": list(spec.groups),
            "grpc": port,
            "frames": frames_port,
            "cpu_s": round(time.process_time(), 3),  # its start's (a fork's: since the fork)
        },
    )

    handing: set[asyncio.Task[None]] = set()
    asked = BarrierAsks()  # group 0's ReadIndexes, asked of the main process
    group0.ask_barrier = functools.partial(asked.ask, pipe, 0)

    def take(msg: Message) -> None:
        match msg:
            case Group0():
                _take_group0(group0, msg)
                groups.update_addresses(msg.addresses)
                link_queue_servers(msg.queue_servers)
            case Barrier():  # the main process's answer to an ask
                asked.answered(msg)
            case ReadBarrier():  # a task too
                task = loop.create_task(_barrier(groups, pipe, msg))
                handing.add(task)
                task.add_done_callback(handing.discard)
            case AskMetrics():  # a scrape of the main process: made now, never on a timer
                pipe.send(Metrics(generate_latest().decode()), droppable=True)
            case HandOver():  # a task: the pipe is read on meanwhile
                task = loop.create_task(_hand_to(groups, msg.to))
                handing.add(task)
                task.add_done_callback(handing.discard)
            case _:
                log.error(
                    "a message the main process does not send: ignored",
                    extra={"worker": spec.index, "kind": type(msg).__name__},
                )

    async def listen() -> None:
        while True:
            msg = await inbox.get()
            if msg is None or isinstance(msg, Stop):
                stop.set()
                return
            try:
                take(msg)
            except Exception:  # one message's failure stops nothing else
                log.exception(
                    "a message from the main process could not be taken",
                    extra={"worker": spec.index, "kind": type(msg).__name__},
                )

    listener = loop.create_task(listen())
    await stop.wait()
    listener.cancel()
    for task in handing:
        task.cancel()
    if not failed:
        await groups.hand_over()
    for link in links.values():
        await link.stop()
    await server.stop(grace=1.0)
    await groups.stop()
    teller.close()
    reading.cancel()
    pipe.close()
    if failed:
        raise RuntimeError(f"the Raft driver failed: {failed[0]!r}")
    log.info("worker stopped", extra={"worker": spec.index})


async def _barrier(groups: Store, pipe: ProcessPipe, ask: ReadBarrier) -> None:
    """A ReadIndex of one of this worker's groups, for the main process."""
    pipe.send(await barrier_answer(groups.nodes.get(ask.group), ask))


async def barrier_answer(node: Replica | None, ask: ReadBarrier) -> Barrier:
    """The answer to ``ask``: a ReadIndex of ``node``'s group (None: this
    process runs no such group), or why there is none."""
    try:
        if node is None:
            raise ValueError(f"this process runs no group {ask.group}")
        return Barrier(ask.id, index=await asyncio.wait_for(node.read_barrier(), BARRIER_WAIT_S))
    except (TimeoutError, NotLeader, ValueError) as e:
        return Barrier(ask.id, error=str(e) or type(e).__name__)


def _take_group0(group0: RemoteReplica, msg: Group0) -> None:
    group0.told_conf(msg.commit_index, msg.voters, msg.learners)


async def _hand_to(groups: Store, target: int) -> None:
    """Every group this worker leads to ``target`` where it is a voter of the
    group, else to the group's best follower (none: it stays)."""
    for _, n in sorted(groups.data.items()):
        if not n.is_leader:
            continue
        to = target if target in n.core.conf.voters and target != n.id else successor(n.core)
        if to:
            with contextlib.suppress(NotLeader):
                await n.transfer_leader(to)


class _Teller:
    """Tells the main process each group's figures as they move, at most
    every TELL_EVERY_S: one ``GroupFigures`` a group that moved, in one
    ``Groups`` message."""

    def __init__(self, pipe: ProcessPipe, nodes: dict[int, Replica]) -> None:
        self.pipe = pipe
        self.nodes = nodes
        self._told: dict[int, GroupFigures] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._last = 0.0

    def moved(self) -> None:
        if self._timer is not None:
            return
        wait = max(0.0, self._last + TELL_EVERY_S - time.monotonic())
        self._timer = asyncio.get_running_loop().call_later(wait, self._tell)

    def _tell(self) -> None:
        self._timer = None
        self._last = time.monotonic()
        out = [f for g, n in self.nodes.items() if (f := group_figures(n)) != self._told.get(g)]
        if not out:
            return
        if self.pipe.send(Groups(tuple(out)), droppable=True):
            self._told.update((f.group, f) for f in out)
        else:  # the main process is behind: the latest figures, a little later
            self.moved()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
