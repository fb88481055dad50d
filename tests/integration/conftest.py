"""Real processes on loopback: local clusters made and always torn down."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from roadlog.client import Admin, Connection, Consumer, Producer, RoadlogError
from roadlog.client_tls import ClientTLS
from roadlog.columnar import PingColumns
from roadlog.geo import bbox_region
from roadlog.tools.localcluster import LocalCluster
from tests.certs import ClusterCA
from tests.waiting import wait_for as wait_for  # the tier's tests import it from here

REGION = bbox_region(11.4, 48.05, 11.75, 48.25).geojson
T = TypeVar("T")


@pytest.fixture(scope="session", autouse=True)
def cluster_tls(test_ca: ClusterCA) -> Iterator[ClusterCA]:
    """Every cluster of this tier runs with TLS, its certificates signed by
    the session's CA; the SDK, the tools, Spark and the processes tests
    start trust it and present its admin client certificate (the
    ROADLOG_CA_FILE, _CERT_FILE and _KEY_FILE that ClientTLS.from_env reads).
    The clusters' HTTP ports are HTTPS: urllib's default opener here trusts
    the session's CA too (a call with its own ``context=`` builds its own)."""
    client = test_ca.client()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROADLOG_CA_FILE", str(client / "ca.crt"))
        mp.setenv("ROADLOG_CERT_FILE", str(client / "client.admin.crt"))
        mp.setenv("ROADLOG_KEY_FILE", str(client / "client.admin.key"))
        mp.delenv("ROADLOG_INSECURE", raising=False)
        ctx = ClientTLS.from_env().ssl_context()
        urllib.request.install_opener(
            urllib.request.build_opener(urllib.request.HTTPSHandler(context=ctx), BearerFromEnv())
        )
        try:
            yield test_ca
        finally:
            urllib.request.install_opener(None)


class BearerFromEnv(urllib.request.BaseHandler):
    """urllib's default opener here sends ROADLOG_TOKEN (the admin token of
    the cluster a test made last, see ``make_cluster``) as the Bearer token
    of a request that carries no Authorization header of its own."""

    def http_request(self, req: urllib.request.Request) -> urllib.request.Request:
        token = os.environ.get("ROADLOG_TOKEN")
        if token and not req.has_header("Authorization"):
            req.add_unredirected_header("Authorization", f"Bearer {token}")
        return req

    https_request = http_request


@pytest.fixture
def make_cluster(
    tmp_path: Path, test_ca: ClusterCA, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., LocalCluster]]:
    """Clusters on loopback; each test's SDK calls (ClientTLS.from_env) and
    urllib requests carry the admin token of the cluster made last
    (ROADLOG_TOKEN), and its CLI calls with --cluster DIR their cluster's."""
    made: list[LocalCluster] = []

    def make(
        nodes: int = 3,
        queue_servers: int = 1,
        extra: list[str] | None = None,
        queue_extra: list[str] | None = None,
    ) -> LocalCluster:
        lc = LocalCluster.create(
            tmp_path / f"c{len(made)}",
            nodes,
            queue_servers,
            extra,
            queue_extra,
            ca=(test_ca.ca_dir, test_ca.ca_key),
        )
        made.append(lc)
        lc.start_all()
        lc.wait_ready(60)
        assert lc.admin_token
        monkeypatch.setenv("ROADLOG_TOKEN", lc.admin_token)
        return lc

    yield make
    # A second of grace, not more, here and wherever a test's cluster goes:
    # the followers and queue servers stop within a fraction of it, and a
    # leader stopped with the whole cluster waits out its hand-over to a
    # follower that is stopping too (5 s) and would be SIGKILLed anyway.
    for lc in made:
        lc.down(grace=1)


def framed_greeting(port: int, ctx: ssl.SSLContext | None, size: int = 8) -> bytes:
    """What a framed link's server on 127.0.0.1 says first to this caller
    (its first ``size`` bytes; b"": nothing)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        try:
            sock = ctx.wrap_socket(raw, server_hostname="127.0.0.1") if ctx else raw
            if ctx is None:
                sock.sendall(b"\x00" * 64)  # not a TLS hello
            return sock.recv(size)
        except (ssl.SSLError, ConnectionError, TimeoutError):
            return b""


def settled(read: Callable[[], T], ok: Callable[[T], bool], what: str, timeout: float = 30.0) -> T:
    """``read()`` again until ``ok`` holds of its answer; that answer (a
    ``wait_for``: WaitTimeout with the last answer, past ``timeout``). For
    reads that cannot be fenced at the write they must see (the ``roadlog``
    CLI has no fence option; a write made by another process leaves no index
    at hand): any node answers them, one that has not applied the write yet
    included."""
    seen: list[T] = []

    def holds() -> bool:
        seen[:] = [read()]
        return ok(seen[0])

    try:
        wait_for(holds, timeout, what)
    except AssertionError as e:
        raise AssertionError(f"{e}; the last answer: {seen[0] if seen else None!r}") from None
    return seen[0]


def read_fences(answer: dict[str, Any]) -> str:
    """The query (``min_applied_index=...&group_fences=G:I,...``) that fences
    an HTTP read on a publish's JSON answer: group 0's index for a topic of
    group 0, each data group's for a topic placed in them (the default
    layout; ``applied_index`` is then 0)."""
    query = f"min_applied_index={answer['applied_index']}"
    groups = ",".join(f"{g}:{i}" for g, i in sorted(answer.get("group_fences", {}).items()))
    return query + (f"&group_fences={groups}" if groups else "")


def make_pings(producer: str, start: int, n: int, devices: int = 4) -> PingColumns:
    """Pings whose (device, ts) names them uniquely; ts grows per device."""
    now = int(time.time() * 1000)
    ts = now - 3_600_000 + np.arange(start, start + n)
    return PingColumns.from_columns(
        [f"{producer}-d{i % devices}" for i in range(start, start + n)],
        ts,
        (48.1 + (np.arange(n) % 100) * 1e-4).astype(np.float64),
        (11.5 + (np.arange(n) % 100) * 1e-4).astype(np.float64),
        speed_mps=np.full(n, 10.0, dtype=np.float32),
    )


@dataclass
class ProducerRun:
    """A producer thread that sends batches until stopped and records what
    was acknowledged."""

    conn: Connection
    topic: str
    name: str
    batch: int = 200
    acked: list[tuple[str, int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    deadline_s: float = 30.0
    pause_s: float = 0.0  # between batches: a steady load instead of a flood

    def start(self) -> ProducerRun:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        p = Producer(self.conn, self.topic, deadline_s=self.deadline_s, client=self.name)
        sent = 0
        while not self.stop.is_set():
            cols = make_pings(self.name, sent, self.batch)
            sent += self.batch  # a failed batch is given up: its pings are never sent again
            try:
                p.send_batch(cols)
            except RoadlogError as e:
                self.errors.append(str(e))
                continue
            dev = cols.device_of()
            self.acked += list(zip(dev.tolist(), cols.ts_ms.tolist(), strict=True))
            if self.pause_s:
                self.stop.wait(self.pause_s)

    def join(self) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join(timeout=120)
        assert not self.thread.is_alive(), "producer did not stop"


def read_topic(conn: Connection, topic: str) -> dict[int, list[tuple[str, int]]]:
    """Every stored ping of a topic, per partition, in offset order."""
    d = Admin(conn).describe(topic)
    out: dict[int, list[tuple[str, int]]] = {}
    c = Consumer(conn, topic)
    for p in range(d.topic.spec.partitions):
        c.seek(p, d.partitions[p].first_offset)
        rows: list[tuple[str, int]] = []
        for b in c.read_to_end(p):
            assert b.base_offset == d.partitions[p].first_offset + len(rows), "offsets not dense"
            rows += list(zip(b.pings.device_of().tolist(), b.pings.ts_ms.tolist(), strict=True))
        out[p] = rows
    return out


def assert_exactly_once_in_order(
    stored: dict[int, list[tuple[str, int]]], acked: list[tuple[str, int]]
) -> None:
    all_rows = [r for rows in stored.values() for r in rows]
    counts: dict[tuple[str, int], int] = {}
    for r in all_rows:
        counts[r] = counts.get(r, 0) + 1
    dup = [r for r, c in counts.items() if c > 1]
    assert not dup, f"{len(dup)} pings stored twice, e.g. {dup[:3]}"
    missing = [r for r in acked if r not in counts]
    assert not missing, f"{len(missing)} acknowledged pings lost, e.g. {missing[:3]}"
    for rows in stored.values():
        last: dict[str, int] = {}
        for dev, ts in rows:
            assert ts > last.get(dev, -1), f"device {dev} out of order"
            last[dev] = ts


# Give-to-get counts a contribution once an identity sent at least this many
# pings over at least this many seconds (issue 39, item 3): the tier's
# topics ask little (the defaults, 20 over 60 s, would make every test wait
# a minute); ``contribute`` makes such a contribution.
SMALL_PINGS, SMALL_SECONDS = 3, 2


def create_topic(conn: Connection, name: str = "munich", partitions: int = 4) -> None:
    Admin(conn).create_topic(
        name,
        REGION,
        partitions,
        contribution_min_pings=SMALL_PINGS,
        contribution_min_seconds=SMALL_SECONDS,
    )


def contribute(
    send: Callable[[int], object], pings: int = SMALL_PINGS, seconds: float = SMALL_SECONDS
) -> int:
    """Call ``send(k)`` (k = 0, 1, ...: publish a ping or a batch, and wait
    for its answer) until ``pings`` went out over more than ``seconds``
    (with a margin for when the leader stamps them): what give-to-get
    counts as a contribution. How many calls it took."""
    start = time.monotonic()
    sent = 0

    def enough() -> bool:
        nonlocal sent
        send(sent)
        sent += 1
        return sent >= pings and time.monotonic() - start > seconds + 0.5

    wait_for(enough, seconds + 60, f"{pings} pings over {seconds} s", every=seconds / pings)
    return sent


@contextlib.contextmanager
def headless_chromium(width: int, height: int, trust: Path | None = None) -> Iterator[Any]:
    """A headless Chromium (selenium) of that window size, keeping the
    browser's console log; quit whatever happens. ``trust``: a server
    certificate (PEM) the browser accepts though no root it knows signed
    it (a local cluster's queue server: its CA is not the system's), by
    the hash of its public key; any other certificate is still refused."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        f"--window-size={width},{height}",
    ):
        opts.add_argument(arg)
    if trust is not None:
        opts.add_argument(f"--ignore-certificate-errors-spki-list={spki_hash(trust)}")
    opts.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(
        service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"), options=opts
    )
    try:
        yield driver
    finally:
        driver.quit()


def spki_hash(cert_file: Path) -> str:
    """base64(SHA-256(SubjectPublicKeyInfo)) of a PEM certificate, as
    Chromium's --ignore-certificate-errors-spki-list takes it."""
    import base64
    import hashlib

    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    key = x509.load_pem_x509_certificate(cert_file.read_bytes()).public_key()
    spki = key.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(spki).digest()).decode()
