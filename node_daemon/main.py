"""``roadlog-node``: the node daemon's command line and process wiring.

``roadlog-node run --config FILE`` (each config key is also a flag) serves
the peer service, the admin service, gRPC health (SERVING once the node
knows a leader and has caught up) and reflection on ``listen``, Prometheus
metrics on ``metrics_port``, and pulls work from ``queue_servers``. SIGTERM
and SIGINT stop it gracefully.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import click
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from node_daemon.config import ConfigError, NodeConfig, load_config
from node_daemon.node import NotLeader, RaftNode
from node_daemon.raft import ConfChange, ConfChangeType, Role
from node_daemon.transport import auth_token
from node_daemon.worker import Executor, QueueServerLink
from roadlog.logs import setup_logging
from roadlog.v1 import admin_pb2, admin_pb2_grpc, client_pb2, raft_pb2, raft_pb2_grpc

log = logging.getLogger("roadlog.node")


def node_status(node: RaftNode) -> client_pb2.NodeStatus:
    core = node.core
    return client_pb2.NodeStatus(
        id=node.id,
        address=node.cfg.address,
        role=core.role.name.lower().replace("_", "-"),
        term=core.term,
        commit_index=core.log.committed,
        applied_index=node.sm.applied_index,
        leader=core.lead,
        ready=node.ready,
    )


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, node: RaftNode) -> None:
        self.node = node

    async def Status(self, request: Any, context: Any) -> client_pb2.ClusterStatus:
        n = self.node
        st = client_pb2.ClusterStatus(leader=n.core.lead, term=n.core.term)
        st.nodes.append(node_status(n))
        return st

    async def _admin(self, context: Any, coro: Any) -> admin_pb2.AdminResponse:
        try:
            index = await coro
        except NotLeader as e:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{e}; the leader is node {e.leader} ({self.node.address_of(e.leader)})",
            )
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "not applied in time")
        return admin_pb2.AdminResponse(ok=True, index=index or 0)

    async def AddNode(self, request: Any, context: Any) -> admin_pb2.AdminResponse:
        if request.node_id <= 0 or not request.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "need node_id and address")
        addrs = {**self.node.addresses, request.node_id: request.address}
        self.node.addresses = addrs
        self.node.transport.set_addresses(addrs)
        kind = ConfChangeType.ADD_VOTER if request.as_voter else ConfChangeType.ADD_LEARNER
        return await self._admin(context, self.node.conf_change(ConfChange(kind, request.node_id)))

    async def RemoveNode(self, request: Any, context: Any) -> admin_pb2.AdminResponse:
        cc = ConfChange(ConfChangeType.REMOVE_NODE, request.node_id)
        return await self._admin(context, self.node.conf_change(cc))

    async def TransferLeader(self, request: Any, context: Any) -> admin_pb2.AdminResponse:
        return await self._admin(context, self.node.transfer_leader(request.node_id))

    async def Snapshot(self, request: Any, context: Any) -> admin_pb2.AdminResponse:
        return await self._admin(context, self.node.snapshot_now())

    async def StateDigest(self, request: Any, context: Any) -> admin_pb2.StateDigestResponse:
        loop = asyncio.get_running_loop()
        sm = self.node.sm
        digest = await loop.run_in_executor(self.node._apply_io, sm.digest)
        return admin_pb2.StateDigestResponse(applied_index=sm.applied_index, sha256=digest)


async def serve(cfg: NodeConfig) -> None:
    # LMDB commits and fsyncs release the GIL; hand it back quickly when they
    # return, instead of after the default 5 ms switch interval.
    sys.setswitchinterval(0.0005)
    node = RaftNode(cfg)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            # Peers ping every 2 s to notice a dead node early: allow it.
            ("grpc.http2.min_ping_interval_without_data_ms", 1000),
            ("grpc.keepalive_permit_without_calls", 1),
        ]
    )
    raft_pb2_grpc.add_RaftPeerServicer_to_server(node.transport, server)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminService(node), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        raft_pb2.DESCRIPTOR.services_by_name["RaftPeer"].full_name,
        admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
        health.SERVICE_NAME,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(cfg.listen)
    if port == 0:
        raise ConfigError(f"listen: cannot bind {cfg.listen}")
    await server.start()
    if cfg.metrics_port:
        start_http_server(cfg.metrics_port, addr=cfg.listen.rpartition(":")[0] or "0.0.0.0")
    await node.start()
    executor = Executor(node)
    executor.groups.start()
    token = auth_token(cfg.secret(), cfg.cluster_name)
    links = [QueueServerLink(q, node, executor, token) for q in cfg.queue_servers]
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    last_health: list[bool | None] = [None]

    def on_state() -> None:
        for link in links:
            link.state_changed()
        ok = node.ready
        if ok != last_health[0]:
            last_health[0] = ok
            status = serving if ok else not_serving
            asyncio.get_running_loop().create_task(health_servicer.set("", status))
            asyncio.get_running_loop().create_task(health_servicer.set("roadlog.node", status))

    node.state_listeners.append(on_state)
    on_state()
    for link in links:
        link.start()
    log.info(
        "node started",
        extra={
            "node_id": cfg.node_id,
            "listen": cfg.listen,
            "peers": {str(k): v for k, v in cfg.peers.items()},
            "queue_servers": cfg.queue_servers,
            "metrics_port": cfg.metrics_port,
        },
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping", extra={"role": Role(node.core.role).name.lower()})
    await health_servicer.enter_graceful_shutdown()
    for link in links:
        await link.stop()
    await server.stop(grace=1.0)
    await node.stop()
    log.info("stopped")


@click.group()
def cli() -> None:
    """The roadlog node daemon."""


@cli.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="TOML file")
@click.option("--node-id", type=int)
@click.option("--cluster-name")
@click.option("--data-dir", type=click.Path(path_type=Path))
@click.option("--listen", help="HOST:PORT for peers, admin and health")
@click.option("--advertise-address", help="HOST:PORT others reach this node at")
@click.option("--peers", help="ID=HOST:PORT,... (every voter of a new cluster, this node too)")
@click.option("--secret-file", type=click.Path(path_type=Path))
@click.option("--metrics-port", type=int)
@click.option("--queue-servers", help="HOST:PORT,... of the queue servers to pull work from")
@click.option("--tick-ms", type=int)
@click.option("--snapshot-entries", type=int)
@click.option("--trim-interval-s", type=int)
@click.option(
    "--merge-publishes/--no-merge-publishes",
    default=None,
    help="server-side group commit of publishes (default on)",
)
@click.option("--log-level")
def run(config_path: Path | None, **flags: Any) -> None:
    """Run a node until SIGTERM."""
    try:
        cfg = load_config(config_path, flags)
    except ConfigError as e:
        raise click.BadParameter(str(e)) from None
    setup_logging("node", cfg.log_level)
    try:
        asyncio.run(serve(cfg))
    except ConfigError as e:
        log.error("bad configuration", extra={"error": str(e)})
        sys.exit(2)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
