"""Rotating a live cluster's certificates as SECURITY.md ("Rotating") says,
while a producer keeps publishing:

- under the same CA: a new certificate for every node and queue server
  (``roadlog ca create-node`` / ``create-queue`` into a fresh certs dir, put
  in place of the old), then a rolling restart, the leader last;
- the CA itself, in the three documented steps: (1) the new CA appended to
  every ``ca.crt``, rolling restart; (2) every certificate issued again
  under the new CA (``ca.crt`` now starting with it, as ``roadlog ca``
  signs with its first certificate), rolling restart; (3) the old CA
  dropped, rolling restart.

Throughout, every publish is acknowledged (the client's retries allowed)
and a publish made after each restart is acknowledged; afterwards every
acknowledged ping is stored exactly once, and every TLS port of every
process serves the certificate now in its certs dir. After the CA's
rotation a client certificate of the old CA is refused by the nodes'
mutual ports, one of the new CA gets in, and a client that trusts only
the old CA no longer accepts the cluster's servers.

The files are put in place for every process first and the processes then
restarted one at a time, as ``playbooks/rotate_certs.yml`` and ``site.yml``
do."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from roadlog.client import Connection, Producer
from roadlog.client_tls import ClientTLS
from roadlog.runtime.tls import CA_CERT, Credentials, Identity, cert_files
from roadlog.tools.ca import create_ca, create_cert
from roadlog.tools.localcluster import LocalCluster, NodeInfo, QueueInfo
from roadlog.v1 import admin_pb2_grpc, client_pb2
from tests.certs import ClusterCA
from tests.integration.conftest import (
    assert_exactly_once_in_order,
    create_topic,
    make_pings,
    read_topic,
    wait_for,
)

pytestmark = pytest.mark.integration

HOSTS = ["127.0.0.1", "localhost", "::1"]  # what a local cluster's certificates name
TOPIC = "rotation"


@dataclass
class Publisher:
    """Publishes small batches, one at a time, until stopped, ``max_batches``
    were sent or ``max_s`` passed, whichever comes first (so it ends by
    itself whatever the test does); records the acknowledged pings and
    every batch that failed after the client's retries."""

    conn: Connection
    max_batches: int = 20_000  # at most 50 a second (pause_s): the time bound comes first
    max_s: float = 300.0
    batch: int = 20
    pause_s: float = 0.02
    acked: list[tuple[str, int]] = field(default_factory=list)
    sent: int = 0
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> Publisher:
        self.thread = threading.Thread(target=self._run, daemon=True, name="publisher")
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            p = Producer(self.conn, TOPIC, deadline_s=60.0, client="rotation")
        except Exception as e:
            self.errors.append(f"no producer id: {type(e).__name__}: {e}")
            return
        end = time.monotonic() + self.max_s
        while self.sent < self.max_batches and time.monotonic() < end and not self.stop.is_set():
            cols = make_pings("rotation", self.sent * self.batch, self.batch)
            self.sent += 1
            try:
                p.send_batch(cols)
            except Exception as e:  # a failure of any kind is one to report
                self.errors.append(f"batch {self.sent}: {type(e).__name__}: {e}")
                continue
            dev = cols.device_of()
            self.acked += list(zip(dev.tolist(), cols.ts_ms.tolist(), strict=True))
            self.stop.wait(self.pause_s)

    def acked_after(self, what: str) -> None:
        """Wait until a publish made from now on was acknowledged."""
        mark = len(self.acked)
        try:
            wait_for(lambda: len(self.acked) > mark, 60, f"a publish acknowledged after {what}")
        except AssertionError as e:
            raise AssertionError(f"{e}; failed publishes: {self.errors[-3:]}") from None

    def join(self) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join(timeout=90)
        assert not self.thread.is_alive(), "the publisher did not stop"


def rolling_restart(lc: LocalCluster, pub: Publisher, step: str) -> None:
    """Restart every process, one at a time: the queue servers, then the
    nodes, the Raft leader last; after each, wait until the cluster is ready
    again and a new publish was acknowledged."""

    def restart(name: str) -> None:
        lc.restart(name)
        lc.wait_ready(90)
        pub.acked_after(f"{name} restarted ({step})")

    for q in lc.queue_servers:
        restart(q.name)
    todo = {n.id for n in lc.nodes}
    while todo:
        leader = lc.wait_ready(60)["leader"]
        followers = sorted(todo - {leader})
        node = followers[0] if followers else leader
        restart(lc.node(node).name)
        todo.discard(node)


def processes(lc: LocalCluster) -> list[NodeInfo | QueueInfo]:
    return [*lc.nodes, *lc.queue_servers]


def tls_ports(p: NodeInfo | QueueInfo) -> dict[str, int]:
    """Every TLS port of a process, by what it serves."""

    def flag(name: str) -> int:
        return int(p.argv[p.argv.index(name) + 1])

    if isinstance(p, NodeInfo):
        return {
            "gRPC": int(p.address.rpartition(":")[2]),
            "peer frames": flag("--peer-frames-port"),
            "metrics": p.metrics_port,
        }
    return {
        "gRPC": int(p.grpc.rpartition(":")[2]),
        "work frames": flag("--work-frames-port"),
        "publish link": flag("--publish-link-port"),
        "HTTP": int(p.http.rpartition(":")[2]),
        "metrics": p.metrics_port,
    }


def served(port: int, ctx: ssl.SSLContext) -> bytes:
    """The certificate (DER) the TLS server on 127.0.0.1:``port`` presents
    to a caller with ``ctx`` (which checks it against its CAs)."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s,
    ):
        der = s.getpeercert(binary_form=True)
    assert der
    return der


def own_cert(p: NodeInfo | QueueInfo) -> bytes:
    """The certificate (DER) in the process's certs dir."""
    name = cert_files("node" if isinstance(p, NodeInfo) else "queue")[0]
    return ssl.PEM_cert_to_DER_cert((Path(p.certs_dir) / name).read_text())


def caller(ca_file: Path, certs: Path | None = None) -> ssl.SSLContext:
    """A TLS caller trusting ``ca_file``; with the admin client certificate
    of ``certs`` (the nodes' and the framed ports are mutual); offering h2
    (gRPC) and http/1.1."""
    crt = key = None
    if certs is not None:
        crt, key = (certs / f for f in cert_files("client", "admin"))
    ctx = ClientTLS(ca_file, crt, key).ssl_context()
    assert ctx is not None
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    return ctx


def accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return True
    except OSError:
        return False


def serving(lc: LocalCluster, ctx: ssl.SSLContext) -> dict[str, bytes]:
    """What every TLS port of every process serves, by process and port
    (once each listens: a process binds some after it answers Status)."""
    ports = [port for p in processes(lc) for port in tls_ports(p).values()]
    wait_for(lambda: all(accepts(port) for port in ports), 30, "every TLS port listening")
    return {
        f"{p.name} {what}": served(port, ctx)
        for p in processes(lc)
        for what, port in tls_ports(p).items()
    }


def assert_each_port_serves_its_own_file(lc: LocalCluster, ctx: ssl.SSLContext) -> None:
    files = {p.name: own_cert(p) for p in processes(lc)}
    wrong = [k for k, der in serving(lc, ctx).items() if der != files[k.split()[0]]]
    assert not wrong, f"not serving the certificate in its certs dir: {wrong}"


def put(path: Path, data: bytes) -> None:
    """Replace a file at once (a renamed temporary file), keeping its mode."""
    tmp = path.with_name(f".{path.name}.new")
    tmp.write_bytes(data)
    os.chmod(tmp, path.stat().st_mode & 0o777)
    os.replace(tmp, path)


def framed_greeting(port: int, ctx: ssl.SSLContext) -> bytes:
    """What a framed link's server says first to this caller (b"": nothing)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
                return s.recv(8)
        except (ssl.SSLError, ConnectionError, TimeoutError):
            return b""


def node_status(address: str, tls: ClientTLS) -> grpc.StatusCode:
    """Admin.Status on a node's port (mutual TLS) with these credentials."""
    with tls.channel(address) as ch:
        try:
            admin_pb2_grpc.AdminStub(ch).Status(client_pb2.StatusRequest(), timeout=10)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


Publishing = Callable[..., tuple[LocalCluster, Connection, Publisher]]


@pytest.fixture
def publishing(make_cluster: Callable[..., LocalCluster]) -> Iterator[Publishing]:
    """``publishing(ca_file=None)``: three nodes and two queue servers
    (clients fail over between them), a topic, and a publisher that trusts
    ``ca_file`` (default: the cluster's CA), its first publish acknowledged.
    The publisher is stopped and its connection closed after the test."""
    made: list[tuple[Connection, Publisher]] = []

    def start(ca_file: Path | None = None) -> tuple[LocalCluster, Connection, Publisher]:
        lc = make_cluster(nodes=3, queue_servers=2)
        tls = lc.tls() if ca_file is None else ClientTLS(ca_file, token=lc.admin_token)
        conn = Connection(lc.servers, tls=tls, timeout=60)
        create_topic(conn, TOPIC, partitions=2)
        pub = Publisher(conn)
        made.append((conn, pub))
        pub.start().acked_after("the start")
        return lc, conn, pub

    yield start
    for conn, pub in made:
        pub.stop.set()
        if pub.thread is not None:
            pub.thread.join(timeout=90)
        conn.close()


def assert_every_publish_stored_once(conn: Connection, pub: Publisher) -> None:
    pub.join()
    assert not pub.errors, f"{len(pub.errors)} of {pub.sent} publishes failed: {pub.errors[:3]}"
    assert len(pub.acked) == pub.sent * pub.batch
    assert_exactly_once_in_order(read_topic(conn, TOPIC), pub.acked)


def roadlog_ca(*args: str | Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "roadlog.cli", "ca", *map(str, args)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr


def test_certificates_rotate_under_the_same_ca_without_downtime(
    publishing: Publishing, test_ca: ClusterCA, tmp_path: Path
) -> None:
    lc, conn, pub = publishing()
    ctx = caller(Path(lc.certs_dir) / CA_CERT, Path(lc.certs_dir))
    before = serving(lc, ctx)
    # SECURITY.md: "make a new one for the same identity and hosts (roadlog ca
    # create-node ... into a fresh certs dir), put it in place of the old
    # (key 0600), and restart that one process".
    for p in processes(lc):
        fresh = tmp_path / "fresh" / p.name
        fresh.mkdir(parents=True)
        shutil.copy(Path(p.certs_dir) / CA_CERT, fresh / CA_CERT)
        make: list[str | Path] = ["--certs-dir", fresh, "--ca-key", test_ca.ca_key]
        if isinstance(p, NodeInfo):
            roadlog_ca("create-node", *make, "--node-id", str(p.id), *HOSTS)
            kind = "node"
        else:
            roadlog_ca("create-queue", *make, "--name", p.name, *HOSTS)
            kind = "queue"
        for f in cert_files(kind):  # renamed into place: the key stays 0600
            os.replace(fresh / f, Path(p.certs_dir) / f)
        assert (Path(p.certs_dir) / f"{kind}.key").stat().st_mode & 0o777 == 0o600
    rolling_restart(lc, pub, "new certificates")
    assert_every_publish_stored_once(conn, pub)
    after = serving(lc, ctx)
    assert not [k for k in after if after[k] == before[k]], "a port still serves its old one"
    assert_each_port_serves_its_own_file(lc, ctx)


def test_the_ca_rotates_in_three_steps_without_downtime(
    publishing: Publishing, test_ca: ClusterCA, tmp_path: Path
) -> None:
    old_pem = test_ca.ca_file.read_bytes()
    new_ca = tmp_path / "new-ca"
    create_ca(new_ca, new_ca / "ca.key")
    new_pem = (new_ca / CA_CERT).read_bytes()
    # Clients that must go on through the rotation get the new CA beside the
    # old one before step 2, as the hosts do in step 1.
    both = tmp_path / "client-ca.crt"
    both.write_bytes(old_pem + new_pem)
    lc, conn, pub = publishing(ca_file=both)
    holders = [(Path(n.certs_dir), Identity("node", str(n.id)), HOSTS) for n in lc.nodes]
    holders += [(Path(q.certs_dir), Identity("queue", q.name), HOSTS) for q in lc.queue_servers]
    holders.append((Path(lc.certs_dir), Identity("client", "admin"), []))  # the tools'

    # (1) The new CA after the old one in every ca.crt: trusted, not yet used.
    for d, _, _ in holders:
        put(d / CA_CERT, old_pem + new_pem)
    rolling_restart(lc, pub, "step 1, both CAs trusted")

    # (2) Every certificate again, under the new CA (first in ca.crt now).
    for d, ident, hosts in holders:
        put(d / CA_CERT, new_pem + old_pem)
        create_cert(d, new_ca / "ca.key", ident, hosts, overwrite=True)
    rolling_restart(lc, pub, "step 2, new certificates")

    # (3) The old CA dropped.
    for d, _, _ in holders:
        put(d / CA_CERT, new_pem)
    rolling_restart(lc, pub, "step 3, the old CA dropped")

    assert_every_publish_stored_once(conn, pub)
    new_only = caller(new_ca / CA_CERT, Path(lc.certs_dir))
    assert_each_port_serves_its_own_file(lc, new_only)
    # A caller that trusts only the old CA accepts none of the servers now.
    old_only = caller(test_ca.ca_file)
    for p in processes(lc):
        for port in tls_ports(p).values():
            with pytest.raises(ssl.SSLCertVerificationError):
                served(port, old_only)
    # A client certificate of the old CA is refused by every node's mutual
    # port; the tools' certificate, issued under the new CA in step 2, gets in.
    crt, key = cert_files("client", "admin")
    old_client = ClientTLS(new_ca / CA_CERT, test_ca.client() / crt, test_ca.client() / key)
    for n in lc.nodes:
        assert node_status(n.address, old_client) == grpc.StatusCode.UNAVAILABLE, n.name
        assert node_status(n.address, lc.tls()) == grpc.StatusCode.OK, n.name
    # So is a node certificate of the old CA on the framed Raft link (what
    # leaving a compromised certificate out of step 2 relies on); the node's
    # own, of the new CA, is greeted.
    old_node = test_ca.creds("node", 1).client_ssl()
    old_node.load_verify_locations(cafile=str(new_ca / CA_CERT))  # it trusts the servers
    new_node = Credentials.load(Path(lc.node(1).certs_dir), "node").client_ssl()
    for n in lc.nodes:
        port = tls_ports(n)["peer frames"]
        assert framed_greeting(port, old_node) == b"", n.name
        assert framed_greeting(port, new_node).startswith(b"RL"), n.name
