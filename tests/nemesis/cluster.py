"""A roadlog cluster whose every process is a host of its own: network
namespaces on a bridge the run makes and removes (``tests.netns``'s
``Net``), nodes with static peers, each with its data directory on a small
ext4 disk of its own that can lose power (``disks``) and its wall clock
read through ``clockshim``, and queue servers with gRPC and HTTP.

Only processes started here are ever signalled, and only while this
process has not reaped them (``Popen.poll() is None``), so a PID can never
have been reused by someone else's process.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import lmdb

from node_daemon.state.replica_view import StateReplicaView
from node_daemon.storage.log_store import MAX_DBS, STORES_DIR, LogStore, db_names, stores_in
from roadlog.client import Admin, Connection
from roadlog.client_tls import ClientTLS
from roadlog.errors import RoadlogError
from roadlog.runtime.auth import cluster_token, token_metadata
from roadlog.runtime.tls import CA_CERT, Identity, cert_files
from roadlog.scopes import ADMIN, new_token, token_hash
from roadlog.status import ask_node
from roadlog.v1 import admin_pb2, admin_pb2_grpc, client_pb2, client_pb2_grpc, clients_pb2
from tests.nemesis.disks import Disk, ImageStore
from tests.netns.conftest import REPO, Host, Net

log = logging.getLogger("nemesis.cluster")

NODE_PORT, QUEUE_PORT, HTTP_PORT = 7400, 7500, 7580
MIB = 1 << 20
NODE_HOST0, QUEUE_HOST0 = 0, 10  # host index i is <subnet>.<10 + i>
BALLAST = "nemesis-ballast"


def in_netns(host: Host) -> list[str]:
    """The prefix that runs a program in ``host``'s network namespace and
    nothing else: unlike ``ip netns exec`` it makes no mount namespace, whose
    copy of the nodes' disk mounts would outlive their unmount (a disk that
    lost power would come back as the same shut-down filesystem)."""
    return ["nsenter", f"--net=/run/netns/{host.ns}", "--"]


def _children(pid: int) -> list[int]:
    """The PIDs of ``pid``'s children now (every thread's), [] if it is gone."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    return sorted(set(out))


def _wait_gone(pids: list[int], timeout: float) -> None:
    """Until each of ``pids`` has exited (gone, or a zombie: its files
    closed), at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                        break
            except OSError:
                break
            time.sleep(0.02)


def proc_start(pid: int) -> int:
    """When ``pid`` started (clock ticks since boot; 0 if it is gone): with
    the PID, it names one process for good."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[19])


def _holds(store: Path, group: int) -> bool:
    """Whether the log store in ``store`` holds data group ``group``'s log."""
    opened = LogStore(store, writer=False)
    try:
        return opened.holds(group)
    finally:
        opened.close()


@dataclass
class Service:
    """A node daemon or queue server on its own host."""

    name: str  # n1.., q1..
    kind: str  # "node" or "queue"
    ident: int  # node id, or queue server number
    host: Host
    argv: list[str]
    log: Path
    data_dir: Path | None = None
    disk: Disk | None = None
    clock_file: Path | None = None
    boot_file: Path | None = None
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0
    https: bool = False  # a queue server's HTTP port speaks TLS

    @property
    def address(self) -> str:
        return f"{self.host.ip}:{NODE_PORT if self.kind == 'node' else QUEUE_PORT}"

    @property
    def http(self) -> str:
        return f"{'https' if self.https else 'http'}://{self.host.ip}:{HTTP_PORT}"

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen is not None else 0

    def running(self) -> bool:
        """Started here and not exited (a stopped process still runs)."""
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> bool:
        """Send ``sig`` if the process runs (never to a reaped PID)."""
        if not self.running():
            return False
        assert self.popen is not None
        os.kill(self.popen.pid, sig)
        return True

    def tail(self, lines: int = 12) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError as e:
            return f"(no log: {e})"


@dataclass
class NemesisCluster:
    dir: Path
    subnet: str
    tag: str
    nodes: int = 3
    queues: int = 2
    disk_bytes: int = 256 * MIB
    min_free_bytes: int = 32 * MIB
    snapshot_entries: int = 2000
    snapshot_mib_per_s: int = 64
    # The product's default (0): one data group per voter, run in worker
    # processes (one per core), topics' partitions placed in them. 1: every
    # ping in group 0, in the node's main process (the shape before groups).
    data_groups: int = 0
    # TLS on every port and issued tokens, as the product runs (False: the
    # plaintext, unauthenticated shape of runs before; ``--insecure``).
    tls: bool = True
    client_tls: ClientTLS = field(default_factory=lambda: ClientTLS(insecure=True))
    admin_token: str = ""  # the first admin identity's (``issue_identities``)
    net: Net | None = None
    services: dict[str, Service] = field(default_factory=dict)
    disks: list[Disk] = field(default_factory=list)
    images: ImageStore | None = None

    # ------------------------------------------------------------ building

    def create(self) -> None:
        """The bridge, one host per process, data disks, clock files."""
        # Another route to the subnet (another run, a test tier, a lab bridge
        # left up) would take our traffic; an interface that is down has none.
        routes = subprocess.run(
            ["ip", "route", "show", f"{self.subnet}.0/24"],
            capture_output=True, text=True, timeout=30,
        ).stdout.strip()  # fmt: skip
        if routes:
            raise RuntimeError(
                f"{self.subnet}.0/24 is routed already ({routes}): another run or a test "
                "tier uses it; give another subnet (--subnet)"
            )
        (self.dir / "net").mkdir(parents=True, exist_ok=True)
        self.net = Net(self.dir / "net", self.tag, subnet=self.subnet)
        self.net.create()
        secret = str(self.net.secret)
        certs = _HostCerts(self.dir) if self.tls else None
        if certs is not None:
            self.client_tls = certs.client()
        queues = [self.net.host(QUEUE_HOST0 + k) for k in range(1, self.queues + 1)]
        qlist = ",".join(f"{h.ip}:{QUEUE_PORT}" for h in queues)
        hosts = [self.net.host(NODE_HOST0 + k) for k in range(1, self.nodes + 1)]
        peers = ",".join(f"{k}={h.ip}:{NODE_PORT}" for k, h in enumerate(hosts, 1))
        py = sys.executable
        for k, h in enumerate(queues, 1):
            self._add(
                Service(f"q{k}", "queue", k, h, [
                    py, "-m", "queue_server.main", "run",
                    "--listen", f"{h.ip}:{QUEUE_PORT}",
                    "--http-listen", f"{h.ip}:{HTTP_PORT}",
                    "--metrics-port", "9500",
                    "--discovery-port", "0",
                    "--secret-file", secret,
                    # TLS with a certificate for the host's address, and
                    # issued tokens (the default client_auth); plaintext and
                    # no check at all without TLS, as runs before.
                    *(certs.args("queue", f"q{k}", h.ip) if certs is not None
                      else ["--insecure", "--client-auth", "none"]),
                ], self.dir / "logs" / f"q{k}.log")
            )  # fmt: skip
        self.images = ImageStore(self.dir / "disks", self.nodes * self.disk_bytes + 16 * MIB)
        self.images.create()
        for k, h in enumerate(hosts, 1):
            data = self.dir / "data" / f"n{k}"
            disk = Disk(self.images.root / f"n{k}.ext4", data, self.disk_bytes)
            self.disks.append(disk)
            disk.create()
            clock = self.dir / "clock" / f"n{k}"
            clock.parent.mkdir(parents=True, exist_ok=True)
            clock.write_text("0\n")
            boot = self.dir / "boot" / f"n{k}"  # the node's host boots again after a power cut
            boot.parent.mkdir(parents=True, exist_ok=True)
            boot.write_text(f"{uuid.uuid4()}\n")
            self._add(
                Service(f"n{k}", "node", k, h, [
                    py, "-m", "tests.nemesis.clockshim", str(clock),
                    "node_daemon.process.main", "run",
                    "--node-id", str(k),
                    "--data-dir", str(data),
                    "--listen", f"{h.ip}:{NODE_PORT}",
                    "--peers", peers,
                    "--metrics-port", "9400",
                    "--queue-servers", qlist,
                    "--discovery-port", "0",
                    "--secret-file", secret,
                    *(certs.args("node", str(k), h.ip) if certs is not None else ["--insecure"]),
                    "--min-free-bytes", str(self.min_free_bytes),
                    "--snapshot-entries", str(self.snapshot_entries),
                    "--snapshot-mib-per-s", str(self.snapshot_mib_per_s),
                    "--boot-id-file", str(boot),
                    "--data-groups", str(self.data_groups),
                    # Every node a voter, as an operator of 5 sets it (the
                    # default keeps 3, the rest standby learners).
                    *(["--voters", str(self.nodes)] if self.nodes != 3 else []),
                ], self.dir / "logs" / f"n{k}.log", data, disk, clock, boot)
            )  # fmt: skip

    def _add(self, svc: Service) -> None:
        svc.https = self.tls
        svc.log.parent.mkdir(parents=True, exist_ok=True)
        self.services[svc.name] = svc

    def destroy(self) -> None:
        """Everything made here: processes (by PID), mounts, namespaces, bridge."""
        for svc in self.services.values():
            if svc.signal(signal.SIGKILL):
                assert svc.popen is not None
                try:
                    svc.popen.wait(20)
                except subprocess.TimeoutExpired:
                    log.error("did not die", extra={"service": svc.name, "pid": svc.pid})
        for d in self.disks:
            d.destroy()
        self.disks.clear()
        if self.images is not None:
            self.images.destroy()
        if self.net is not None:
            self.net.destroy()  # its hosts hold no processes of their own

    # ----------------------------------------------------------- processes

    @property
    def node_services(self) -> list[Service]:
        return [s for s in self.services.values() if s.kind == "node"]

    @property
    def queue_services(self) -> list[Service]:
        return [s for s in self.services.values() if s.kind == "queue"]

    def node(self, ident: int) -> Service:
        return self.services[f"n{ident}"]

    def start(self, svc: Service) -> None:
        """Start ``svc`` in its host's namespace (``nsenter`` execs the
        program, so the PID is the daemon's)."""
        if svc.running():
            return
        with open(svc.log, "ab") as out:
            svc.popen = subprocess.Popen(
                [*in_netns(svc.host), *svc.argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO,
                start_new_session=True,
            )
        svc.starts += 1
        log.info("started", extra={"service": svc.name, "pid": svc.pid, "starts": svc.starts})

    def kill(self, svc: Service) -> None:
        """SIGKILL and reap (a stopped process dies too); a node's worker
        processes die with it (``PR_SET_PDEATHSIG``): waited for, so that
        nothing of the node touches its disk once this returns."""
        workers = list(self.workers(svc))
        if svc.signal(signal.SIGKILL):
            assert svc.popen is not None
            svc.popen.wait(20)
        _wait_gone(workers, 20.0)

    def power_cut(self, svc: Service) -> int:
        """The node's machine loses power: the process stops at once, its
        disk loses every write not on the device yet, the process dies and
        the disk is mounted again as at boot (the process stays down).
        Returns the bytes in use the disk lost (unsynced data and metadata)."""
        assert svc.disk is not None
        workers = {pid: proc_start(pid) for pid in self.workers(svc)}
        svc.signal(signal.SIGSTOP)  # the instant: the process does nothing more,
        for pid, started in workers.items():  # nor do its workers
            self.signal_worker(svc, pid, started, signal.SIGSTOP)
        before = svc.disk.used()
        svc.disk.cut_power()
        self.kill(svc)
        svc.disk.power_on()
        assert svc.boot_file is not None
        svc.boot_file.write_text(f"{uuid.uuid4()}\n")  # the host boots again
        return max(0, before - svc.disk.used())

    def group_dirs(self, svc: Service) -> dict[int, Path]:
        """The Raft groups whose copy lies on the node's disk: group 0 in
        the data directory, each data group in ``groups/<g>/``
        (``node_daemon.replica.replica.group_data_dir``)."""
        assert svc.data_dir is not None
        out = {0: svc.data_dir}
        root = svc.data_dir / "groups"
        with contextlib.suppress(OSError):
            for d in root.iterdir():
                if d.name.isdigit() and d.is_dir():
                    out[int(d.name)] = d
        return dict(sorted(out.items()))

    def workers(self, svc: Service) -> dict[int, tuple[int, ...]]:
        """The node's worker processes now: PID -> the data groups it runs,
        told by the group directories' files it holds open (a worker locks
        and opens its groups' environments for its whole life). Only the
        node's own children count, and only while the node runs."""
        if not svc.running() or svc.data_dir is None:
            return {}
        groups_root = str(svc.data_dir / "groups") + os.sep
        out: dict[int, tuple[int, ...]] = {}
        for pid in _children(svc.pid):
            held: set[int] = set()
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    with contextlib.suppress(OSError):
                        target = os.readlink(f"/proc/{pid}/fd/{fd}")
                        if target.startswith(groups_root):
                            head = target[len(groups_root) :].split(os.sep, 1)[0]
                            if head.isdigit():
                                held.add(int(head))
            if held:
                out[pid] = tuple(sorted(held))
        return out

    def signal_worker(self, svc: Service, pid: int, started: int, sig: int) -> bool:
        """Send ``sig`` to worker ``pid`` of ``svc`` if it is still that
        process: a child of the running node that started at ``started``
        (clock ticks since boot, ``proc_start``), so a PID reused since is
        never signalled. Whether it was sent."""
        if not svc.running() or pid not in _children(svc.pid) or proc_start(pid) != started:
            return False
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True

    def corrupt_log(self, svc: Service, how: str, at: float, group: int = 0) -> dict[str, Any]:
        """Damage a (killed) node's Raft log of ``group`` as a disk may:
        ``entry`` flips a byte of the entry at fraction ``at`` of the log
        (its record stays where it is: rot inside a record); ``truncate``
        cuts the data file to ``at`` of its length (at least its meta
        pages). What was done."""
        assert svc.data_dir is not None and not svc.running()
        raft = self.group_dirs(svc).get(group, svc.data_dir) / "raft"
        log_name = b"log"
        if group:  # a data group's log is in its process's log store (all of it, truncated)
            raft = next((p for p in stores_in(svc.data_dir / STORES_DIR) if _holds(p, group)), raft)
            log_name = db_names(group)[0]
        if how == "truncate":
            data = raft / "data.mdb"
            size = data.stat().st_size
            keep = max(2 * 4096, int(size * at) // 4096 * 4096)
            os.truncate(data, keep)
            return {"how": how, "group": group, "bytes": size, "kept": keep}
        try:
            env = lmdb.open(str(raft), max_dbs=MAX_DBS, map_size=1 << 40, sync=True)
        except lmdb.Error as e:
            return {"how": how, "group": group, "error": str(e)}
        try:
            log_db = env.open_db(log_name)
            with env.begin(write=True, db=log_db) as txn:
                keys = [bytes(k) for k in txn.cursor().iternext(values=False)]
                if not keys:
                    return {"how": how, "group": group, "entries": 0}
                key = keys[min(len(keys) - 1, int(len(keys) * at))]
                raw = bytearray(txn.get(key) or b"")
                pos = int(at * 1_000_003) % len(raw)
                raw[pos] ^= 0xFF
                txn.put(key, bytes(raw))
        except lmdb.Error as e:  # a full disk (a disk fault at the same time): nothing done
            return {"how": how, "group": group, "error": str(e)}
        finally:
            env.close()
        return {"how": how, "group": group, "index": int.from_bytes(key, "big"), "byte": pos,
                "entries": len(keys)}  # fmt: skip

    def wipe(self, svc: Service) -> None:
        """Remove everything in a (killed) node's data directory."""
        assert svc.data_dir is not None and not svc.running()
        for child in svc.data_dir.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()

    def start_all(self) -> None:
        for svc in self.services.values():
            self.start(svc)

    # -------------------------------------------------------------- status

    def views(self, timeout: float = 0.8) -> dict[int, dict[str, Any]]:
        """Each answering node's own view (``ask_node``), asked at once."""
        nodes = self.node_services
        with ThreadPoolExecutor(len(nodes)) as pool:
            answers = list(pool.map(lambda s: ask_node(s.address, timeout, self.client_tls), nodes))
        return {s.ident: v for s, v in zip(nodes, answers, strict=True) if v is not None}

    def leader(self, views: dict[int, dict[str, Any]] | None = None) -> int:
        """The id of the leader of the highest term among the answers (0: none)."""
        v = self.views() if views is None else views
        leaders = [x for x in v.values() if x["role"] == "leader"]
        return max(leaders, key=lambda x: x["term"])["id"] if leaders else 0

    def queue_up(self, svc: Service, timeout: float = 1.0) -> bool:
        """The queue server answers and knows group 0's leader (before the
        first identity is made, with tokens on: it answers, and refuses the
        caller who has none)."""
        try:
            with self.client_tls.with_token(self.admin_token or None).channel(svc.address) as ch:
                st = client_pb2_grpc.RoadlogStub(ch).Status(
                    client_pb2.StatusRequest(), timeout=timeout
                )
        except grpc.RpcError as e:
            unauthenticated = e.code() == grpc.StatusCode.UNAUTHENTICATED
            return self.tls and not self.admin_token and unauthenticated
        return bool(st.leader)

    @staticmethod
    def group_leaders(views: dict[int, dict[str, Any]]) -> dict[int, int]:
        """Each data group -> the node that leads it in the highest term any
        answer names (0: none known), from the nodes' views of their groups."""
        best: dict[int, tuple[int, int]] = {}
        for node, view in views.items():
            for g in view.get("groups", []):
                if g["id"] == 0:
                    continue
                term = best.get(g["id"], (-1, 0))[0]
                if g["role"] == "leader" and g["term"] > term:
                    best[g["id"]] = (g["term"], node)
                else:
                    best.setdefault(g["id"], (-1, 0))
        return {g: lead for g, (_, lead) in sorted(best.items())}

    def healthy(self) -> bool:
        """Every node answers, ready, under one leader, and sees every data
        group under the same leader (one its answer names); every queue
        server answers and knows group 0's leader."""
        v = self.views()
        if len(v) != len(self.node_services) or not all(x["ready"] for x in v.values()):
            return False
        if len({x["leader"] for x in v.values()}) != 1 or not self.leader(v):
            return False
        leads = self.group_leaders(v)
        if not all(leads.values()):
            return False
        for view in v.values():
            seen = {g["id"]: g["leader"] for g in view.get("groups", []) if g["id"]}
            if seen != leads:
                return False
        return all(self.queue_up(q) for q in self.queue_services)

    def groups(self) -> list[int]:
        """Every Raft group some node's disk holds: 0 and the data groups."""
        return sorted({g for s in self.node_services for g in self.group_dirs(s)})

    def digests(self, group: int = 0) -> dict[int, tuple[int, str] | None]:
        """node id -> (applied index, state sha256 hex) of ``group``'s
        replica, None if silent. Group 0: the node's ``StateDigest``. A data
        group (its replica in a worker process): read here, as the node's
        main process reads it (``StateReplicaView``: read-only, with the
        environment's lock file, the index and digest of one transaction)."""

        def one(svc: Service) -> tuple[int, str] | None:
            if group == 0:
                try:
                    with self.client_tls.channel(svc.address) as ch:
                        r = admin_pb2_grpc.AdminStub(ch).StateDigest(
                            admin_pb2.StateDigestRequest(), timeout=10
                        )
                except grpc.RpcError:
                    return None
                return int(r.applied_index), r.sha256.hex()
            d = self.group_dirs(svc).get(group)
            if d is None or not svc.running():
                return None
            try:
                sm = StateReplicaView(d / "state", group).current()
                try:
                    index, digest = sm.indexed_digest()
                finally:
                    sm.close()
            except (RoadlogError, lmdb.Error, OSError) as e:
                log.info("no digest", extra={"node": svc.name, "group": group, "why": str(e)})
                return None
            return index, digest.hex()

        nodes = self.node_services
        with ThreadPoolExecutor(len(nodes)) as pool:
            return dict(zip((s.ident for s in nodes), pool.map(one, nodes), strict=True))

    # ---------------------------------------------------------- membership

    def _own_status(self, address: str) -> client_pb2.NodeStatus | None:
        """What the node at ``address`` says of itself (None: no answer)."""
        try:
            with self.client_tls.channel(address) as ch:
                st = admin_pb2_grpc.AdminStub(ch).Status(client_pb2.StatusRequest(), timeout=2)
        except grpc.RpcError:
            return None
        return st.nodes[0]

    def catching_up(self, svc: Service) -> bool | None:
        """Whether the node says it is catching up after losing its copy,
        of group 0 or of any data group (None: it does not answer, say while
        it starts, or has not heard from every group it runs yet: a worker
        process tells its groups' figures once it has opened their logs,
        and found any damage, so until then the node's answer for them is
        empty, not "holds its copy")."""
        me = self._own_status(svc.address)
        if me is None:
            return None
        told = {g.id for g in me.groups if g.role}
        if not set(self.groups()) <= told | {0}:
            return None
        return bool(me.catching_up) or any(g.catching_up for g in me.groups)

    def data_groups_settled(self, voters: set[int], catching_up: set[int] | None = None) -> bool:
        """Every data group's leader (as the nodes tell it) has ``voters``
        as its voters, no learner, its configuration committed, and no node
        catching up in it but those in ``catching_up`` (node ids): a data
        group follows group 0's membership a while after group 0 changed it.
        True in a cluster of one group."""
        allowed = catching_up or set()
        views = self.views()
        for g, lead in self.group_leaders(views).items():
            mine = [x for x in views.get(lead, {}).get("groups", []) if x["id"] == g]
            if not lead or not mine:
                return False
            (x,) = mine
            if set(x["voters"]) != voters or x["learners"] or x["conf_index"] > x["commit_index"]:
                return False
            if any(
                y["catching_up"]
                for n, v in views.items()
                if n not in allowed
                for y in v.get("groups", [])
            ):
                return False
        return True

    def voters(self, leader: int, committed: bool = False) -> tuple[set[int], set[int]] | None:
        """(voters, learners) of the leader's configuration (None: no answer,
        or with ``committed``, a configuration not committed yet: a leader
        uses its latest one at once, and a newer leader may lack it)."""
        try:
            address = self.node(leader).address
        except KeyError:
            return None
        me = self._own_status(address)
        if me is None:
            return None
        if committed and me.conf_index > me.commit_index:
            return None
        return set(me.voters), set(me.learners)

    def admin(self, method: str, request: Any, timeout: float = 3.0) -> bool:
        """A changing admin call, to the leader (tried on each node in turn:
        a follower refuses and names the leader); whether one took it."""
        assert self.net is not None
        token = cluster_token(self.net.secret.read_bytes().strip(), "roadlog")
        for svc in self.node_services:
            if not svc.running():
                continue
            try:
                with self.client_tls.channel(svc.address) as ch:
                    call = getattr(admin_pb2_grpc.AdminStub(ch), method)
                    call(request, metadata=token_metadata(token), timeout=timeout)
                return True
            except grpc.RpcError as e:
                why = {"method": method, "node": svc.name, "why": e.details()}
                log.info("admin call refused", extra=why)
        return False

    def issue_identities(
        self, wanted: dict[str, list[str]], timeout: float = 60.0
    ) -> dict[str, str]:
        """Client identities for the workload, as an operator makes them:
        the first admin through a node's Admin service (the cluster's
        credentials: a client certificate and the cluster token), then each
        of ``wanted`` (name -> scopes) through a queue server with that
        admin's token. name -> token ({} without TLS: no tokens are checked)."""
        if not self.tls:
            return {}
        assert self.net is not None
        deadline = time.monotonic() + timeout
        admin = new_token()
        request = clients_pb2.CreateClientRequest(
            name="nemesis-admin", scopes=[ADMIN], token_hash=token_hash(admin)
        )
        while not self.admin("CreateClient", request, timeout=5.0):
            if time.monotonic() > deadline:
                raise RuntimeError("no node made the nemesis's admin identity in time")
            time.sleep(0.5)
        self.admin_token = admin
        tokens: dict[str, str] = {}
        servers = [q.address for q in self.queue_services]
        with Connection(servers, timeout=10, client="setup", tls=self.client_tls,
                        token=admin) as conn:  # fmt: skip
            for name, scopes in wanted.items():
                while name not in tokens:
                    try:
                        tokens[name] = Admin(conn).create_client(name, scopes).token
                    except RoadlogError as e:
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"identity {name}: {e}") from None
                        time.sleep(0.5)
        return tokens

    def remove_node(self, ident: int) -> bool:
        return self.admin("RemoveNode", admin_pb2.RemoveNodeRequest(node_id=ident))

    def add_node(self, ident: int, as_voter: bool = False) -> bool:
        req = admin_pb2.AddNodeRequest(
            node_id=ident, address=self.node(ident).address, as_voter=as_voter
        )
        return self.admin("AddNode", req)

    # ------------------------------------------------------------- network

    def nft(self, host: Host, script: str) -> None:
        subprocess.run(
            [*in_netns(host), "nft", "-f", "-"],
            input=script.encode(),
            check=True,
            capture_output=True,
            timeout=30,
        )

    def nft_drop_table(self, host: Host, table: str) -> None:
        subprocess.run(
            [*in_netns(host), "nft", "delete", "table", "inet", table],
            capture_output=True,
            timeout=30,
        )

    def block(self, host: Host, deaf_to: set[str], mute_to: set[str]) -> None:
        """On ``host``, drop what arrives from ``deaf_to`` and what leaves
        for ``mute_to`` (addresses). Replaces the host's partition rules."""
        self.nft_drop_table(host, "nemesis_part")
        lines = ["table inet nemesis_part {"]
        if deaf_to:
            lines += [
                "  chain in { type filter hook input priority 0;",
                f"    ip saddr {{ {', '.join(sorted(deaf_to))} }} drop",
                "  }",
            ]
        if mute_to:
            lines += [
                "  chain out { type filter hook output priority 0;",
                f"    ip daddr {{ {', '.join(sorted(mute_to))} }} drop",
                "  }",
            ]
        lines.append("}")
        self.nft(host, "\n".join(lines) + "\n")

    def heal_partitions(self) -> None:
        for svc in self.services.values():
            self.nft_drop_table(svc.host, "nemesis_part")

    def lossy(self, host: Host, percent: int) -> None:
        """Drop ``percent`` % of the TCP segments arriving at ``host``."""
        self.nft_drop_table(host, "nemesis_loss")
        self.nft(
            host,
            "table inet nemesis_loss {\n"
            "  chain in { type filter hook input priority 0;\n"
            f"    meta l4proto tcp numgen random mod 100 < {percent} drop\n"
            "  }\n}\n",
        )

    def heal_loss(self, host: Host) -> None:
        self.nft_drop_table(host, "nemesis_loss")

    def slow(self, host: Host, kbit: int, queue_ms: int) -> None:
        """Let ``host`` send only ``kbit`` kbit/s, queueing up to ``queue_ms``
        of it (a token bucket: what delays this kernel offers without netem)."""
        subprocess.run(
            [*in_netns(host), "tc", "qdisc", "replace", "dev", "eth0", "root",
             "tbf", "rate", f"{kbit}kbit", "burst", "16kbit", "latency", f"{queue_ms}ms"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip

    def heal_slow(self, host: Host) -> None:
        subprocess.run(
            [*in_netns(host), "tc", "qdisc", "del", "dev", "eth0", "root"],
            capture_output=True,
            timeout=30,
        )

    # ------------------------------------------------------- disk and clock

    def fill_disk(self, svc: Service, leave: int) -> int:
        """Write ballast into the node's filesystem until at most ``leave``
        bytes are free (0: until ENOSPC); returns the bytes written."""
        assert svc.data_dir is not None
        path = svc.data_dir / BALLAST
        chunk = b"\0" * MIB
        written = 0
        with open(path, "ab") as f:
            for _ in range(self.disk_bytes // MIB + 2):  # bounded: the disk's size
                st = os.statvfs(svc.data_dir)
                room = st.f_bavail * st.f_frsize - leave
                if leave and room <= 0:
                    break
                try:
                    n = f.write(chunk if not leave else chunk[: min(MIB, room)])
                    f.flush()
                    written += n
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
        return written

    def free_disk(self, svc: Service) -> None:
        """Remove the ballast, durably: an unlink still in ext4's journal
        when a power cut came was undone by the journal's replay, and the
        ballast stayed for the rest of the run (seed 50: a node's disk full
        from 128 s on)."""
        assert svc.data_dir is not None
        (svc.data_dir / BALLAST).unlink(missing_ok=True)
        fd = os.open(svc.data_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def set_clock(self, svc: Service, offset_s: float) -> None:
        """Step the node's wall clock to true time + ``offset_s``."""
        assert svc.clock_file is not None
        tmp = svc.clock_file.with_suffix(".tmp")
        tmp.write_text(f"{offset_s}\n")
        os.replace(tmp, svc.clock_file)


class _HostCerts:
    """The run's certificates: a CA in DIR/ca, a certs dir per process with
    a certificate for its host's address (DIR/certs/<name>), and the
    harness's client certificate (DIR/certs/harness: the nodes' ports are
    mutual TLS)."""

    def __init__(self, directory: Path) -> None:
        from roadlog.tools import ca as calib  # cryptography: only where certificates are made

        self.lib = calib
        self.root = directory / "certs"
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.ca_dir = directory / "ca"
        self.ca_dir.mkdir(mode=0o700, exist_ok=True)
        self.ca_key = self.ca_dir / "ca.key"
        calib.create_ca(self.ca_dir, self.ca_key)

    def _dir(self, name: str) -> Path:
        d = self.root / name
        d.mkdir(mode=0o700, exist_ok=True)
        self.lib.copy_ca(self.ca_dir, d)
        return d

    def args(self, kind: str, name: str, ip: str) -> list[str]:
        d = self._dir(("n" if kind == "node" else "") + name)
        self.lib.create_cert(d, self.ca_key, Identity(kind, name), [ip])
        return ["--certs-dir", str(d)]

    def client(self) -> ClientTLS:
        d = self._dir("harness")
        self.lib.create_cert(d, self.ca_key, Identity("client", "admin"))
        crt, key = cert_files("client", "admin")
        return ClientTLS(d / CA_CERT, d / crt, d / key)


@contextmanager
def running_cluster(cluster: NemesisCluster) -> Iterator[NemesisCluster]:
    """Create and start; always destroy."""
    try:
        cluster.create()
        cluster.start_all()
        yield cluster
    finally:
        cluster.destroy()
