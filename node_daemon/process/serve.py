"""A node process, wired: discovery and cold start, the Raft node, its gRPC
services (peers, admin, node reads, health, reflection) behind the cluster's
auth interceptor, metrics and health endpoints, the work links to every
queue server, systemd readiness, and a graceful stop on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from discovery.agent import DiscoveryAgent, now_ms
from discovery.core import DiscoveryCore, Found, Join
from node_daemon.config import ConfigError, NodeConfig
from node_daemon.process.admin import (
    AdminService,
)
from node_daemon.process.grpc_server import node_grpc_server
from node_daemon.process.identity import node_id_for
from node_daemon.process.state_metrics import STATE
from node_daemon.process.worker_metrics import WorkerMetrics, merged_registry
from node_daemon.process.worker_pool import WorkerPool, remote_replicas, with_workers
from node_daemon.replica.status import group_figures, node_readiness
from node_daemon.storage.raft_log import LmdbLogStorage
from node_daemon.store.cluster_membership import Membership
from node_daemon.store.founded_data_groups import (
    cluster_data_groups,
    decide_data_groups,
    kept_data_groups,
    to_adopt,
)
from node_daemon.store.store import Store
from node_daemon.work.handler import WorkHandler
from node_daemon.work.node_read import NodeReadService
from node_daemon.work.queue_link import QueueServerLink
from node_daemon.work.routing import WorkRouter
from roadlog.runtime import tls
from roadlog.runtime.auth import cluster_token
from roadlog.runtime.health import metrics_auth, metrics_ssl, serve_metrics_and_health
from roadlog.runtime.sdnotify import notify
from roadlog.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    noderead_pb2,
    noderead_pb2_grpc,
    raft_pb2,
    raft_pb2_grpc,
)

log = logging.getLogger("roadlog.node")


def _has_raft_state(cfg: NodeConfig) -> bool:
    raft = Path(cfg.data_dir) / "raft"
    if not raft.exists():
        return False
    store = LmdbLogStorage(raft)
    try:
        return store.last_index() > 0 or store.initial_state().term > 0
    finally:
        store.close()


async def _discover(
    cfg: NodeConfig, agent: DiscoveryAgent | None
) -> tuple[NodeConfig, Join | None]:
    """For a node with no state and no peer list: found a cluster (this node
    its only voter) or wait to join one, as discovery decides (the Join
    then: the cluster's leader as discovery heard it)."""
    if agent is None:
        raise ConfigError("no peers and no discovery: nothing to start from")
    log.info(
        "discovering",
        extra={"node_id": cfg.node_id, "bootstrap_expect": cfg.bootstrap_expect},
    )
    while True:
        d = agent.core.decide(now_ms())
        if isinstance(d, Found):
            log.info("founding the cluster", extra={"with": list(d.others)})
            return replace(cfg, peers={cfg.node_id: cfg.address}), None
        if isinstance(d, Join):
            log.info("found a cluster to join", extra={"leader": d.leader})
            return cfg, d
        await asyncio.sleep(0.1)


# How often a node compares its data groups with the ones the cluster was founded with.
FOUNDED_CHECK_S = 1.0


class NodeFailed(RuntimeError):
    """The node stopped because its Raft driver failed, or to run the data
    groups the cluster was founded with (systemd restarts it)."""


async def serve(cfg: NodeConfig) -> None:
    # LMDB commits and fsyncs release the GIL; hand it back quickly when they
    # return, instead of after the default 5 ms switch interval.
    sys.setswitchinterval(0.0005)
    if cfg.discovery:
        cfg = replace(cfg, node_id=node_id_for(Path(cfg.data_dir), cfg.node_id))
    token = cluster_token(cfg.secret(), cfg.cluster_name)
    agent: DiscoveryAgent | None = None
    if cfg.discovery_port:
        core = DiscoveryCore(
            cfg.cluster_name, cfg.node_id, "node", cfg.address, expect=cfg.bootstrap_expect
        )
        agent = DiscoveryAgent(
            core, cfg.secret(), cfg.discovery_port, cfg.discovery_broadcast, cfg.discovery_seeds
        )
        try:
            await agent.start()
        except OSError as e:
            if cfg.discovery:
                raise ConfigError(f"discovery_port {cfg.discovery_port}: {e}") from None
            log.warning("discovery off: cannot bind its port", extra={"error": str(e)})
            agent = None
    discovered_peers = cfg.discovery
    # The data groups (0: one per voter, decided at the first start and kept).
    # The voters are counted before discovery narrows the peers to this node.
    decided_here = cfg.data_groups == 0 and cfg.place_topics
    voters = cfg.voters_at_founding
    try:
        kept = kept_data_groups(cfg)
    except (OSError, ValueError) as e:
        raise ConfigError(f"data_groups: {e}") from None
    join: Join | None = None
    if cfg.discovery and not _has_raft_state(cfg):
        cfg, join = await _discover(cfg, agent)
    if kept is None:
        # A node joining a running cluster runs what its leader runs; a
        # founder, or a joiner that could not ask, one group per voter.
        told = await cluster_data_groups(join, token) if join is not None else None
        kept = decide_data_groups(cfg, told or voters)
    cfg = replace(cfg, data_groups=kept)
    log.info("data groups", extra={"data_groups": cfg.data_groups, "place": cfg.place_topics})
    # Group 0 (``node``) and the data groups, if any: here, or in worker
    # processes (``workers``), read from here as RemoteGroups.
    remote = remote_replicas(cfg) if with_workers(cfg) else {}
    groups = Store(cfg, local=[0], remote=remote) if remote else Store(cfg)
    node = groups.meta
    links: dict[str, QueueServerLink] = {}
    worker_metrics = WorkerMetrics() if remote else None
    # The worker processes: made (their groups' ports told as "not listening
    # yet") before any peer can ask, started once the links are.
    workers = WorkerPool(cfg, node, remote, lambda: list(links), worker_metrics) if remote else None
    STATE.watch(node.sm)  # topics, group lag, heat-map age on /metrics
    membership = Membership(node, token, sync_addresses=discovered_peers)
    stop = asyncio.Event()
    security = tls.current()
    server = node_grpc_server(token)
    raft_pb2_grpc.add_RaftPeerServicer_to_server(node.transport, server)
    admin = AdminService(node, membership, token, stop)
    admin_pb2_grpc.add_AdminServicer_to_server(admin, server)
    noderead_pb2_grpc.add_NodeReadServicer_to_server(NodeReadService(node, token), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        raft_pb2.DESCRIPTOR.services_by_name["RaftPeer"].full_name,
        admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
        noderead_pb2.DESCRIPTOR.services_by_name["NodeRead"].full_name,
        health.SERVICE_NAME,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    port = security.add_port(server, cfg.listen, mutual=True)
    if port == 0:
        raise ConfigError(f"listen: cannot bind {cfg.listen}")
    await server.start()
    if cfg.peer_frames_port >= 0:
        host = cfg.listen.rpartition(":")[0].strip("[]")
        await node.transport.start_frames(host, cfg.peer_frames_port)
    if cfg.metrics_port:
        auth = metrics_auth(cfg.metrics_auth, cfg.metrics_token_file, security.insecure)

        def readiness_detail() -> tuple[bool, dict[str, Any]]:
            ready, detail = node_readiness(node, membership.in_config())
            if workers is not None:
                detail["workers_alive"] = workers.alive()
                ready = ready and detail["workers_alive"]
            return ready, detail

        serve_metrics_and_health(
            cfg.metrics_host or cfg.listen.rpartition(":")[0],
            cfg.metrics_port,
            readiness_detail,
            ssl_context=metrics_ssl(security, auth),  # HTTPS with TLS (Prometheus: the CA)
            registry=merged_registry(worker_metrics) if worker_metrics is not None else None,
            auth=auth,
        )
    groups.update_addresses(node.sm.peers())
    failed: list[BaseException] = []

    def driver_failed(e: BaseException) -> None:
        failed.append(e)
        stop.set()

    await groups.start(driver_failed)
    # A handler per Raft group the node runs; items go by WorkItem.group.
    executor = WorkRouter(
        {0: WorkHandler(node)} | {g: WorkHandler(n) for g, n in groups.data.items()}
    )
    executor.meta.groups.start()  # consumer groups live in group 0

    def link_queue_servers(addresses: list[str]) -> None:
        for q in addresses:
            if q not in links:
                links[q] = QueueServerLink(
                    q, node, executor, token, cfg.secret(), data_groups=groups.data
                )
                links[q].start()
                log.info("pulling work from a queue server", extra={"queue": q})

    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    last_health: list[bool | None] = [None]

    async def tell_systemd_when_ready() -> None:
        """Type=notify: ready once in a cluster, knowing a leader, caught up,
        and every worker process running."""
        while not (
            node.serving and membership.in_config() and (workers is None or workers.alive())
        ):
            await asyncio.sleep(0.2)
        notify(f"READY=1\nSTATUS=member of the cluster, leader {group_figures(node).leader}")

    def on_state() -> None:
        for link in links.values():
            link.state_changed()
        ok = node.serving
        if ok != last_health[0]:
            last_health[0] = ok
            status = serving if ok else not_serving
            asyncio.get_running_loop().create_task(health_servicer.set("", status))
            asyncio.get_running_loop().create_task(health_servicer.set("roadlog.node", status))

    node.state_listeners.append(on_state)

    def on_data_group_state() -> None:  # their roles and indexes go to the queue servers
        for link in links.values():
            link.state_changed()

    for data_node in groups.data.values():
        data_node.state_listeners.append(on_data_group_state)
    on_state()
    link_queue_servers(cfg.queue_servers)
    if workers is not None:
        await workers.start()
        admin.remote_hand_over = workers.hand_over
    if agent is not None:
        discovered = agent

        def on_discovery_step() -> None:
            now = now_ms()
            groups.update_addresses({**node.sm.peers(), **discovered.core.addresses(now)})
            link_queue_servers(discovered.core.queue_servers(now))
            if workers is not None:
                workers.poke()  # the workers hear of new addresses and queue servers now
            if membership.in_config():
                f = group_figures(node)
                discovered.core.set_member(
                    f.leader, node.address_of(f.leader), f.term, membership.members()
                )

        agent.listeners.append(on_discovery_step)
    membership.start()
    readiness = asyncio.get_running_loop().create_task(tell_systemd_when_ready())

    async def keep_to_the_founded_groups() -> None:
        """A node that decided its data groups itself and finds, once group
        0's state says, that the cluster was founded with another number
        records that one and stops as failed: systemd starts it again
        running the cluster's groups."""
        while True:
            await asyncio.sleep(FOUNDED_CHECK_S)
            adopt = to_adopt(decided_here, cfg.data_groups, node.sm.founded_data_groups())
            if adopt is None:
                continue
            log.error(
                "the cluster was founded with other data groups: recorded, restarting",
                extra={"running": cfg.data_groups, "founded": adopt},
            )
            decide_data_groups(cfg, adopt)
            failed.append(RuntimeError(f"runs {cfg.data_groups} data groups, not {adopt}"))
            stop.set()
            return

    founded_check = asyncio.get_running_loop().create_task(keep_to_the_founded_groups())
    log.info(
        "node started",
        extra={
            "node_id": cfg.node_id,
            "listen": cfg.listen,
            "peers": {str(k): v for k, v in cfg.peers.items()},
            "queue_servers": cfg.queue_servers,
            "metrics_port": cfg.metrics_port,
            "discovery_port": cfg.discovery_port if agent is not None else 0,
        },
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    joining = None
    if agent is not None:
        joining = loop.create_task(
            membership.keep_in_cluster(lambda: discovered.core.known_cluster(now_ms()))
        )
    await stop.wait()
    readiness.cancel()
    founded_check.cancel()
    notify("STOPPING=1")
    log.info("stopping", extra={"role": group_figures(node).role.name.lower()})
    if workers is not None:  # each hands its groups over and stops, meanwhile
        workers.begin_stop()
    if not failed:  # a graceful stop: no group waits out an election for this node
        await groups.hand_over()
    if workers is not None:
        await workers.stop()
    if joining is not None:
        joining.cancel()
    await health_servicer.enter_graceful_shutdown()
    await membership.stop()
    for link in links.values():
        await link.stop()
    if agent is not None:
        await agent.stop()
    await server.stop(grace=1.0)
    await groups.stop()
    if failed:
        raise NodeFailed(f"stopped on a failure: {failed[0]!r}")
    log.info("stopped")
