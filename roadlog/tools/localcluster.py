"""A cluster of real processes on 127.0.0.1, described by DIR/cluster.json.

``up`` starts N node daemons and M queue servers (each in its own session,
logging to DIR/logs), waits for a leader and writes cluster.json; ``kill``
SIGKILLs one node, ``start`` starts it again with the same arguments,
``restart`` stops a node or queue server and starts it again (reading its
certs dir afresh), ``down`` stops everything (SIGTERM, then SIGKILL after a
grace period).
Only processes recorded in cluster.json are ever signalled.

TLS by default: ``create`` makes a CA in DIR/ca (or signs with one it is
given, as the tests do with one CA per session) and a certs dir per
process (DIR/certs/n1, .../q1, .../client for the tools: ``tls()``); the
CA's key stays in DIR/ca. ``insecure`` runs every process with --insecure.
With TLS every HTTP port is HTTPS too (``metrics_url``, ``ssl_context``).

Client identities (issue 19): the first time the cluster is ready
(``wait_ready``), an identity named ``admin`` with the scope admin is made
through a node's Admin service (mutual TLS with the tools' certificate, and
the cluster token), and its token written to DIR/admin.token (0600);
``tls()`` carries it, so the tools, the tests and ``--cluster DIR`` call as
that admin. A second identity, ``spark`` (DIR/spark.token), is the heat-map
jobs' own: they commit heat maps, which needs the scope admin, and
revoking it stops them alone.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from roadlog.client_tls import ClientTLS
from roadlog.placement import DATA_GROUPS_RECORD, METADATA_GROUP
from roadlog.runtime.auth import cluster_token, token_metadata
from roadlog.runtime.config import read_secret
from roadlog.runtime.processes import alive, free_port, wait_dead
from roadlog.runtime.tls import CA_CERT, Identity
from roadlog.scopes import ADMIN, new_token, token_hash
from roadlog.status import DOWN, ask_node
from roadlog.v1 import admin_pb2_grpc, client_pb2, client_pb2_grpc, clients_pb2

ADMIN_TOKEN_FILE = "admin.token"
SPARK_TOKEN_FILE = "spark.token"


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: str
    pid: int = 0

    @property
    def certs_dir(self) -> str:
        """This process's certs dir ("" when it runs --insecure)."""
        return self.argv[self.argv.index("--certs-dir") + 1] if "--certs-dir" in self.argv else ""


@dataclass
class NodeInfo(Proc):
    id: int = 0
    address: str = ""
    metrics_port: int = 0
    data_dir: str = ""


@dataclass
class QueueInfo(Proc):
    grpc: str = ""
    http: str = ""
    metrics_port: int = 0


@dataclass
class LocalCluster:
    dir: Path
    nodes: list[NodeInfo] = field(default_factory=list)
    queue_servers: list[QueueInfo] = field(default_factory=list)
    secret_file: str = ""
    certs_dir: str = ""  # the tools' certs dir (ca.crt, client.admin.*); "" with insecure
    token_file: str = ""  # the admin identity's token (DIR/admin.token); "" until made
    cluster_name: str = "roadlog"  # every process's --cluster-name (a federation member's name)

    # ---------------------------------------------------------------- files

    @property
    def file(self) -> Path:
        return self.dir / "cluster.json"

    def save(self) -> None:
        doc = {
            "nodes": [asdict(n) for n in self.nodes],
            "queue_servers": [asdict(q) for q in self.queue_servers],
            "secret_file": self.secret_file,
            "certs_dir": self.certs_dir,
            "token_file": self.token_file,
            "cluster_name": self.cluster_name,
        }
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        os.replace(tmp, self.file)

    @classmethod
    def load(cls, directory: Path) -> LocalCluster:
        f = directory / "cluster.json"
        try:
            doc = json.loads(f.read_text())
        except OSError:
            raise FileNotFoundError(f"no cluster at {directory} (no cluster.json)") from None
        return cls(
            directory,
            [NodeInfo(**n) for n in doc["nodes"]],
            [QueueInfo(**q) for q in doc["queue_servers"]],
            doc.get("secret_file", ""),
            doc.get("certs_dir", ""),
            doc.get("token_file", ""),
            doc.get("cluster_name", "roadlog"),
        )

    @property
    def admin_token(self) -> str | None:
        """The admin identity's token (None before ``wait_ready`` made it)."""
        if not self.token_file:
            return None
        try:
            return Path(self.token_file).read_text().strip() or None
        except OSError:
            return None

    @property
    def spark_token(self) -> str | None:
        """The heat-map jobs' identity's token (None: none made)."""
        try:
            return (self.dir / SPARK_TOKEN_FILE).read_text().strip() or None
        except OSError:
            return None

    def tls(self) -> ClientTLS:
        """How tools dial this cluster: its CA, the admin client's
        certificate and the admin identity's token."""
        if not self.certs_dir:
            return ClientTLS(insecure=True, token=self.admin_token)
        d = Path(self.certs_dir)
        return ClientTLS(
            d / CA_CERT, d / "client.admin.crt", d / "client.admin.key", token=self.admin_token
        )

    @property
    def http_scheme(self) -> str:
        return self.tls().scheme

    def ssl_context(self) -> ssl.SSLContext | None:
        """For the cluster's HTTPS ports (the HTTP API, the dashboard,
        /metrics and health): trusts its CA (None: plaintext, insecure)."""
        return self.tls().ssl_context()

    def metrics_url(self, p: NodeInfo | QueueInfo, path: str = "/metrics") -> str:
        """``path`` on a process's metrics port (/metrics, /healthz, /readyz)."""
        return f"{self.http_scheme}://127.0.0.1:{p.metrics_port}{path}"

    @property
    def servers(self) -> list[str]:
        return [q.grpc for q in self.queue_servers]

    # ------------------------------------------------------------ creating

    @classmethod
    def create(
        cls,
        directory: Path,
        nodes: int = 3,
        queue_servers: int = 1,
        extra_node_args: list[str] | None = None,
        extra_queue_args: list[str] | None = None,
        insecure: bool = False,
        ca: tuple[Path, Path] | None = None,
        data_groups: int | None = 1,
        cluster_name: str = "roadlog",
    ) -> LocalCluster:
        """``ca``: (a dir with ca.crt, the CA's key) to sign with; None: a
        new CA in DIR/ca. ``insecure``: no TLS (loudly). ``data_groups``:
        the nodes' ``--data-groups`` unless ``extra_node_args`` say it; 1 (the
        default here, issue 41): every ping in group 0; None (or
        ``--data-groups 0`` in ``extra_node_args``): the product's, as
        ``roadlog cluster up`` runs it: one data group per voter, in worker
        processes. Workers forked by the node's zygote start a default
        cluster in about half the time spawned ones did, but the files that
        use this default still ran 30-50% longer on the product's (at load
        19-30), over the 3 minutes the suite may grow; and test_bounds'
        paged listing of big topics saw group 0 elect there (spawned
        workers too)."""
        extra_node_args = list(extra_node_args or [])
        if data_groups is not None and "--data-groups" not in extra_node_args:
            extra_node_args += ["--data-groups", str(data_groups)]
        directory = directory.resolve()
        if (directory / "cluster.json").exists():
            raise FileExistsError(f"{directory} already holds a cluster; `cluster down` first")
        # This user's alone (issue 19, finding 18): a directory made here is
        # 0700, so are the logs; the daemons make their data 0700/0600 (umask 077).
        # (A directory that exists is the caller's: its mode stays.)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        (directory / "logs").mkdir(mode=0o700, exist_ok=True)
        (directory / "logs").chmod(0o700)
        secret = directory / "secret"
        # 0600 from the start (never briefly open to others), 64 hex characters:
        # what check_secret (MIN_SECRET_BYTES) and the docs ask for.
        fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(secrets.token_hex(32) + "\n")
        lc = cls(directory, secret_file=str(secret), cluster_name=cluster_name)
        if cluster_name != "roadlog":  # both daemons: the cluster token is derived from it
            extra_node_args = [*extra_node_args, "--cluster-name", cluster_name]
            extra_queue_args = [*(extra_queue_args or []), "--cluster-name", cluster_name]
        certs = _Certs(directory, ca) if not insecure else None
        if certs is not None:
            lc.certs_dir = str(certs.client())
        py = sys.executable
        for _ in range(queue_servers):
            port, mport, hport = free_port(), free_port(), free_port()
            i = len(lc.queue_servers) + 1
            qtls = certs.args("queue", f"q{i}") if certs is not None else ["--insecure"]
            lc.queue_servers.append(
                QueueInfo(
                    name=f"q{i}",
                    argv=[
                        py,
                        "-m",
                        "queue_server.main",
                        "run",
                        "--listen",
                        f"127.0.0.1:{port}",
                        "--metrics-port",
                        str(mport),
                        "--http-listen",
                        f"127.0.0.1:{hport}",
                        "--discovery-port",
                        "0",
                        "--work-frames-port",
                        str(free_port()),
                        "--publish-link-port",
                        str(free_port()),
                        "--secret-file",
                        str(secret),
                        *qtls,
                        *(extra_queue_args or []),
                    ],
                    log=str(directory / "logs" / f"q{i}.log"),
                    grpc=f"127.0.0.1:{port}",
                    http=f"{'http' if certs is None else 'https'}://127.0.0.1:{hport}",
                    metrics_port=mport,
                )
            )
        ports = {i: free_port() for i in range(1, nodes + 1)}
        peers = ",".join(f"{i}=127.0.0.1:{p}" for i, p in ports.items())
        qlist = ",".join(lc.servers)
        for i, port in ports.items():
            mport = free_port()
            data = directory / f"node{i}"
            ntls = certs.args("node", str(i)) if certs is not None else ["--insecure"]
            lc.nodes.append(
                NodeInfo(
                    name=f"n{i}",
                    argv=[
                        py,
                        "-m",
                        "node_daemon.process.main",
                        "run",
                        "--node-id",
                        str(i),
                        "--data-dir",
                        str(data),
                        "--listen",
                        f"127.0.0.1:{port}",
                        "--peers",
                        peers,
                        "--metrics-port",
                        str(mport),
                        "--peer-frames-port",
                        str(free_port()),
                        "--worker-ports",
                        "0",  # worker processes (if any): free ports, nodes share a host
                        "--queue-servers",
                        qlist,
                        "--discovery-port",
                        "0",  # no broadcasts from a loopback cluster
                        "--secret-file",
                        str(secret),
                        *ntls,
                        *(extra_node_args or []),
                    ],
                    log=str(directory / "logs" / f"n{i}.log"),
                    id=i,
                    address=f"127.0.0.1:{port}",
                    metrics_port=mport,
                    data_dir=str(data),
                )
            )
        return lc

    def spawn(self, p: Proc) -> None:
        with open(p.log, "ab") as log:
            proc = subprocess.Popen(
                p.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=str(Path(__file__).resolve().parents[2]),  # the repository
            )
        p.pid = proc.pid

    def start_all(self) -> None:
        for p in [*self.queue_servers, *self.nodes]:
            self.spawn(p)
        self.save()

    # ------------------------------------------------------------- control

    def node(self, ident: str | int) -> NodeInfo:
        for n in self.nodes:
            if str(ident) in (str(n.id), n.name):
                return n
        raise KeyError(f"no node {ident!r} in {self.file}")

    def kill(self, ident: str | int, sig: int = signal.SIGKILL) -> NodeInfo:
        n = self.node(ident)
        self._signal(n, sig)
        return n

    def kill_queue_server(self, index: int = 0, sig: int = signal.SIGKILL) -> QueueInfo:
        q = self.queue_servers[index]
        self._signal(q, sig)
        return q

    def _signal(self, p: NodeInfo | QueueInfo, sig: int) -> None:
        """Send ``sig`` to a process started here, wait until it is gone,
        and record it as down."""
        if p.pid and alive(p.pid):
            os.kill(p.pid, sig)
            wait_dead(p.pid, 10)
        p.pid = 0
        self.save()

    def start(self, ident: str | int) -> NodeInfo:
        n = self.node(ident)
        if n.pid and alive(n.pid):
            return n
        self.spawn(n)
        self.save()
        return n

    def process(self, name: str) -> NodeInfo | QueueInfo:
        """The node or queue server called ``name`` (``n1``, ``q1``)."""
        procs: list[NodeInfo | QueueInfo] = [*self.nodes, *self.queue_servers]
        for p in procs:
            if p.name == name:
                return p
        raise KeyError(f"no process {name!r} in {self.file}")

    def restart(self, name: str, grace: float = 10.0) -> NodeInfo | QueueInfo:
        """Stop the process ``name`` (SIGTERM, SIGKILL after ``grace``
        seconds; only one started here) and start it again with the same
        arguments. It reads its files again, its certs dir included: so a
        rolling restart loads certificates put in place of the old ones
        (SECURITY.md, "Rotating"). Returns once it is started;
        ``wait_ready`` waits until it serves."""
        p = self.process(name)
        if p.pid and alive(p.pid):
            os.kill(p.pid, signal.SIGTERM)
            if not wait_dead(p.pid, grace):
                os.kill(p.pid, signal.SIGKILL)
                wait_dead(p.pid, 5)
        self.spawn(p)
        self.save()
        return p

    def down(self, grace: float = 5.0) -> None:
        procs = [p for p in [*self.nodes, *self.queue_servers] if p.pid and alive(p.pid)]
        for p in procs:
            os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in procs:
            if not wait_dead(p.pid, max(0.0, deadline - time.monotonic())):
                os.kill(p.pid, signal.SIGKILL)
                wait_dead(p.pid, 5)
        for p in [*self.nodes, *self.queue_servers]:
            p.pid = 0
        self.file.unlink(missing_ok=True)

    # -------------------------------------------------------------- status

    def status(self, timeout: float = 2.0) -> dict[str, Any]:
        ids = {n.address: n.id for n in self.nodes}
        return gather_status(self.servers, list(ids), timeout, ids, self.tls())

    def wait_ready(
        self,
        timeout: float = 60.0,
        progress: Callable[[str], None] | None = None,
        admin_token: str | None = None,
    ) -> dict[str, Any]:
        """Wait until group 0 and every data group the nodes run
        (``data_group_ids``) have a leader, every running node is
        ready and every running queue server answers. A process started here
        that died on the way raises at once, with the end of its log. (Data
        groups elect a few seconds after group 0: a topic created before
        they lead would wait on them, a publish fail.) ``admin_token``: the
        first admin identity's token (``bootstrap_admin``)."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        started = {p.name: p for p in [*self.nodes, *self.queue_servers] if p.pid}
        while time.monotonic() < deadline:
            for p in started.values():
                if not alive(p.pid):
                    raise RuntimeError(f"{p.name} (pid {p.pid}) died:\n{_tail(p.log)}")
            last = self.status()
            running = [n for n in self.nodes if n.pid and alive(n.pid)]
            ready = [n for n in last["nodes"] if n.get("ready")]
            queues_up = {q["grpc"] for q in last["queue_servers"] if q.get("up")}
            queues = {q.grpc for q in self.queue_servers if q.pid and alive(q.pid)}
            groups = {METADATA_GROUP, *self.data_group_ids()}
            unled = groups - led_groups(last)
            if not unled and len(ready) >= len(running) and queues <= queues_up:
                if not self.admin_token:
                    self.bootstrap_admin(max(5.0, deadline - time.monotonic()), admin_token)
                return last
            if progress is not None:
                progress(
                    f"leader={last.get('leader') or '-'} ready={len(ready)}/{len(running)} "
                    f"groups led={len(groups) - len(unled)}/{len(groups)}"
                )
            time.sleep(0.2)
        raise TimeoutError(f"cluster not ready after {timeout:.0f} s: {json.dumps(last)}")

    def data_group_ids(self) -> set[int]:
        """The data groups (1..G) every running node runs, G the fewest a
        running node runs: its ``--data-groups``, else what its data
        directory recorded at its first start (DATA_GROUPS_RECORD, written
        before the node is ready). With G = 1 none (group 0 holds the pings):
        the empty set. (A node that decided other groups than the cluster's
        runs its own until the first topic; a group it lacks may not elect.)"""
        counts = []
        for n in self.nodes:
            if not (n.pid and alive(n.pid)):
                continue
            argv = n.argv
            count = int(argv[argv.index("--data-groups") + 1]) if "--data-groups" in argv else 0
            if not count:  # 0: one per voter, decided at the first start
                try:
                    count = int((Path(n.data_dir) / DATA_GROUPS_RECORD).read_text().strip())
                except (OSError, ValueError):
                    count = 1  # not decided yet: such a node is not ready either
            counts.append(count)
        fewest = min(counts, default=1)
        return set(range(1, fewest + 1)) if fewest > 1 else set()

    def bootstrap_admin(self, timeout: float = 30.0, token: str | None = None) -> str:
        """Make the first admin identity through a node's Admin service (the
        leader's: the others say who leads) and keep its token in
        DIR/admin.token (0600); and the Spark jobs' (DIR/spark.token).
        Returns the admin's token. ``token``: the admin's (a federation
        member made with its directory's admin token); None: a new one."""
        deadline = time.monotonic() + timeout
        token = self._make_identity("admin", [ADMIN], ADMIN_TOKEN_FILE, deadline, token)
        self.token_file = str(self.dir / ADMIN_TOKEN_FILE)
        self.save()
        self._make_identity("spark", [ADMIN], SPARK_TOKEN_FILE, deadline)
        return token

    def _make_identity(
        self, name: str, scopes: list[str], filename: str, deadline: float, token: str | None = None
    ) -> str:
        token = token or new_token()
        secret = read_secret(Path(self.secret_file))
        metadata = token_metadata(cluster_token(secret, self.cluster_name))
        tls = self.tls()
        last = ""
        while time.monotonic() < deadline:
            for n in self.nodes:
                if not (n.pid and alive(n.pid)):
                    continue
                req = clients_pb2.CreateClientRequest(
                    name=name, scopes=scopes, token_hash=token_hash(token)
                )
                try:
                    with tls.channel(n.address) as ch:
                        admin_pb2_grpc.AdminStub(ch).CreateClient(req, metadata=metadata, timeout=5)
                except grpc.RpcError as e:
                    last = f"{n.name}: {e.code().name} {e.details()}"
                    if e.code() == grpc.StatusCode.ALREADY_EXISTS:  # a data dir from before
                        name = f"{name.split('-')[0]}-{secrets.token_hex(4)}"
                    continue
                path = self.dir / filename
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    os.fchmod(f.fileno(), 0o600)
                    f.write(token + "\n")
                return token
            time.sleep(0.1)
        raise TimeoutError(f"could not make the identity {name!r} in time: {last}")


class _Certs:
    """A local cluster's certificates: a CA (made in DIR/ca, or given), and
    a certs dir per process under DIR/certs, each with the CA's certificate."""

    HOSTS = ("127.0.0.1", "localhost", "::1")

    def __init__(self, directory: Path, ca: tuple[Path, Path] | None) -> None:
        from roadlog.tools import ca as calib  # cryptography: only where certificates are made

        self.lib = calib
        self.root = directory / "certs"
        self.root.mkdir(mode=0o700, exist_ok=True)
        if ca is None:
            ca_dir = directory / "ca"
            ca_dir.mkdir(mode=0o700, exist_ok=True)
            calib.create_ca(ca_dir, ca_dir / "ca.key")
            ca = (ca_dir, ca_dir / "ca.key")
        self.ca_dir, self.ca_key = ca
        self._client: Path | None = None

    def _dir(self, name: str) -> Path:
        d = self.root / name
        d.mkdir(mode=0o700, exist_ok=True)
        self.lib.copy_ca(self.ca_dir, d)
        return d

    def args(self, kind: str, name: str) -> list[str]:
        d = self._dir(("n" if kind == "node" else "") + name)
        self.lib.create_cert(d, self.ca_key, Identity(kind, name), list(self.HOSTS))
        return ["--certs-dir", str(d)]

    def client(self) -> Path:
        if self._client is None:
            self._client = self._dir("client")
            self.lib.create_cert(self._client, self.ca_key, Identity("client", "admin"))
        return self._client


def led_groups(status: dict[str, Any]) -> set[int]:
    """The Raft groups (0 and the data groups) a node of ``status`` (a
    ``gather_status``) says it leads."""
    led = {METADATA_GROUP} if status.get("leader") else set()
    for n in status["nodes"]:
        led |= {int(g["id"]) for g in n.get("groups", ()) if g.get("role") == "leader"}
    return led


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


def gather_status(
    servers: list[str],
    node_addresses: list[str],
    timeout: float = 2.0,
    ids: dict[str, int] | None = None,
    tls: ClientTLS | None = None,
) -> dict[str, Any]:
    """leader, term, nodes (id, address, role, commit_index, applied_index)
    and queue_servers (grpc, http), from whatever answers. ``tls``: default
    ``ClientTLS.from_env()`` (asking nodes needs a client certificate)."""
    tls = tls or ClientTLS.from_env()
    out: dict[str, Any] = {"leader": 0, "term": 0, "nodes": [], "queue_servers": []}
    known: dict[int, dict[str, Any]] = {}
    for s in servers:
        try:
            with tls.channel(s) as ch:
                st = client_pb2_grpc.RoadlogStub(ch).Status(
                    client_pb2.StatusRequest(), timeout=timeout
                )
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                node_addresses = [*node_addresses, s]  # it is a node, not a queue server
            refused = e.code() in (
                grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.PERMISSION_DENIED,
            )  # it runs, and tells its cluster's layout only to an identity
            q = {"grpc": s, "http": "", "up": refused}
            if refused:
                q["error"] = f"{e.code().name}: {e.details()}"
            out["queue_servers"].append(q)
            continue
        me = st.queue_servers[0] if st.queue_servers else client_pb2.QueueServerStatus()
        out["queue_servers"].append({"grpc": s, "http": me.http, "up": True, "version": me.version})
        for ns in st.nodes:
            known.setdefault(ns.id, {"id": ns.id, "address": ns.address})
            if ns.address:  # none for an identity without admin or ops (issue 39)
                node_addresses = [*node_addresses, ns.address]
    out["queue_servers"] = [
        q for q in out["queue_servers"] if q["up"] or q["grpc"] not in node_addresses
    ]
    todo = list(dict.fromkeys(node_addresses))
    asked: set[str] = set()
    while todo:
        addr = todo.pop(0)
        if addr in asked:
            continue
        asked.add(addr)
        view = ask_node(addr, timeout, tls)
        if view is not None:
            for nid, a in view.pop("members").items():  # found through this node
                if a not in asked and a not in todo:
                    todo.append(a)
                    known.setdefault(nid, {"id": nid, "address": a})
            known[view["id"]] = view
        else:
            for k, v in known.items():
                if v["address"] == addr and "role" not in v:
                    known[k] = {**v, "role": DOWN, "ready": False}
            if not any(v["address"] == addr for v in known.values()):
                nid = (ids or {}).get(addr, 0)
                key = nid or -len(known) - 1
                known[key] = {"id": nid, "address": addr, "role": DOWN, "ready": False}
    nodes = sorted(known.values(), key=lambda v: (v["id"] == 0, v["id"]))
    for n in nodes:
        n.setdefault("role", DOWN)
        n.setdefault("term", 0)
        n.setdefault("commit_index", 0)
        n.setdefault("applied_index", 0)
        n.setdefault("ready", False)
    leaders = [n for n in nodes if n["role"] == "leader"]
    if leaders:
        best = max(leaders, key=lambda n: n["term"])
        out["leader"], out["term"] = best["id"], best["term"]
    else:
        out["term"] = max((n["term"] for n in nodes), default=0)
    out["nodes"] = nodes
    return out
