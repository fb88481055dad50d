"""``roadlog-queue run``: a queue server's process wired (its gRPC port,
framed Work link, publish link, HTTP API and dashboard, metrics, discovery),
until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import sys
from typing import Any

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from discovery.agent import DiscoveryAgent
from discovery.core import DiscoveryCore
from queue_server.client_front import caller_of, client_handler
from queue_server.config import QueueConfig
from queue_server.dashboard import DashboardSettings
from queue_server.http_api import BodyLimits, HttpApi
from queue_server.member_agent import DirectoryLink, MemberAgent, directory_tls
from queue_server.metrics import count_publish_batch
from queue_server.publish_stream import SERVICE as PUBLISH_STREAM
from queue_server.publish_stream import publish_stream_handler
from queue_server.server import QueueServer
from queue_server.topic_home import TopicHomes
from roadlog.limits import WORK_MESSAGE_BYTES, grpc_options
from roadlog.runtime import tls
from roadlog.runtime.auth import ClusterAuth, protects
from roadlog.runtime.health import metrics_auth, metrics_ssl, serve_metrics_and_health
from roadlog.v1 import work_pb2_grpc

log = logging.getLogger("roadlog.queue")


def _queue_callers(method: str) -> tuple[str, ...] | None:
    """Certificate kinds that may call ``method`` (None: anyone)."""
    return ("node",) if method == "/roadlog.v1.Work/Pull" else None


async def serve(cfg: QueueConfig, started: asyncio.Event | None = None) -> None:
    qs = QueueServer(cfg)
    # One port serves clients and the nodes' Work streams: it takes what a
    # node may send, and ``call`` refuses a client request over its own limit.
    security = tls.current()
    interceptors: list[grpc.aio.ServerInterceptor] = [
        ClusterAuth(qs.token, protects(["roadlog.v1.Work"]))
    ]
    if not security.insecure:
        # The port is TLS without client certificates (clients have none), so
        # no caller here is a node: Pull is refused; nodes pull over the
        # framed Work link, in mutual TLS.
        interceptors.insert(0, tls.CertAuth(_queue_callers))
    server = grpc.aio.server(interceptors=interceptors, options=grpc_options(WORK_MESSAGE_BYTES))
    server.add_generic_rpc_handlers(
        (
            client_handler(qs),
            publish_stream_handler(
                qs.client_call,
                lambda context: caller_of(context, qs.proxies),
                count_publish_batch,
                qs.publish_link_port,
            ),
        )
    )
    work_pb2_grpc.add_WorkServicer_to_server(qs, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if cfg.grpc_reflection:
        reflection.enable_server_reflection(
            (
                "roadlog.v1.Roadlog",
                PUBLISH_STREAM,
                "roadlog.v1.Work",
                health.SERVICE_NAME,
                reflection.SERVICE_NAME,
            ),
            server,
        )
    if security.add_port(server, cfg.listen, mutual=False) == 0:
        raise RuntimeError(f"cannot bind {cfg.listen}")
    if cfg.work_frames_port >= 0:
        await qs.start_frames(cfg.listen.rpartition(":")[0], cfg.work_frames_port)
    if cfg.publish_link_port >= 0:
        await qs.start_publish_link(cfg.listen.rpartition(":")[0], cfg.publish_link_port)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    if cfg.metrics_port:
        auth = metrics_auth(cfg.metrics_auth, cfg.metrics_token_file, security.insecure)

        def readiness_detail() -> tuple[bool, dict[str, Any]]:
            st = qs.status()
            return bool(st.leader), {"leader": st.leader, "nodes": len(st.nodes)}

        serve_metrics_and_health(
            cfg.metrics_host or cfg.listen.rpartition(":")[0],
            cfg.metrics_port,
            readiness_detail,
            ssl_context=metrics_ssl(security, auth),  # HTTPS with TLS (Prometheus: the CA)
            auth=auth,
        )
    http_runner = None
    if cfg.http_listen:
        host, _, port = cfg.http_listen.rpartition(":")
        settings = DashboardSettings(
            tile_url=cfg.dashboard_tile_url,
            client_auth=cfg.client_auth,
            registration=cfg.open_registration,
        )
        bodies = BodyLimits(
            timeout_s=cfg.http_body_timeout_s,
            min_rate=cfg.http_body_min_rate,
            per_source=cfg.http_bodies_per_source,
            per_identity=cfg.http_bodies_per_identity,
        )
        http_runner = HttpApi(  # bounded (see HttpApi.runner)
            qs.client_call,
            qs.status,
            dashboard=settings,
            authenticate=qs.authenticate,
            bodies=bodies,
            proxies=qs.proxies,
        ).runner()
        await http_runner.setup()
        # HTTPS with the queue server's certificate (clients have none); plaintext when insecure
        await web.TCPSite(
            http_runner, host or "0.0.0.0", int(port), ssl_context=security.server_ssl(mutual=False)
        ).start()
    agent = None
    if cfg.discovery_port:
        core = DiscoveryCore(cfg.cluster_name, secrets.randbelow(1 << 53) + 1, "queue", cfg.address)
        core.member = True  # a queue server only announces itself
        agent = DiscoveryAgent(
            core,
            cfg.secret(),
            cfg.discovery_port,
            cfg.discovery_broadcast,
            cfg.discovery_seeds,
            listen=False,
        )
        await agent.start()
    if cfg.client_auth == "none":
        log.warning(
            "client_auth is none: every client may call everything, and client ids are "
            'whatever clients declare (give-to-get is forgeable); set client_auth = "token"'
        )
        print(
            "roadlog-queue: WARNING: client_auth = none: the client API checks no credential",
            file=sys.stderr,
        )
    expiry = asyncio.get_running_loop().create_task(qs.expire_loop())
    used = asyncio.get_running_loop().create_task(qs.report_used_loop())
    member = None  # a federation member's agent (docs/federation.md)
    if cfg.directory_servers:
        link = DirectoryLink(cfg.directory_servers, directory_tls(cfg))
        qs.topic_homes = TopicHomes(cfg.cluster_name, link.lookup)
        agent_run = MemberAgent(cfg, qs.topic_homes, link, qs.call).run()
        member = asyncio.get_running_loop().create_task(agent_run)
    log.info(
        "queue server started",
        extra={"listen": cfg.listen, "http": cfg.http_listen, "metrics_port": cfg.metrics_port},
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if started is not None:
        started.set()
    await stop.wait()
    await health_servicer.enter_graceful_shutdown()
    expiry.cancel()
    used.cancel()
    if member is not None:
        member.cancel()
    if agent is not None:
        await agent.stop()
    if http_runner is not None:
        await http_runner.cleanup()
    link_closed = (
        qs.publish_link.close(grace=1.0) if qs.publish_link is not None else asyncio.sleep(0)
    )
    await asyncio.gather(server.stop(grace=1.0), link_closed)
    if qs.frames is not None:
        await qs.frames.close()
    log.info("stopped")
