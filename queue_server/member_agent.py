"""A member cluster's queue server in its federation (issue 43,
docs/federation.md): it registers with the directory (this cluster's
``cluster_name`` and tags, its own addresses, its CA), reports its load
every ``directory_report_s`` (publishes a second, from its own counters;
pings a second, from the offsets its cluster's topics reached, read with
one ``ListTopics`` of its own a report: the cluster's figure, the same in
each of its queue servers' reports), and refreshes ``TopicHomes`` from the
directory's answer. A directory that does not answer stops nothing here:
the agent logs it and tries again at the next report.

``DirectoryLink`` is the directory's client: unary calls with the bytes of
the rpc table's messages, over the directory's queue servers in turn, with
the token of ``directory_token_file``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message
from prometheus_client import REGISTRY

from queue_server.config import QueueConfig
from queue_server.topic_home import TopicHomes
from roadlog.client_tls import ClientTLS
from roadlog.errors import Code, RoadlogError
from roadlog.grpc_status import from_grpc
from roadlog.rpc import BY_NAME, SERVICE
from roadlog.runtime import tls
from roadlog.runtime.tls import CA_CERT
from roadlog.v1 import client_pb2, federation_pb2

log = logging.getLogger("roadlog.queue.federation")
# The queue server's own call to its cluster's nodes (``QueueServer.call``).
OwnCall = Callable[[str, bytes, float | None], Awaitable[bytes]]
MAX_TOPIC_PAGES = 100  # of ListTopics a report reads at most
_RETRY = {Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.RESOURCE_EXHAUSTED, Code.CANCELLED}


class DirectoryLink:
    """Calls to the directory's queue servers (see the module's doc)."""

    def __init__(self, servers: list[str], client_tls: ClientTLS) -> None:
        self.servers = servers
        self.channels = [client_tls.aio_channel(s) for s in servers]
        self.metadata = client_tls.metadata()
        self._current = 0

    async def call(self, method: str, request: Message, timeout: float) -> Message:
        """The answer of ``method``, tried on each server in turn until
        ``timeout``; a refusal no retry changes raises at once."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while (left := deadline - time.monotonic()) > 0.05:
            ch = self.channels[self._current]
            fn: Any = ch.unary_unary(f"/{SERVICE}/{method}")
            try:
                raw = await fn(request.SerializeToString(), timeout=left, metadata=self.metadata)
                return BY_NAME[method].response.FromString(raw)
            except grpc.RpcError as e:
                code = from_grpc(e.code())
                if code not in _RETRY:
                    raise RoadlogError(code, e.details() or "") from None
                last = e.details() or code.name
                self._current = (self._current + 1) % len(self.channels)
                await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        raise RoadlogError(Code.UNAVAILABLE, f"the directory did not answer: {last}")

    async def lookup(self, topic: str, timeout: float) -> federation_pb2.TopicHome | None:
        """The topic's home (None: the directory knows none)."""
        try:
            home = await self.call(
                "LookupTopic", federation_pb2.LookupTopicRequest(topic=topic), timeout
            )
        except RoadlogError as e:
            if e.code == Code.NOT_FOUND:
                return None
            raise
        assert isinstance(home, federation_pb2.TopicHome)
        return home

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()


def directory_tls(cfg: QueueConfig) -> ClientTLS:
    """How this queue server dials the directory: its CA (default: this
    cluster's own, one root in a local federation) and its token."""
    token = cfg.directory_token_file.read_text().strip() if cfg.directory_token_file else None
    if cfg.insecure:
        return ClientTLS(insecure=True, token=token)
    ca = cfg.directory_ca_file or (cfg.certs_dir / CA_CERT if cfg.certs_dir else None)
    return ClientTLS(ca, token=token)


def http_base(cfg: QueueConfig) -> str:
    """This server's HTTP API as the federation is told it ("": none)."""
    if cfg.http_advertise or not cfg.http_listen:
        return cfg.http_advertise
    scheme = "http" if tls.current().insecure else "https"
    return f"{scheme}://{cfg.http_listen}"


def published_total() -> float:
    """Publishes this server answered OK so far (its request counters)."""
    return sum(
        REGISTRY.get_sample_value("roadlog_queue_requests_total", {"method": m, "code": "OK"})
        or 0.0
        for m in ("Publish", "PublishBatch")
    )


class MemberAgent:
    """Registration, load reports and the homes' refresh (see the module's doc)."""

    def __init__(
        self,
        cfg: QueueConfig,
        homes: TopicHomes,
        link: DirectoryLink,
        own: OwnCall | None = None,
    ) -> None:
        self.cfg = cfg
        self.homes = homes
        self.link = link
        self.own = own  # None: pings a second not known (told 0)
        self.registered = False
        self._last = (time.monotonic(), published_total())
        self._stored: tuple[float, int] | None = None  # when, pings stored by then

    async def stored_pings(self, timeout: float) -> int | None:
        """Every ping the cluster's topics were ever given (the sum of their
        partitions' next offsets); None: not known now."""
        if self.own is None:
            return None
        total, token = 0, ""
        try:
            for _ in range(MAX_TOPIC_PAGES):
                req = client_pb2.ListTopicsRequest(page_token=token).SerializeToString()
                page = client_pb2.ListTopicsResponse.FromString(
                    await self.own("ListTopics", req, timeout)
                )
                total += sum(p.next_offset for t in page.topics for p in t.partitions)
                token = page.next_page_token
                if not token:
                    return total
        except RoadlogError as e:
            log.info("no topic figures for the load report", extra={"why": e.message})
        return None

    async def pings_per_s(self, timeout: float) -> float:
        """Pings stored a second since the last report (0: not known yet)."""
        total = await self.stored_pings(timeout)
        if total is None:
            return 0.0
        now, before = time.monotonic(), self._stored
        self._stored = (now, total)
        if before is None or total < before[1]:  # the first, or a topic deleted
            return 0.0
        return (total - before[1]) / max(now - before[0], 1e-3)

    def member(self) -> federation_pb2.FederationMember:
        ca = b""
        if self.cfg.certs_dir is not None and (Path(self.cfg.certs_dir) / CA_CERT).exists():
            ca = (Path(self.cfg.certs_dir) / CA_CERT).read_bytes()
        http = http_base(self.cfg)
        return federation_pb2.FederationMember(
            name=self.cfg.cluster_name,
            tags=self.cfg.cluster_tags,
            queue_servers=[self.cfg.address],
            http=[http] if http else [],
            ca_pem=ca.decode(),
        )

    async def once(self, timeout: float = 5.0) -> None:
        """Register (if not yet), report, refresh; raises what failed."""
        if not self.registered:
            register = federation_pb2.RegisterMemberRequest(member=self.member())
            await self.link.call("RegisterMember", register, timeout)
            self.registered = True
            log.info("registered with the directory", extra={"cluster": self.cfg.cluster_name})
        now, total = time.monotonic(), published_total()
        then, before = self._last
        self._last = (now, total)
        load = federation_pb2.MemberLoad(
            queue_server=self.cfg.address,
            publishes_per_s=(total - before) / max(now - then, 1e-3),
            pings_per_s=await self.pings_per_s(timeout),
        )
        req = federation_pb2.ReportLoadRequest(name=self.cfg.cluster_name, load=load)
        try:
            await self.link.call("ReportLoad", req, timeout)
        except RoadlogError as e:
            if e.code == Code.NOT_FOUND:  # the directory forgot it (made again): register again
                self.registered = False
            raise
        fed = await self.link.call("GetFederation", federation_pb2.GetFederationRequest(), timeout)
        assert isinstance(fed, federation_pb2.Federation)
        self.homes.refresh(fed)

    async def run(self) -> None:
        """``once`` every ``directory_report_s``, forever."""
        while True:
            try:
                await self.once(timeout=max(2.0, self.cfg.directory_report_s))
            except RoadlogError as e:
                log.warning(
                    "directory unreachable or refused",
                    extra={"code": e.code.name, "why": e.message},
                )
            await asyncio.sleep(self.cfg.directory_report_s)
