"""roadlog operations over SSH (Fabric). Hosts come from the Ansible
inventory: --inventory FILE, else $ROADLOG_INVENTORY, else inventory/hosts.

    fab --list
    fab status [--json]                 every host's view: role, term, lag, service
    fab logs [--unit roadlog-node] [--lines 50] [--host lab1]
    fab restart                         rolling, leader last, health-gated
    fab transfer-leader [--to NODE_ID]
    fab backup --key-file KEY [--dest backups]
                                        consistent copy of the state, HMAC-signed, to here
    fab heatmap-now                     run the cron heat-map job now
    fab drill [--seconds 20] [--json]   SIGKILL the leader's node; how long writes stopped

The drill's probe calls the client API, which wants a client identity's
token: $ROADLOG_TOKEN, else the file $ROADLOG_TOKEN_FILE, else the
operators' admin token the roles keep on this machine (role
roadlog_identities: roadlog_identities_dir, by default tokens/ beside the
CA in roadlog_tls_controller_dir). It reaches the prober on stdin, into the
drill's private directory, never a command line.

The cluster logic (leader, order, health, pause) is roadlog.leadership and
roadlog.tools.ops, tested
without SSH; this file only moves commands and their output.

SSH host keys are checked as OpenSSH does (issue 19, finding 17): a host
must be in $ROADLOG_KNOWN_HOSTS, else in ~/.ssh/known_hosts or
/etc/ssh/ssh_known_hosts, or fab refuses to talk to it; a changed key is
always refused. For a first contact, ROADLOG_SSH_ACCEPT_NEW_HOST_KEYS=1
trusts unknown hosts without checking their keys (OpenSSH's
StrictHostKeyChecking=accept-new): it says so for every key it adds, and
appends them to the known-hosts file for the next runs.
"""

from __future__ import annotations

import io
import json as jsonlib
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fabric import Connection, task
from invoke.context import Context
from paramiko import MissingHostKeyPolicy, PKey, SSHClient, SSHException
from paramiko.hostkeys import InvalidHostKey

sys.path.insert(0, str(Path(__file__).resolve().parent))

from roadlog.leadership import HostView, leader_host
from roadlog.tools.ops import (
    OPERATOR_CLIENT,
    SshHost,
    client_tls_env,
    health_problems,
    hosts_from_inventory,
    operator_token_file,
    restart_order,
    status_rows,
    write_pause,
)

VENV = "/opt/roadlog/venv"
CONFIG = "/etc/roadlog/node.toml"
QUEUE_CONFIG = "/etc/roadlog/queue.toml"
USER = "roadlog"
METRICS_PORT = 9400
QUEUE_PORT = 7500

# The operators' client certificate on the hosts (roles: roadlog_tls_operator_client).
CLIENT = os.environ.get("ROADLOG_OPERATOR_CLIENT", OPERATOR_CLIENT)

# A node's /readyz as the host sees it (argv: port, node.toml): at the address
# its metrics port binds (metrics_host, else listen's host; 127.0.0.1 where that
# is every address), HTTPS trusting the cluster's CA from the node's certs_dir,
# plaintext where it runs insecure. With the node's metrics_auth (issue 39) it
# shows what the port asks for, as the roles' smoke checks do: token, the
# bearer token of its metrics_token_file; tls, the node's own certificate
# (the cluster's CA signed it). Run as root: both files are the node's.
READYZ = """
import ssl, sys, tomllib, urllib.error, urllib.request
port, config = sys.argv[1], sys.argv[2]
try:
    with open(config, "rb") as f:
        conf = tomllib.load(f)
except (OSError, ValueError):
    conf = {}
host = str(conf.get("metrics_host") or str(conf.get("listen", "")).rpartition(":")[0])
host = host.strip("[]")
if host in ("", "0.0.0.0", "::"):
    host = "127.0.0.1"
elif ":" in host:
    host = f"[{host}]"
ctx, headers = None, {}
auth = conf.get("metrics_auth", "none")
try:
    if auth == "token":
        with open(str(conf.get("metrics_token_file", ""))) as f:
            headers["Authorization"] = "Bearer " + f.read().strip()
    if conf.get("insecure") is True:
        url = f"http://{host}:{port}/readyz"
    else:
        url = f"https://{host}:{port}/readyz"
        certs = str(conf.get("certs_dir") or "/etc/roadlog/certs")
        ctx = ssl.create_default_context(cafile=certs + "/ca.crt")
        if auth == "tls":
            ctx.load_cert_chain(certs + "/node.crt", certs + "/node.key")
except (OSError, ValueError):
    print("null")
    sys.exit(0)
try:
    req = urllib.request.Request(url, headers=headers)
    body = urllib.request.urlopen(req, timeout=3, context=ctx).read()
except urllib.error.HTTPError as e:
    body = e.read()
except OSError:
    body = b"null"
print(body.decode())
"""


# ------------------------------------------------------------------ hosts


REPO = Path(__file__).resolve().parent
# The inventory's host variables, as the last _inventory read them.
_HOSTVARS: dict[str, dict[str, Any]] = {}


def _inventory(path: str | None) -> dict[str, list[SshHost]]:
    inv = path or os.environ.get("ROADLOG_INVENTORY") or "inventory/hosts"
    here = Path(sys.executable).parent / "ansible-inventory"
    tool = str(here) if here.exists() else "ansible-inventory"
    out = subprocess.run([tool, "-i", inv, "--list"], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"fab: cannot read the inventory {inv}: {out.stderr.strip()}")
    doc = jsonlib.loads(out.stdout)
    _HOSTVARS.clear()
    _HOSTVARS.update(doc.get("_meta", {}).get("hostvars", {}))
    return hosts_from_inventory(doc)


TOKEN_ENV = "ROADLOG_TOKEN"
TOKEN_FILE_ENV = "ROADLOG_TOKEN_FILE"


def _operator_token() -> str | None:
    """The token the drill's probe calls with (it makes its topic, then
    writes: the scope admin): $ROADLOG_TOKEN, else the file
    $ROADLOG_TOKEN_FILE, else the operators' token the roles keep here; None
    where there is none (a cluster run with client_auth none)."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV].strip()
    given = os.environ.get(TOKEN_FILE_ENV)
    path = Path(given) if given else operator_token_file(_HOSTVARS, REPO)
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        if given:
            sys.exit(f"fab: {TOKEN_FILE_ENV}={given}: no such file")
        return None
    except OSError as e:
        sys.exit(f"fab: the operators' token {path}: {e.strerror}")


KNOWN_HOSTS_ENV = "ROADLOG_KNOWN_HOSTS"
ACCEPT_NEW_ENV = "ROADLOG_SSH_ACCEPT_NEW_HOST_KEYS"
SYSTEM_KNOWN_HOSTS = Path("/etc/ssh/ssh_known_hosts")


def _known_hosts() -> tuple[Path, list[Path]]:
    """The known-hosts file new keys go to, and every file to read."""
    own = os.environ.get(KNOWN_HOSTS_ENV)
    if own:
        return Path(own), [Path(own)]
    user = Path("~/.ssh/known_hosts").expanduser()
    return user, [user, SYSTEM_KNOWN_HOSTS]


def _fingerprint(key: PKey) -> str:
    return f"{key.get_name()} {key.fingerprint}"


class UnknownHostKey(SSHException):
    """The host's key is in no known-hosts file: fab does not talk to it."""


class _RejectUnknown(MissingHostKeyPolicy):
    def missing_host_key(self, client: SSHClient, hostname: str, key: PKey) -> None:
        raise UnknownHostKey(
            f"{hostname}: unknown SSH host key ({_fingerprint(key)}); add the host to "
            f"{_known_hosts()[0]} after checking the fingerprint on the host itself "
            f"(ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub), or set {ACCEPT_NEW_ENV}=1 "
            "for a first contact"
        )


class _AcceptNew(MissingHostKeyPolicy):
    """Trust on first use, only when asked for: say so, and remember the key."""

    def __init__(self, known_hosts: Path) -> None:
        self.known_hosts = known_hosts

    def missing_host_key(self, client: SSHClient, hostname: str, key: PKey) -> None:
        print(
            f"[fab] WARNING: {ACCEPT_NEW_ENV} is set: trusting the unknown SSH host key of "
            f"{hostname} ({_fingerprint(key)}) WITHOUT CHECKING IT (whoever answers on that "
            f"address gets our commands and secrets); added to {self.known_hosts}",
            file=sys.stderr,
            flush=True,
        )
        client.get_host_keys().add(hostname, key.get_name(), key)
        # Appended, never rewritten: the file's other lines stay as they are.
        self.known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(self.known_hosts, "a") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


def _check_host_keys(client: SSHClient) -> None:
    """Load the known hosts and refuse unknown keys (Fabric would accept any)."""
    target, files = _known_hosts()
    for f in files:
        if not f.exists():
            continue
        try:
            client.load_system_host_keys(str(f))  # read only: never rewritten
        except InvalidHostKey as e:  # e.g. @cert-authority or @revoked: fail closed
            sys.exit(
                f"fab: {f}: paramiko cannot read the line {e.line!r}; point "
                f"{KNOWN_HOSTS_ENV} at a file of plain host key lines"
            )
    accept_new = os.environ.get(ACCEPT_NEW_ENV, "") not in ("", "0")
    client.set_missing_host_key_policy(_AcceptNew(target) if accept_new else _RejectUnknown())


def _connect(h: SshHost) -> Connection:
    kwargs: dict[str, Any] = {"key_filename": h.key_file} if h.key_file else {}
    conn = Connection(
        h.address, user=h.user, port=h.port, connect_kwargs=kwargs, connect_timeout=10
    )
    _check_host_keys(conn.client)
    return conn


def _run(
    conn: Connection,
    cmd: str,
    as_user: str | None = None,
    warn: bool = False,
    stdin: str | None = None,
) -> Any:
    """Run as root (sudo when the SSH user is not root), or as `as_user`;
    `stdin` is the command's input (then nothing else is read from here)."""
    kw: dict[str, Any] = {"hide": True, "warn": warn}
    if stdin is not None:
        kw["in_stream"] = io.StringIO(stdin)
    if conn.user == "root":
        return conn.run(f"sudo -u {as_user} -- {cmd}" if as_user else cmd, **kw)
    return conn.sudo(cmd, user=as_user or "root", **kw)


def _private_file(path: Path) -> Any:
    """A new local file only this user may read (0600), open for writing."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")


def _view(h: SshHost) -> HostView:
    try:
        with _connect(h) as conn:
            service = _run(conn, "systemctl is-active roadlog-node", warn=True).stdout.strip()
            # As root (it reads node.toml and the CA, which only roadlog's group may).
            raw = _run(
                conn, f"python3 -c {shlex.quote(READYZ)} {METRICS_PORT} {CONFIG}", warn=True
            ).stdout
    except UnknownHostKey as e:  # a row, and what to do about it
        print(f"[fab] {e}", file=sys.stderr, flush=True)
        return HostView(host=h.name, service="ssh: unknown host key")
    except Exception as e:  # an unreachable host is a row, not a crash
        return HostView(host=h.name, service=f"ssh: {type(e).__name__}")
    try:
        doc = jsonlib.loads(raw)
    except ValueError:
        doc = None
    return HostView.from_readyz(h.name, doc, service)


def _views(nodes: list[SshHost]) -> list[HostView]:
    return [_view(h) for h in nodes]


def _wait_healthy(nodes: list[SshHost], timeout: float = 180) -> list[HostView]:
    deadline = time.monotonic() + timeout
    while True:
        views = _views(nodes)
        problems = health_problems(views)
        if not problems:
            return views
        if time.monotonic() > deadline:
            sys.exit("fab: the cluster is not healthy: " + "; ".join(problems))
        time.sleep(2)


def _say(msg: str) -> None:
    print(f"[fab] {msg}", flush=True)


# ------------------------------------------------------------------ tasks


@task(help={"inventory": "Ansible inventory", "json": "print JSON rows"})
def status(c: Context, inventory: str | None = None, json: bool = False) -> None:
    """Every host's view of the cluster: role, term, lag, service state."""
    groups = _inventory(inventory)
    views = _views(groups.get("nodes", []))
    rows = status_rows(views)
    problems = health_problems(views)
    if json:
        print(jsonlib.dumps({"hosts": rows, "healthy": not problems, "problems": problems}))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="roadlog cluster")
    for col in ("host", "service", "node", "role", "term", "applied", "lag", "ready"):
        table.add_column(col)
    for r in rows:
        role = f"{r['role']} *" if r["leader"] else r["role"]
        lag = "-" if r["lag"] is None else str(r["lag"])
        table.add_row(
            r["host"], r["service"], str(r["node_id"]), role, str(r["term"]),
            str(r["applied_index"]), lag, "yes" if r["ready"] else "no",
        )  # fmt: skip
    console = Console()
    console.print(table)
    console.print("healthy" if not problems else "problems: " + "; ".join(problems))


@task(help={"unit": "systemd unit", "lines": "how many", "host": "only this host"})
def logs(
    c: Context,
    unit: str = "roadlog-node",
    lines: int = 50,
    host: str | None = None,
    inventory: str | None = None,
) -> None:
    """Show a unit's journal on every host (or on --host)."""
    groups = _inventory(inventory)
    everyone = {h.name: h for hs in groups.values() for h in hs}
    targets = [everyone[host]] if host else list(everyone.values())
    if host and host not in everyone:
        sys.exit(f"fab: no host {host} in the inventory")
    for h in targets:
        with _connect(h) as conn:
            out = _run(
                conn,
                f"journalctl -u {shlex.quote(unit)} -n {int(lines)} --no-pager -o short-iso",
                warn=True,
            )
        print(f"===== {h.name}: {unit}")
        print(out.stdout.rstrip())


@task(help={"inventory": "Ansible inventory"})
def restart(c: Context, inventory: str | None = None) -> None:
    """Rolling restart of the nodes, leader last, health-gated.

    One host at a time; the leader hands its leadership over first; the
    cluster must be healthy before and after each host."""
    nodes = _inventory(inventory).get("nodes", [])
    by_name = {h.name: h for h in nodes}
    views = _wait_healthy(nodes)
    for name in restart_order(views):
        views = _wait_healthy(nodes)
        h = by_name[name]
        with _connect(h) as conn:
            if leader_host(views) == name:  # as the node's user: its key is that user's
                moved = _run(
                    conn,
                    f"{VENV}/bin/roadlog-node transfer-leader --config {CONFIG}",
                    as_user=USER,
                )
                _say(f"{name}: leadership handed over {moved.stdout.strip()}")
            t0 = time.monotonic()
            _run(conn, "systemctl restart roadlog-node")  # Type=notify: back and caught up
        _say(f"{name}: restarted, ready again in {time.monotonic() - t0:.1f} s")
    _wait_healthy(nodes)
    _say("rolling restart done; the cluster is healthy")


@task(name="transfer-leader", help={"to": "node id (default: the most caught-up follower)"})
def transfer_leader(c: Context, to: int = 0, inventory: str | None = None) -> None:
    """Hand the Raft leadership to another voter."""
    nodes = _inventory(inventory).get("nodes", [])
    views = _views(nodes)
    lead = leader_host(views)
    h = next((n for n in nodes if n.name == lead), nodes[0] if nodes else None)
    if h is None:
        sys.exit("fab: no nodes in the inventory")
    with _connect(h) as conn:
        flag = f" --to {int(to)}" if to else ""
        out = _run(  # as the node's user: it dials with the node's key, which is that user's
            conn,
            f"{VENV}/bin/roadlog-node transfer-leader --config {CONFIG}{flag}",
            as_user=USER,
            warn=True,
        )
    if out.failed:
        sys.exit(f"fab: {out.stderr.strip() or out.stdout.strip()}")
    print(out.stdout.strip())


@task(
    help={
        "dest": "directory on this machine",
        "key_file": "the operators' backup key (default: $ROADLOG_BACKUP_KEY_FILE); mode 0600",
    },
)
def backup(
    c: Context, dest: str = "backups", key_file: str | None = None, inventory: str | None = None
) -> None:
    """Back up the cluster's state (consistent, from one ready node) to here.

    The manifest carries an HMAC under the backup key (restore checks it);
    the key reaches the node on stdin, never its disk. The copy here is 0600."""
    from node_daemon.process.backup import BackupError, read_backup_key

    key_path = key_file or os.environ.get("ROADLOG_BACKUP_KEY_FILE")
    try:
        key = read_backup_key(Path(key_path) if key_path else None).decode()
    except BackupError as e:
        sys.exit(f"fab: {e} (--key-file or ROADLOG_BACKUP_KEY_FILE)")
    except UnicodeDecodeError:
        sys.exit(f"fab: the backup key {key_path} must be text (e.g. openssl rand -hex 32)")
    nodes = _inventory(inventory).get("nodes", [])
    views = _views(nodes)
    ready = [v.host for v in views if v.ready]
    if not ready:
        sys.exit("fab: no ready node to back up from")
    h = next(n for n in nodes if n.name == ready[0])
    name = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    remote = f"/var/lib/roadlog/backups/{name}"
    local = Path(dest) / name
    local.parent.mkdir(parents=True, exist_ok=True)
    local.mkdir(mode=0o700)
    with _connect(h) as conn:
        out = _run(
            conn,
            f"{VENV}/bin/roadlog-node backup --config {CONFIG} --out {remote} --json "
            "--backup-key-file -",
            as_user=USER,
            stdin=key + "\n",
        )
        manifest = jsonlib.loads(out.stdout)
        for f in manifest["files"]:
            (local / f).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with _private_file(local / f) as dst:
                if conn.user == "root":
                    conn.get(f"{remote}/{f}", dst)
                else:  # the files belong to roadlog: stream them through sudo
                    data = conn.sudo(f"cat {remote}/{f}", hide=True, encoding="latin-1").stdout
                    dst.write(data.encode("latin-1"))
        _run(conn, f"rm -rf {remote}")
    print(
        f"backup {local}: {h.name} at index {manifest['applied_index']}, {manifest['bytes']} bytes"
    )


@task(name="heatmap-now")
def heatmap_now(c: Context, inventory: str | None = None) -> None:
    """Run the heat-map job now (the cron job's script, on the Spark master).

    One run at a time: if cron's run is going, this one says so and exits."""
    masters = _inventory(inventory).get("spark_master", [])
    if not masters:
        sys.exit("fab: no spark_master host in the inventory")
    with _connect(masters[0]) as conn:
        out = _run(conn, "/opt/roadlog/bin/roadlog-heatmap", as_user=USER, warn=True)
    print(out.stdout.rstrip())
    if out.failed:
        sys.exit(f"fab: the heat-map job failed:\n{out.stderr[-3000:]}")


def _drill_in(
    pconn: Connection, work: str, victim: SshHost, lead: str, servers: str, seconds: int
) -> tuple[dict[str, Any], float]:
    """The drill's probe (writing into `work` on the prober) and its kill:
    the probe's result and when the leader was killed."""
    out_file = f"{work}/probe.json"
    # The probe dials the queue servers as the roles deployed them: TLS with
    # the cluster's CA and the operators' client certificate from the queue
    # server's certs_dir on the prober (plaintext only where it runs insecure).
    conf = _run(pconn, f"cat {QUEUE_CONFIG}", warn=True)
    try:
        tls = client_tls_env(None if conf.failed else conf.stdout, CLIENT)
    except ValueError as e:
        sys.exit(f"fab: {QUEUE_CONFIG} on the prober: {e}")
    tls_env = " ".join(f"{k}={shlex.quote(v)}" for k, v in tls.items())
    # The operators' token: on stdin into the private directory, then into
    # the probe's environment (never on a command line, where ps shows it).
    token = _operator_token()
    with_token = ""
    if token:
        _run(pconn, f"umask 077 && cat > {work}/token", stdin=token + "\n")
        with_token = f'ROADLOG_TOKEN="$(cat {work}/token)"; export ROADLOG_TOKEN; '
    else:
        _say("no operators' token (ROADLOG_TOKEN, ROADLOG_TOKEN_FILE, the roles'): the probe "
             "calls without one")  # fmt: skip
    probe = (
        f"{with_token}env {tls_env} ROADLOG_CLIENT_ID=roadlog-drill HOME={work} "
        f"timeout {seconds + 60} {VENV}/bin/python -m roadlog.tools.probe --servers {servers} "
        f"--duration {seconds} --out {out_file}"
    )
    _run(pconn, f"nohup sh -c {shlex.quote(probe)} > /dev/null 2>&1 &")
    time.sleep(min(5.0, seconds / 3))
    with _connect(victim) as vconn:
        killed = _run(
            vconn,
            "date +%s.%N && systemctl kill --kill-whom=main --signal=SIGKILL roadlog-node",
        )
    fault_at = float(killed.stdout.split()[0])
    _say(f"killed roadlog-node on {lead} (SIGKILL)")
    deadline = time.monotonic() + seconds + 60
    while _run(pconn, f"test -f {out_file}", warn=True).failed:
        if time.monotonic() > deadline:
            sys.exit("fab: the probe did not finish")
        time.sleep(1)
    return jsonlib.loads(_run(pconn, f"cat {out_file}").stdout), fault_at


@task(help={"seconds": "how long the write probe runs", "json": "print JSON"})
def drill(c: Context, seconds: int = 20, json: bool = False, inventory: str | None = None) -> None:
    """SIGKILL the leader's node while a probe writes; report the write pause.

    systemd restarts the killed node (Restart=on-failure)."""
    groups = _inventory(inventory)
    nodes, queues = groups.get("nodes", []), groups.get("queue_servers", [])
    if not nodes or not queues:
        sys.exit("fab: the inventory needs nodes and queue_servers")
    views = _wait_healthy(nodes)
    lead = leader_host(views)
    victim = next(n for n in nodes if n.name == lead)
    prober = next((q for q in queues if q.name != lead), queues[0])
    servers = ",".join(f"{q.address}:{QUEUE_PORT}" for q in queues)
    _say(f"leader is {lead}; probe writes from {prober.name} for {seconds} s")
    with _connect(prober) as pconn:
        # A private directory made by mktemp (not a guessable /tmp path),
        # removed whatever happens to the drill.
        work = _run(pconn, "mktemp -d /tmp/roadlog-drill.XXXXXXXXXX").stdout.strip()
        try:
            result, fault_at = _drill_in(pconn, work, victim, lead, servers, seconds)
        finally:
            _run(pconn, f"rm -rf {shlex.quote(work)}", warn=True)
    pause = write_pause(result["acks"], fault_at)
    views = _wait_healthy(nodes)
    report = {
        "killed": lead,
        "new_leader": leader_host(views),
        "write_pause_s": round(pause, 3),
        "acks": len(result["acks"]),
        "errors": result["errors"],
        "healthy_again": True,
    }
    if json:
        print(jsonlib.dumps(report))
    else:
        _say(
            f"writes stopped for {pause:.2f} s; new leader {report['new_leader']}; "
            f"{len(result['acks'])} writes acknowledged, {result['errors']} retried; "
            "cluster healthy"
        )
