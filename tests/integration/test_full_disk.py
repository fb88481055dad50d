"""A full disk (issue 21): every node's data directory on a small tmpfs of
its own. Nearly full, the leader refuses growing writes with a clear error
at both APIs, reads go on, and writes come back once there is room; a
follower whose disk is completely full stays up, retries its log writes
and catches up, byte-identical, once space returns. Nothing acknowledged
is lost on the way."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_daemon.storage.disk import free_bytes
from roadlog.client import Connection, Consumer, Producer, RoadlogError
from roadlog.runtime.processes import alive
from roadlog.tools.localcluster import LocalCluster, NodeInfo
from tests.certs import ClusterCA
from tests.integration.conftest import create_topic, make_pings, wait_for
from tests.integration.test_replicated_log import digest

pytestmark = pytest.mark.integration

MIB = 1 << 20
DISK = 160 * MIB
MIN_FREE = 32 * MIB


@contextlib.contextmanager
def on_small_disks(
    directory: Path, ca: ClusterCA, monkeypatch: pytest.MonkeyPatch, data_groups: int | None
) -> Iterator[LocalCluster]:
    """A 3-node cluster whose nodes' data directories are tmpfs mounts of
    DISK bytes each, refusing growing writes under MIN_FREE."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    lc = LocalCluster.create(
        directory, 3, 1, ["--min-free-bytes", str(MIN_FREE)], ca=ca.signing,
        data_groups=data_groups,
    )  # fmt: skip
    mounted: list[str] = []
    try:
        for n in lc.nodes:
            Path(n.data_dir).mkdir(parents=True, exist_ok=True)
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={DISK},mode=0700", "tmpfs", n.data_dir],
                check=True,
            )
            mounted.append(n.data_dir)
        lc.start_all()
        lc.wait_ready(60)
        assert lc.admin_token
        monkeypatch.setenv("ROADLOG_TOKEN", lc.admin_token)  # the SDK's and urllib's calls
        yield lc
    finally:
        lc.down(grace=1)
        for d in mounted:
            unmount(d)


@pytest.fixture
def cluster_on_small_disks(
    tmp_path: Path, test_ca: ClusterCA, monkeypatch: pytest.MonkeyPatch
) -> Iterator[LocalCluster]:
    """One group: this test is about a node's disk, not about data groups
    (test_full_disk_leadership.py runs the default layout)."""
    with on_small_disks(tmp_path / "c", test_ca, monkeypatch, data_groups=1) as lc:
        yield lc


def unmount(path: str, timeout: float = 15.0) -> None:
    """Unmount ``path``: again while it is busy (a process that held a file
    there may take a moment to be gone), then lazily, so that no tmpfs
    outlives the test."""
    deadline = time.monotonic() + timeout
    while os.path.ismount(path):
        if subprocess.run(["umount", path], capture_output=True).returncode == 0:
            return
        if time.monotonic() > deadline:
            subprocess.run(["umount", "--lazy", path], check=False)
            return
        time.sleep(0.2)


def ballast(node: NodeInfo, leave: int) -> Path:
    """Fill the node's disk until ``leave`` bytes are free (0: until ENOSPC)."""
    path = Path(node.data_dir) / "ballast"
    chunk = b"\0" * MIB
    with open(path, "ab") as f:
        while True:
            room = free_bytes(node.data_dir) - leave
            if leave and room < MIB:
                break
            try:
                f.write(chunk if not leave else chunk[: min(MIB, room)])
                f.flush()
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                break
    return path


def http_publish(lc: LocalCluster, n: int) -> tuple[int, dict[str, object]]:
    body = {
        "client_id": "web",
        "pings": [
            {"device_id": "web-1", "ts_ms": 1_790_000_000_000 + i, "lat": 48.1, "lon": 11.5}
            for i in range(n)
        ],
    }
    req = urllib.request.Request(
        f"{lc.queue_servers[0].http}/v1/topics/munich/pings",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def read_all(conn: Connection, fence: int) -> list[tuple[str, int]]:
    """Every stored ping (device, ts), read at ``fence`` or later."""
    out: list[tuple[str, int]] = []
    c = Consumer(conn, "munich")
    c.min_applied_index = fence
    for p in range(4):
        for b in c.read_to_end(p):
            out += zip(b.pings.device_of().tolist(), b.pings.ts_ms.tolist(), strict=True)
    return out


def test_a_nearly_full_disk_refuses_writes_clearly_and_a_full_one_is_survived(
    cluster_on_small_disks: LocalCluster,
) -> None:
    lc = cluster_on_small_disks
    with Connection(lc.servers, timeout=10) as conn:
        create_topic(conn)
        producer = Producer(conn, "munich", client="p", deadline_s=5)
        acked: set[tuple[str, int]] = set()
        fence = 0

        def publish(start: int, n: int = 200) -> None:
            nonlocal fence
            cols = make_pings("p", start, n)
            ack = producer.send_batch(cols)
            fence = max(fence, ack.applied_index)
            acked.update(zip(cols.device_of().tolist(), cols.ts_ms.tolist(), strict=True))

        publish(0)

        # Nearly full everywhere: refused at both APIs, with the reason.
        weights = [ballast(n, MIN_FREE // 2) for n in lc.nodes]
        refusals: list[str] = []

        def refused() -> bool:  # the leader looks at its disk every 0.25 s
            try:
                publish(100_000 + 10 * len(acked))  # taken before it looked: acked, kept
            except RoadlogError as err:
                refusals.append(err.message)
                return True
            return False

        wait_for(refused, 30, "a write refused")
        assert "disk is nearly full" in refusals[0], refusals
        code, body = http_publish(lc, 5)
        assert code == 503 and "disk is nearly full" in json.dumps(body), (code, body)
        stored = read_all(conn, fence)
        assert len(stored) == len(set(stored)) and set(stored) == acked  # reads go on
        assert all(alive(n.pid) for n in lc.nodes)

        # Room again: writes are taken again.
        for w in weights:
            w.unlink()
        wait_for(lambda: _publishes(publish, 2000), 30, "writes taken again")

        # A follower's disk completely full: the others go on (a majority),
        # it stays up, retrying its log writes, and catches up afterwards.
        leader = lc.status()["leader"]
        follower = next(n for n in lc.nodes if n.id != leader)
        weight = ballast(follower, 0)
        for k in range(10):
            publish(3000 + 200 * k)
        wait_for(lambda: _retries(lc, follower) > 0, 30, "the full follower retrying its writes")
        assert alive(follower.pid)
        weight.unlink()
        wait_for(
            lambda: _same_state(lc), 60, "the follower caught up, byte-identical to the others"
        )
        assert all(alive(n.pid) for n in lc.nodes)
        stored = read_all(conn, fence)
        assert len(stored) == len(set(stored)) and set(stored) == acked  # nothing lost


def _publishes(publish: object, start: int) -> bool:
    try:
        publish(start)  # type: ignore[operator]
        return True
    except RoadlogError:
        return False


def _retries(lc: LocalCluster, node: NodeInfo) -> float:
    """Writes the node has tried again for want of space (its /metrics)."""
    url = lc.metrics_url(node)
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("roadlog_storage_full_retries_total{")
    )


def _same_state(lc: LocalCluster) -> bool:
    try:
        states = {digest(n.address) for n in lc.nodes}
    except Exception:
        return False
    return len(states) == 1
