"""Hosts as network namespaces on a bridge that the test creates and removes
(10.77.0.0/24; the bridge itself is 10.77.0.1 so the test can reach them).

Everything made here is torn down after the test: the processes (by their
own PIDs), the namespaces and the bridge. Packet loss is injected with an
nftables rule in a host's namespace (this kernel has no netem).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest

from roadlog.runtime.processes import alive, wait_dead
from roadlog.v1 import admin_pb2, admin_pb2_grpc, client_pb2
from tests import waiting
from tests.bridge_lock import bridge_subnet

SUBNET = "10.77.0"
REPO = Path(__file__).resolve().parents[2]


def sh(*argv: str) -> None:
    """Run a command; a failure names the command and what it printed."""
    r = subprocess.run(argv, capture_output=True, timeout=30)
    if r.returncode != 0:
        err = (r.stderr or r.stdout).decode(errors="replace").strip()
        raise RuntimeError(f"{' '.join(argv)} exited {r.returncode}: {err}")


def link_exists(name: str) -> bool:
    shown = subprocess.run(["ip", "link", "show", name], capture_output=True, timeout=30)
    return shown.returncode == 0


_nets_made = 0


# tests/waiting.py's wait_for, asking every 0.2 s: the tier's conditions ask
# each namespace's node over gRPC.
wait_for = partial(waiting.wait_for, every=0.2)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if alive(self.popen.pid):
            os.kill(self.popen.pid, sig)
            wait_dead(self.popen.pid, 20)
        self.popen.wait(10)


@dataclass
class Host:
    net: Net
    index: int
    ns: str
    ip: str
    procs: list[Proc] = field(default_factory=list)

    @property
    def node_address(self) -> str:
        return f"{self.ip}:7400"

    def spawn(self, name: str, argv: list[str]) -> Proc:
        log = self.net.dir / f"{name}.log"
        with open(log, "ab") as out:
            p = subprocess.Popen(
                ["ip", "netns", "exec", self.ns, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO,
                start_new_session=True,
            )
        proc = Proc(name, p, log)
        self.procs.append(proc)
        return proc

    def node(
        self, expect: int = 3, secret: Path | None = None, extra: list[str] | None = None
    ) -> Proc:
        """A node daemon with discovery on this host (data in its own dir)."""
        data = self.net.dir / f"data-{self.index}"
        return self.spawn(
            f"node-{self.index}-{len(self.procs)}",
            [
                sys.executable, "-m", "node_daemon.process.main", "run",
                "--cluster-name", "netns",
                "--data-dir", str(data),
                "--listen", self.node_address,
                "--secret-file", str(secret or self.net.secret),
                "--insecure",  # TLS in the netns tier is a follow-up (hosts' addresses)
                "--metrics-port", "9400",
                "--discovery-broadcast", f"{self.net.subnet}.255",
                "--bootstrap-expect", str(expect),
                # The product's default (one data group per voter, in worker
                # processes) unless a test says otherwise (issue 41).
                *(extra or []),
            ],
        )  # fmt: skip

    def lossy(self, percent: int) -> None:
        """Drop this share of discovery datagrams arriving here."""
        nft = ["ip", "netns", "exec", self.ns, "nft"]
        sh(*nft, "add", "table", "inet", "loss")
        sh(*nft, "add", "chain", "inet", "loss", "in", "{ type filter hook input priority 0; }")
        sh(*nft, "add", "rule", "inet", "loss", "in", "udp", "dport", "7499",
           "numgen", "random", "mod", "100", "<", str(percent), "drop")  # fmt: skip


@dataclass
class Net:
    dir: Path
    tag: str
    hosts: dict[int, Host] = field(default_factory=dict)
    secret: Path = Path()
    subnet: str = SUBNET  # the first three octets of the /24 (the bridge is .1)

    @property
    def bridge(self) -> str:
        return f"rlb{self.tag}"

    def create(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        self.secret = self.dir / "secret"
        self.secret.write_text("netns-test-secret-0123456789abcdef0123456789\n")  # >= 32 bytes
        self.secret.chmod(0o600)
        os.environ["ROADLOG_INSECURE"] = "1"  # the SDK and tools: plaintext, as the daemons

    def host(self, index: int) -> Host:
        """Host ``index`` (<subnet>.<10 + index>), made on first use."""
        if index in self.hosts:
            return self.hosts[index]
        ns, veth = f"rl{self.tag}h{index}", f"rl{self.tag}v{index}"
        ip = f"{self.subnet}.{10 + index}"
        h = Host(self, index, ns, ip)
        self.hosts[index] = h  # recorded first: destroy() removes a half-made host too
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", veth, "master", self.bridge, "up")
        sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        return h

    def destroy(self) -> None:
        """Kill the processes, then remove every veth, namespace and the
        bridge, waiting (bounded) until the kernel has let go of the links:
        a namespace's links otherwise vanish asynchronously, after
        ``ip netns del`` has returned."""
        for h in self.hosts.values():
            for p in h.procs:
                p.kill()
        links = [f"rl{self.tag}v{i}" for i in self.hosts] + [self.bridge]
        for link in links:  # deleting our end of a veth deletes both ends now
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)
        for h in self.hosts.values():
            subprocess.run(["ip", "netns", "del", h.ns], capture_output=True, timeout=30)
        wait_for(lambda: not any(link_exists(link) for link in links), 30, "the test's links to go")


@pytest.fixture(scope="session", autouse=True)
def bridge_subnet_held() -> Iterator[None]:
    """The bridge subnet is this tier's alone while it runs (a lab run on
    this machine would end its hosts, and it the lab's: tests/bridge_lock.py)."""
    with bridge_subnet("netns", say=lambda m: print(m, file=sys.__stderr__, flush=True)):
        yield


@pytest.fixture
def net(tmp_path: Path) -> Iterator[Net]:
    if os.geteuid() != 0:
        pytest.fail("the netns tier needs root (network namespaces and a bridge)")
    global _nets_made
    _nets_made += 1  # a fresh tag per test: names never meet a previous test's leftovers
    n = Net(tmp_path, f"{os.getpid() % 10000}{_nets_made % 100:02d}")
    n.create()
    try:
        yield n
    finally:
        n.destroy()


def node_status(address: str, timeout: float = 2.0) -> client_pb2.ClusterStatus | None:
    try:
        with grpc.insecure_channel(address) as ch:
            return admin_pb2_grpc.AdminStub(ch).Status(client_pb2.StatusRequest(), timeout=timeout)
    except grpc.RpcError:
        return None


def views(hosts: list[Host]) -> dict[int, Any]:
    """Each answering node's own view: id -> NodeStatus."""
    out = {}
    for h in hosts:
        st = node_status(h.node_address)
        if st is not None and st.nodes:
            out[h.index] = st.nodes[0]
    return out


def one_cluster(hosts: list[Host], voters: int, members: int) -> bool:
    """Every host answers, all agree on one leader, and the leader's
    configuration has ``voters`` voters and ``members`` members in all."""
    v = views(hosts)
    if len(v) != len(hosts):
        return False
    leaders = {n.leader for n in v.values()}
    if len(leaders) != 1 or 0 in leaders:
        return False
    lead = next(n for n in v.values() if n.id == next(iter(leaders)))
    ids = {n.id for n in v.values()}
    everyone = set(lead.voters) | set(lead.learners)
    return len(lead.voters) == voters and everyone == ids and len(everyone) == members


def metric(host: Host, name: str) -> float:
    """Sum of a Prometheus metric's samples on a node (its port 9400)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{host.ip}:9400/metrics", timeout=5).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def digest(address: str) -> tuple[int, bytes]:
    with grpc.insecure_channel(address) as ch:
        r = admin_pb2_grpc.AdminStub(ch).StateDigest(admin_pb2.StateDigestRequest(), timeout=10)
    return r.applied_index, r.sha256
