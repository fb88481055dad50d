"""``roadlog client``: client identities the cluster issues (issue 19).

``create NAME --scope SCOPE ...`` prints the new identity's client id and
token (shown once: the cluster keeps only its hash); ``list``; ``revoke
NAME``. They need the scope admin (``--cluster DIR`` uses the local
cluster's admin token). ``bootstrap`` makes an identity through a node's
Admin service instead, with the cluster's credentials (a client
certificate of its CA, and the cluster secret for the cluster token): the
first admin of a cluster that has none. ``ensure`` keeps an identity's
token in a file, making the identity again only when the cluster no longer
takes that token (the Ansible roles' deployed identities).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import grpc
from rich.table import Table

from roadlog.cli.common import (
    cli,
    client_tls,
    connection,
    directory_given,
    err,
    out,
    resolve_servers,
    where,
)
from roadlog.client import Admin, AlreadyExists, Connection, RoadlogError
from roadlog.client_tls import ClientTLS
from roadlog.errors import Code
from roadlog.runtime.auth import cluster_token, token_metadata
from roadlog.runtime.config import read_secret
from roadlog.scopes import (
    ADMIN,
    ScopeError,
    check_client_name,
    check_scopes,
    new_token,
    token_hash,
)
from roadlog.v1 import admin_pb2_grpc, client_pb2, clients_pb2

SCOPE_HELP = (
    "admin, produce:TOPIC, read:TOPIC or heatmap:TOPIC (TOPIC or * for every topic); repeat it"
)


@cli.group()
def client() -> None:
    """Client identities: tokens with scopes (create, list, revoke)."""


def _checked(name: str, scopes: tuple[str, ...]) -> list[str]:
    try:
        check_client_name(name)
        return check_scopes(scopes)
    except (ScopeError, ValueError) as e:
        raise click.BadParameter(str(e)) from None


def _print_new(resp: clients_pb2.CreateClientResponse, as_json: bool) -> None:
    if as_json:
        out.print_json(json.dumps({"client_id": resp.client_id, "token": resp.token}))
        return
    err.print(
        f"client {resp.identity.name!r} made with scopes {', '.join(resp.identity.scopes)}; "
        "its token is shown once (the cluster keeps only its hash):"
    )
    click.echo(f"client_id {resp.client_id}")
    click.echo(f"token {resp.token}")


@client.command("create")
@click.argument("name")
@click.option("--scope", "scopes", multiple=True, required=True, help=SCOPE_HELP)
@click.option("--json", "as_json", is_flag=True, help='{"client_id": ..., "token": ...}')
@where
def client_create(
    name: str, scopes: tuple[str, ...], as_json: bool, cluster: Path | None, servers: str | None
) -> None:
    """Make a client identity NAME with SCOPEs; print its client id and token.
    With --directory: on the directory and every member cluster, one token
    for all of them (identities are per cluster until the federation's one
    identity: docs/federation.md)."""
    checked = _checked(name, scopes)
    dd = directory_given() if cluster is None and not servers else None
    if dd is not None:
        _create_in_federation(dd, name, checked, as_json)
        return
    with connection(cluster, servers) as conn:
        resp = Admin(conn).create_client(name, checked)
    _print_new(resp, as_json)


@client.command("list")
@click.option("--json", "as_json", is_flag=True)
@where
def client_list(as_json: bool, cluster: Path | None, servers: str | None) -> None:
    """The identities admins made (self-registered phones are counted)."""
    with connection(cluster, servers) as conn:
        resp = Admin(conn).list_clients()
    rows = [
        {
            "name": c.name,
            "client_id": c.client_id,
            "scopes": list(c.scopes),
            "created_ms": c.created_ms,
        }
        for c in resp.clients
    ]
    if as_json:
        out.print_json(json.dumps({"clients": rows, "registered": resp.registered}))
        return
    table = Table("name", "client id", "scopes", "created (UTC)")
    for r in rows:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(int(r["created_ms"]) / 1000))  # type: ignore[call-overload]
        table.add_row(str(r["name"]), str(r["client_id"]), " ".join(r["scopes"]), created)  # type: ignore[arg-type]
    out.print(table)
    out.print(f"self-registered identities: {resp.registered}")


@client.command("revoke")
@click.argument("name")
@click.option("--yes", is_flag=True, help="do not ask")
@where
def client_revoke(name: str, yes: bool, cluster: Path | None, servers: str | None) -> None:
    """Revoke identity NAME: its token stops working (within seconds)."""
    if not yes and not click.confirm(f"revoke client {name!r}? its token stops working"):
        raise click.Abort()
    dd = directory_given() if cluster is None and not servers else None
    if dd is not None:
        done = _each_in_federation(dd, lambda conn: Admin(conn).revoke_client(name))
        err.print(f"client {name!r} revoked on {', '.join(done)}")
        return
    with connection(cluster, servers) as conn:
        index = Admin(conn).revoke_client(name)
    err.print(f"client {name!r} revoked (index {index})")


def _each_in_federation(dd: str, action: Callable[[Connection], Any]) -> dict[str, Any]:
    """``action`` on the directory, then on every member cluster it lists:
    each one's answer by name ("directory" first); an error names the
    clusters done before it (what a rerun has to account for)."""
    from roadlog.tools.localdirectory import directory_of

    ctx = click.get_current_context(silent=True)
    token = ctx.meta.get("token") if ctx is not None else None
    done: dict[str, Any] = {}
    try:
        with directory_of(dd) as d:
            tls = d.tls.with_token(token)
            with Connection(d.conn.servers, tls=tls) as conn:
                done["directory"] = action(conn)
            for m in d.federation().members:
                with Connection(m.queue_servers, tls=tls) as conn:
                    done[m.name] = action(conn)
    except (FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    except RoadlogError as e:
        where = f" (done on {', '.join(done)})" if done else ""
        raise click.ClickException(f"{e}{where}") from None
    return done


def _create_in_federation(dd: str, name: str, scopes: list[str], as_json: bool) -> None:
    token = new_token()
    req = clients_pb2.CreateClientRequest(name=name, scopes=scopes, token_hash=token_hash(token))
    made = _each_in_federation(dd, lambda conn: conn.call("CreateClient", req))
    ids = {cluster: resp.client_id for cluster, resp in made.items()}
    if as_json:
        out.print_json(json.dumps({"client_id": ids["directory"], "token": token, "clusters": ids}))
        return
    err.print(
        f"client {name!r} made with scopes {', '.join(scopes)} on {', '.join(ids)}; "
        "its token is shown once (the clusters keep only its hash):"
    )
    for cluster, cid in ids.items():
        click.echo(f"client_id {cid} ({cluster})")
    click.echo(f"token {token}")


@client.command("bootstrap")
@click.argument("name")
@click.option("--node", "node", required=True, help="a node's HOST:PORT (its Admin service)")
@click.option("--scope", "scopes", multiple=True, default=("admin",), show_default=True)
@click.option(
    "--secret-file",
    type=click.Path(path_type=Path),
    envvar="ROADLOG_SECRET_FILE",
    required=True,
    help="the cluster secret (the cluster token of the Admin service)",
)
@click.option("--cluster-name", default="roadlog", show_default=True)
@click.option("--json", "as_json", is_flag=True)
def client_bootstrap(
    name: str,
    node: str,
    scopes: tuple[str, ...],
    secret_file: Path,
    cluster_name: str,
    as_json: bool,
) -> None:
    """Make identity NAME through a node's Admin service, with the cluster's
    credentials (ROADLOG_CA_FILE, ROADLOG_CERT_FILE, ROADLOG_KEY_FILE: a
    client certificate of the cluster's CA): the first admin's token. Ask
    the leader (another node says which it is)."""
    checked = _checked(name, scopes)
    token = new_token()
    req = clients_pb2.CreateClientRequest(name=name, scopes=checked, token_hash=token_hash(token))
    try:
        md = token_metadata(cluster_token(read_secret(secret_file), cluster_name))
    except (OSError, ValueError) as e:
        raise click.ClickException(f"{secret_file}: {e}") from None
    try:
        with client_tls(None).channel(node) as ch:
            resp = admin_pb2_grpc.AdminStub(ch).CreateClient(req, metadata=md, timeout=10)
    except grpc.RpcError as e:
        raise click.ClickException(f"{e.code().name}: {e.details()}") from None
    resp.token = token
    _print_new(resp, as_json)


# ------------------------------------------------------------------ ensure

REFUSED = (Code.UNAUTHENTICATED, Code.PERMISSION_DENIED)


def _read_token(path: Path | None) -> str | None:
    """The token kept in ``path`` (None: no file, or an empty one)."""
    if path is None:
        return None
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None
    except OSError as e:
        raise click.ClickException(f"{path}: {e.strerror}") from None


def _write_token(path: Path, token: str) -> None:
    """Write ``token`` to ``path`` (0600, whatever the umask), atomically: a
    reader sees the old token or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(token + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _secret(given: str | None) -> bytes:
    """The cluster secret from --secret-file (``-``: stdin)."""
    if not given:
        raise click.UsageError("--bootstrap-node needs the cluster secret: --secret-file FILE or -")
    try:
        secret = sys.stdin.read().strip().encode() if given == "-" else read_secret(Path(given))
    except (OSError, ValueError) as e:
        raise click.ClickException(f"{given}: {e}") from None
    if not secret:
        raise click.ClickException(f"{given}: the cluster secret is empty")
    return secret


class _Identities:
    """What ``ensure`` asks the cluster: through its queue servers with a
    given token, or through a node's Admin service with the cluster's
    credentials (a bootstrap)."""

    def __init__(
        self,
        servers: list[str],
        tls: ClientTLS,
        nodes: list[str],
        secret: Callable[[], bytes],
        cluster_name: str,
        timeout: float,
    ) -> None:
        self.servers, self.tls, self.nodes = servers, tls, nodes
        self.secret, self.cluster_name, self.timeout = secret, cluster_name, timeout

    def _conn(self, token: str) -> Connection:
        return Connection(self.servers, timeout=self.timeout, tls=self.tls.with_token(token))

    def works(self, token: str) -> bool:
        """Does the cluster take ``token`` (any identity: ListTopics)?"""
        with self._conn(token) as conn:
            try:
                conn.call("ListTopics", client_pb2.ListTopicsRequest())
            except RoadlogError as e:
                if e.code in REFUSED:
                    return False
                raise
        return True

    def listing(self, token: str) -> clients_pb2.ListClientsResponse | None:
        """The identities, asked with ``token`` (None: refused, no admin)."""
        with self._conn(token) as conn:
            try:
                return Admin(conn).list_clients()
            except RoadlogError as e:
                if e.code in REFUSED:
                    return None
                raise

    def create(self, admin_token: str, name: str, scopes: list[str]) -> tuple[str, str]:
        with self._conn(admin_token) as conn:
            resp = Admin(conn).create_client(name, scopes)
        return resp.client_id, resp.token

    def revoke(self, admin_token: str, name: str) -> None:
        with self._conn(admin_token) as conn:
            Admin(conn).revoke_client(name)

    def bootstrap(self, name: str, scopes: list[str]) -> tuple[str, str]:
        """Make ``name`` through a node's Admin service (the leader's; the
        others say they are not it), trying the nodes until the deadline.
        AlreadyExists when the name is taken."""
        md = token_metadata(cluster_token(self.secret(), self.cluster_name))
        token = new_token()
        req = clients_pb2.CreateClientRequest(
            name=name, scopes=scopes, token_hash=token_hash(token)
        )
        deadline = time.monotonic() + self.timeout
        last = "no node given (--bootstrap-node)"
        while True:
            for node in self.nodes:
                try:
                    with self.tls.channel(node) as ch:
                        resp = admin_pb2_grpc.AdminStub(ch).CreateClient(
                            req, metadata=md, timeout=5
                        )
                    return resp.client_id, token
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.ALREADY_EXISTS:
                        raise AlreadyExists(Code.ALREADY_EXISTS, e.details() or name) from None
                    if e.code() not in (
                        grpc.StatusCode.FAILED_PRECONDITION,  # not the leader
                        grpc.StatusCode.UNAVAILABLE,
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                    ):
                        raise click.ClickException(
                            f"{node}: {e.code().name}: {e.details()}"
                        ) from None
                    last = f"{node}: {e.code().name}: {e.details()}"
            if not self.nodes or time.monotonic() > deadline:
                raise click.ClickException(f"no node made identity {name!r}: {last}")
            time.sleep(1.0)


@client.command("ensure")
@click.argument("name")
@click.option("--scope", "scopes", multiple=True, required=True, help=SCOPE_HELP)
@click.option(
    "--token-file",
    type=click.Path(path_type=Path),
    required=True,
    help="where NAME's token is kept (0600): kept while the cluster takes it",
)
@click.option(
    "--admin-token-file",
    type=click.Path(path_type=Path),
    help="an admin's token, to check, revoke and make NAME (else NAME's own, if an admin)",
)
@click.option(
    "--bootstrap-node",
    "bootstrap_nodes",
    help="nodes' HOST:PORT,...: make NAME through a node's Admin service when no admin "
    "token works (the cluster's credentials: ROADLOG_CA_FILE, _CERT_FILE, _KEY_FILE "
    "and --secret-file, '-' for stdin, with --cluster-name)",
)
@click.option("--timeout", type=float, default=60.0, show_default=True, help="seconds per step")
@click.option("--json", "as_json", is_flag=True, help='{"name", "client_id", "changed"}')
@where
def client_ensure(
    name: str,
    scopes: tuple[str, ...],
    token_file: Path,
    admin_token_file: Path | None,
    bootstrap_nodes: str | None,
    timeout: float,
    as_json: bool,
    cluster: Path | None,
    servers: str | None,
) -> None:
    """Keep identity NAME's token in TOKEN_FILE (idempotent).

    The token there is kept while the cluster takes it and NAME has exactly
    the SCOPEs; else NAME is made again (a stale NAME revoked first) and its
    new token written there, 0600. Needs an admin: --admin-token-file, else
    NAME's own kept token where NAME is an admin, else --bootstrap-node (the
    first admin: through a node's Admin service, with the cluster secret; a
    NAME whose token was lost is replaced through a passing admin identity
    that revokes itself). Prints what it did, never the token."""
    checked = _checked(name, scopes)
    ctx = click.get_current_context()
    given_secret = ctx.meta.get("secret_file") or os.environ.get("ROADLOG_SECRET_FILE")
    cache: list[bytes] = []

    def secret() -> bytes:
        if not cache:
            cache.append(_secret(given_secret))
        return cache[0]

    ids = _Identities(
        resolve_servers(cluster, servers),
        client_tls(cluster),
        [n for n in (bootstrap_nodes or "").split(",") if n],
        secret,
        str(ctx.meta.get("cluster_name") or "roadlog"),
        timeout,
    )
    if given_secret == "-" and bootstrap_nodes:
        secret()  # stdin is read now, whether a bootstrap is needed or not
    try:
        result = _ensure(ids, name, checked, token_file, admin_token_file, bootstrap_nodes)
    except RoadlogError as e:
        raise click.ClickException(str(e)) from None
    if as_json:  # one line, for the roles to read
        click.echo(json.dumps(result))
    else:
        what = "made" if result["changed"] else "kept"
        err.print(
            f"client {name!r} ({result['client_id'] or '?'}): its token in {token_file} {what}"
        )


def _ensure(
    ids: _Identities,
    name: str,
    scopes: list[str],
    token_file: Path,
    admin_token_file: Path | None,
    bootstrap: str | None,
) -> dict[str, Any]:
    admin: str | None = None
    if admin_token_file is not None:
        admin = _read_token(admin_token_file)
        if admin is None:
            raise click.ClickException(f"{admin_token_file}: no admin token there")
    kept = _read_token(token_file)
    clients = None
    if admin is not None:
        clients = ids.listing(admin)
        if clients is None:
            raise click.ClickException(f"{admin_token_file}: the cluster refuses this admin token")
    if kept is not None and ids.works(kept):
        if clients is None and ADMIN in scopes:  # NAME is itself the admin (else made again)
            clients = ids.listing(kept)
            admin = kept if clients is not None else None
        if clients is None and ADMIN not in scopes:  # nobody to ask about NAME: keep it
            return {"name": name, "client_id": "", "changed": False}
        mine = next((c for c in clients.clients if c.name == name), None) if clients else None
        if mine is not None and sorted(mine.scopes) == sorted(scopes):
            return {"name": name, "client_id": mine.client_id, "changed": False}
    # Make NAME (again).
    exists = clients is not None and any(c.name == name for c in clients.clients)
    if admin is not None and not (exists and admin == kept):
        if exists:
            ids.revoke(admin, name)
        client_id, token = ids.create(admin, name, scopes)
    elif admin is not None:  # NAME is the admin we act as: revoking it would stop us
        client_id, token = _through_passing(
            ids, name, scopes, lambda n: ids.create(admin, n, [ADMIN])
        )
    elif bootstrap:
        try:
            client_id, token = ids.bootstrap(name, scopes)
        except AlreadyExists:  # NAME exists, but no token of it here works
            client_id, token = _through_passing(
                ids, name, scopes, lambda n: ids.bootstrap(n, [ADMIN])
            )
    else:
        raise click.ClickException(
            f"no admin token works to make {name!r}: --admin-token-file or --bootstrap-node"
        )
    _write_token(token_file, token)
    return {"name": name, "client_id": client_id, "changed": True}


def _through_passing(
    ids: _Identities,
    name: str,
    scopes: list[str],
    make_admin: Callable[[str], tuple[str, str]],
) -> tuple[str, str]:
    """Replace identity ``name`` through a passing admin identity (made by
    ``make_admin``), which revokes ``name``, makes it again and then
    revokes itself: the client id and token of the new ``name``."""
    passing = f"{name[:40]}-ensure-{secrets.token_hex(4)}"
    _, temp = make_admin(passing)
    try:
        ids.revoke(temp, name)
        return ids.create(temp, name, scopes)
    finally:
        ids.revoke(temp, passing)
