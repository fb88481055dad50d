"""``roadlog-node``: the node daemon's command line and process wiring.

``roadlog-node run --config FILE`` (each config key is also a flag) serves
the peer service, the admin service, gRPC health (SERVING once the node
knows a leader and has caught up) and reflection on ``listen``, Prometheus
metrics on ``metrics_port``, and pulls work from ``queue_servers``. SIGTERM
and SIGINT stop it gracefully.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import click
import grpc
import lmdb
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from discovery.agent import DiscoveryAgent, now_ms
from discovery.core import DiscoveryCore, Found, Join
from node_daemon.backup import BackupError, restore_backup, take_backup
from node_daemon.config import ConfigError, NodeConfig, load_config, parse_peers
from node_daemon.identity import node_id_for
from node_daemon.membership import Membership
from node_daemon.node import NotLeader, RaftNode
from node_daemon.node_read import NodeReadService
from node_daemon.raft import ConfChange, ConfChangeType, Role
from node_daemon.sdnotify import notify
from node_daemon.storage.raft_log import LmdbLogStorage
from node_daemon.transport import AUTH_KEY, auth_token, authorized
from node_daemon.worker import Executor, QueueServerLink
from roadlog import configfile, eventloop
from roadlog.http_health import serve_metrics_and_health
from roadlog.limits import PEER_MESSAGE_BYTES
from roadlog.localcluster import node_view
from roadlog.logs import setup_logging
from roadlog.ops import HostView, leader_host, transfer_target
from roadlog.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    client_pb2,
    command_pb2,
    noderead_pb2,
    noderead_pb2_grpc,
    raft_pb2,
    raft_pb2_grpc,
)

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
        voters=sorted(core.conf.voters),
        learners=sorted(core.conf.learners),
    )


class AdminService(admin_pb2_grpc.AdminServicer):
    """Operators' calls. Changing calls need the cluster's credentials."""

    def __init__(
        self, node: RaftNode, membership: Membership, token: str, stop: asyncio.Event
    ) -> None:
        self.node = node
        self.membership = membership
        self.token = token
        self.stop = stop

    async def Status(self, request: Any, context: Any) -> client_pb2.ClusterStatus:
        n = self.node
        st = client_pb2.ClusterStatus(leader=n.core.lead, term=n.core.term)
        st.nodes.append(node_status(n))
        for m in self.membership.members():  # the others: where to ask them
            if m.node_id != n.id:
                st.nodes.add(id=m.node_id, address=m.address)
        return st

    async def _authorized(self, context: Any) -> None:
        if not authorized(context, self.token):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad cluster credentials")

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
        await self._authorized(context)
        if request.node_id <= 0 or not request.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "need node_id and address")
        return await self._admin(
            context, self._add(request.node_id, request.address, request.as_voter)
        )

    async def _add(self, node_id: int, address: str, as_voter: bool) -> int:
        """Record the address through the log, then add the node (a node
        already in the configuration only gets its address updated)."""
        n = self.node
        n.update_addresses({node_id: address})
        if n.sm.peers().get(node_id) != address:
            op = command_pb2.Op(add_peer=command_pb2.AddPeerOp(node_id=node_id, address=address))
            res = await n.propose_op(op)
            if res.code != grpc.StatusCode.OK:
                raise NotLeader(n.core.lead, res.message)
        conf = n.core.conf
        if node_id in conf.voters or (node_id in conf.learners and not as_voter):
            return n.sm.applied_index
        kind = ConfChangeType.ADD_VOTER if as_voter else ConfChangeType.ADD_LEARNER
        log.info("adding a node", extra={"node": node_id, "address": address, "voter": as_voter})
        return await n.conf_change(ConfChange(kind, node_id))

    async def RemoveNode(self, request: Any, context: Any) -> admin_pb2.AdminResponse:
        await self._authorized(context)
        cc = ConfChange(ConfChangeType.REMOVE_NODE, request.node_id)
        return await self._admin(context, self.node.conf_change(cc))

    async def TransferLeader(self, request: Any, context: Any) -> admin_pb2.AdminResponse:
        await self._authorized(context)
        return await self._admin(context, self.node.transfer_leader(request.node_id))

    async def Snapshot(self, request: Any, context: Any) -> admin_pb2.AdminResponse:
        await self._authorized(context)
        return await self._admin(context, self.node.snapshot_now())

    async def Leave(self, request: Any, context: Any) -> admin_pb2.AdminResponse:
        await self._authorized(context)
        resp = await self._admin(context, self.membership.leave())
        log.info("left the cluster: stopping", extra={"index": resp.index})
        asyncio.get_running_loop().call_later(0.5, self.stop.set)
        return resp

    async def StateDigest(self, request: Any, context: Any) -> admin_pb2.StateDigestResponse:
        loop = asyncio.get_running_loop()
        sm = self.node.sm
        digest = await loop.run_in_executor(self.node._apply_io, sm.digest)
        return admin_pb2.StateDigestResponse(applied_index=sm.applied_index, sha256=digest)


def _has_raft_state(cfg: NodeConfig) -> bool:
    raft = Path(cfg.data_dir) / "raft"
    if not raft.exists():
        return False
    store = LmdbLogStorage(raft)
    try:
        return store.last_index() > 0 or store.initial_state().term > 0
    finally:
        store.close()


async def _discover(cfg: NodeConfig, agent: DiscoveryAgent | None) -> NodeConfig:
    """For a node with no state and no peer list: found a cluster (this node
    its only voter) or wait to join one, as discovery decides."""
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
            return replace(cfg, peers={cfg.node_id: cfg.address})
        if isinstance(d, Join):
            log.info("found a cluster to join", extra={"leader": d.leader})
            return cfg
        await asyncio.sleep(0.1)


async def serve(cfg: NodeConfig) -> None:
    # LMDB commits and fsyncs release the GIL; hand it back quickly when they
    # return, instead of after the default 5 ms switch interval.
    sys.setswitchinterval(0.0005)
    if cfg.discovery:
        cfg = replace(cfg, node_id=node_id_for(Path(cfg.data_dir), cfg.node_id))
    token = auth_token(cfg.secret(), cfg.cluster_name)
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
    if cfg.discovery and not _has_raft_state(cfg):
        cfg = await _discover(cfg, agent)
    node = RaftNode(cfg)
    membership = Membership(node, token, sync_addresses=discovered_peers)
    stop = asyncio.Event()
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", PEER_MESSAGE_BYTES),
            ("grpc.max_send_message_length", PEER_MESSAGE_BYTES),
            # Peers ping every 2 s to notice a dead node early: allow it.
            ("grpc.http2.min_ping_interval_without_data_ms", 1000),
            ("grpc.keepalive_permit_without_calls", 1),
        ]
    )
    raft_pb2_grpc.add_RaftPeerServicer_to_server(node.transport, server)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminService(node, membership, token, stop), server)
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
    port = server.add_insecure_port(cfg.listen)
    if port == 0:
        raise ConfigError(f"listen: cannot bind {cfg.listen}")
    await server.start()
    if cfg.metrics_port:

        def readiness_detail() -> tuple[bool, dict[str, Any]]:
            core = node.core
            member = membership.in_config()
            return node.ready and member, {
                "node_id": core.id,
                "role": core.role.name.lower(),
                "term": core.term,
                "leader": core.lead,
                "commit_index": core.log.committed,
                "applied_index": node.sm.applied_index,
                "member": member,
            }

        serve_metrics_and_health(cfg.listen.rpartition(":")[0], cfg.metrics_port, readiness_detail)
    node.update_addresses(node.sm.peers())
    await node.start()
    executor = Executor(node)
    executor.groups.start()
    links: dict[str, QueueServerLink] = {}

    def link_queue_servers(addresses: list[str]) -> None:
        for q in addresses:
            if q not in links:
                links[q] = QueueServerLink(q, node, executor, token)
                links[q].start()
                log.info("pulling work from a queue server", extra={"queue": q})

    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    last_health: list[bool | None] = [None]

    async def tell_systemd_when_ready() -> None:
        """Type=notify: ready once in a cluster, knowing a leader, caught up."""
        while not (node.ready and membership.in_config()):
            await asyncio.sleep(0.2)
        notify(f"READY=1\nSTATUS=member of the cluster, leader {node.core.lead}")

    def on_state() -> None:
        for link in links.values():
            link.state_changed()
        ok = node.ready
        if ok != last_health[0]:
            last_health[0] = ok
            status = serving if ok else not_serving
            asyncio.get_running_loop().create_task(health_servicer.set("", status))
            asyncio.get_running_loop().create_task(health_servicer.set("roadlog.node", status))

    node.state_listeners.append(on_state)
    on_state()
    link_queue_servers(cfg.queue_servers)
    if agent is not None:
        discovered = agent

        def on_discovery_step() -> None:
            now = now_ms()
            node.update_addresses({**node.sm.peers(), **discovered.core.addresses(now)})
            link_queue_servers(discovered.core.queue_servers(now))
            if membership.in_config():
                core = node.core
                discovered.core.set_member(
                    core.lead, node.address_of(core.lead), core.term, membership.members()
                )

        agent.listeners.append(on_discovery_step)
    membership.start()
    readiness = asyncio.get_running_loop().create_task(tell_systemd_when_ready())
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
    notify("STOPPING=1")
    log.info("stopping", extra={"role": Role(node.core.role).name.lower()})
    if joining is not None:
        joining.cancel()
    await health_servicer.enter_graceful_shutdown()
    await membership.stop()
    for link in links.values():
        await link.stop()
    if agent is not None:
        await agent.stop()
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
@click.option("--snapshot-bytes", type=int, help="snapshot once the applied log holds this much")
@click.option("--trim-interval-s", type=int)
@click.option("--discovery-port", type=int, help="UDP port of discovery HELLOs (0: none)")
@click.option("--discovery-broadcast", help="where HELLOs are broadcast ('' for seeds only)")
@click.option("--discovery-seeds", help="HOST:PORT,... to send HELLOs to by unicast")
@click.option("--bootstrap-expect", type=int, help="found a new cluster of this many nodes")
@click.option("--voters", type=int, help="voters to keep (default: bootstrap_expect or 3)")
@click.option("--dead-voter-timeout-s", type=int)
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
        eventloop.run(serve(cfg))
    except ConfigError as e:
        log.error("bad configuration", extra={"error": str(e)})
        sys.exit(2)


@cli.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="the node's TOML")
@click.option("--address", help="the node's gRPC HOST:PORT (default: from the config)")
@click.option("--secret-file", type=click.Path(path_type=Path))
@click.option("--cluster-name")
@click.option("--timeout", default=60.0, show_default=True)
def leave(
    config_path: Path | None,
    address: str | None,
    secret_file: Path | None,
    cluster_name: str | None,
    timeout: float,
) -> None:
    """Make a running node leave its cluster gracefully (it hands over
    leadership, has the leader remove it, then stops)."""
    cfg = _offline_config(config_path, {"secret_file": secret_file, "cluster_name": cluster_name})
    target = _dialable(address or cfg.address)
    token = auth_token(cfg.secret(), cfg.cluster_name)
    with grpc.insecure_channel(target) as ch:
        try:
            resp = admin_pb2_grpc.AdminStub(ch).Leave(
                admin_pb2.LeaveRequest(), metadata=((AUTH_KEY, token),), timeout=timeout
            )
        except grpc.RpcError as e:
            raise click.ClickException(f"{target}: {e.code().name}: {e.details()}") from None
    click.echo(f"node at {target} left the cluster (removed at index {resp.index}); it stops now")


def _dialable(address: str) -> str:
    """A listen address one can connect to: 0.0.0.0 means this host."""
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host in ("", "0.0.0.0") else address


def _offline_config(config_path: Path | None, flags: dict[str, Any]) -> NodeConfig:
    """The node's configuration for commands that do not run it."""
    try:
        return configfile.load(
            NodeConfig,
            config_path,
            {**flags, "discovery_port": 0, "node_id": 0},
            {"secret_file": Path, "data_dir": Path, "peers": parse_peers},
            validate=False,
        )
    except ConfigError as e:
        raise click.BadParameter(str(e)) from None


@cli.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="the node's TOML")
@click.option("--data-dir", type=click.Path(path_type=Path))
@click.option("--cluster-name")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="a new directory")
@click.option("--json", "as_json", is_flag=True, help="print the manifest as JSON")
def backup(
    config_path: Path | None,
    data_dir: Path | None,
    cluster_name: str | None,
    out: Path,
    as_json: bool,
) -> None:
    """Copy this node's state (consistent, at its applied index) into OUT,
    with a manifest. Safe while the node runs."""
    cfg = _offline_config(config_path, {"data_dir": data_dir, "cluster_name": cluster_name})
    data = Path(cfg.data_dir)
    node_id = int((data / "node_id").read_text()) if (data / "node_id").exists() else cfg.node_id
    try:
        manifest = take_backup(data, out, cfg.cluster_name, node_id)
    except (BackupError, lmdb.Error, OSError) as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(asdict(manifest)))
    else:
        click.echo(
            f"backup of {cfg.cluster_name} at index {manifest.applied_index} "
            f"({manifest.bytes} bytes) in {out}"
        )


@cli.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="the node's TOML")
@click.option("--data-dir", type=click.Path(path_type=Path))
@click.option("--cluster-name")
@click.option("--listen", help="the node's HOST:PORT (checked: it must not be serving)")
@click.option("--from", "source", type=click.Path(path_type=Path), required=True, help="a backup")
@click.option(
    "--voters", required=True, help="every node of the restored cluster: ID=HOST:PORT,..."
)
def restore(
    config_path: Path | None,
    data_dir: Path | None,
    cluster_name: str | None,
    listen: str | None,
    source: Path,
    voters: str,
) -> None:
    """Make this (stopped) node start from a backup. Restore every node from
    the same backup with the same --voters; the old data is moved aside."""
    cfg = _offline_config(
        config_path, {"data_dir": data_dir, "cluster_name": cluster_name, "listen": listen}
    )
    host, _, port = _dialable(cfg.listen).rpartition(":")
    if _listening(host, int(port)):
        raise click.ClickException(f"a node is serving on {cfg.listen}: stop it before a restore")
    try:
        aside = restore_backup(Path(cfg.data_dir), source, cfg.cluster_name, parse_peers(voters))
    except (BackupError, ConfigError, lmdb.Error, OSError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"restored from {source}; the previous data is in {aside}")


@cli.command("transfer-leader")
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="the node's TOML")
@click.option("--address", help="any node's gRPC HOST:PORT (default: this node's, from the config)")
@click.option("--secret-file", type=click.Path(path_type=Path))
@click.option("--cluster-name")
@click.option("--to", "to", type=int, default=0, help="node id (default: the most caught-up)")
@click.option("--timeout", default=30.0, show_default=True)
def transfer_leader(
    config_path: Path | None,
    address: str | None,
    secret_file: Path | None,
    cluster_name: str | None,
    to: int,
    timeout: float,
) -> None:
    """Hand the leadership to another voter and wait until it leads; prints
    {"from": ID, "to": ID, "seconds": S} as JSON."""
    cfg = _offline_config(config_path, {"secret_file": secret_file, "cluster_name": cluster_name})
    start = _dialable(address or cfg.address)
    views, addresses = _member_views(start)
    lead = leader_host(views)
    if lead is None:
        raise click.ClickException("no leader right now: nothing to transfer")
    lead_id = next(v.node_id for v in views if v.host == lead)
    target = transfer_target(views, prefer=to)
    if target == 0:
        raise click.ClickException(
            f"no ready voter to hand over to{f' (node {to} is not one)' if to else ''}"
        )
    token = auth_token(cfg.secret(), cfg.cluster_name)
    t0 = time.monotonic()
    with grpc.insecure_channel(addresses[lead_id]) as ch:
        try:
            admin_pb2_grpc.AdminStub(ch).TransferLeader(
                admin_pb2.TransferLeaderRequest(node_id=target),
                metadata=((AUTH_KEY, token),),
                timeout=timeout,
            )
        except grpc.RpcError as e:
            raise click.ClickException(f"{e.code().name}: {e.details()}") from None
    while time.monotonic() - t0 < timeout:
        view = node_view(addresses[target], 2.0)
        if view is not None and view["role"] == "leader":
            out = {"from": lead_id, "to": target, "seconds": round(time.monotonic() - t0, 3)}
            click.echo(json.dumps(out))
            return
        time.sleep(0.1)
    raise click.ClickException(f"node {target} did not take over within {timeout:.0f} s")


def _member_views(start: str) -> tuple[list[HostView], dict[int, str]]:
    """Every member's own view, found from one node; hosts named by address."""
    first = node_view(start, 2.0)
    if first is None:
        raise click.ClickException(f"no node answers at {start}")
    addresses = {int(first["id"]): str(first["address"]), **first["members"]}
    views = []
    for node_id, addr in sorted(addresses.items()):
        view = first if node_id == first["id"] else node_view(addr, 2.0)
        doc = None
        if view is not None:
            doc = {**view, "node_id": node_id, "member": node_id in addresses}
        views.append(HostView.from_readyz(addr, doc, "unknown"))
    return views, addresses


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
