"""``roadlog client``: client identities the cluster issues (issue 19).

``create NAME --scope SCOPE ...`` prints the new identity's client id and
token (shown once: the cluster keeps only its hash); ``list``; ``revoke
NAME``. They need the scope admin (``--cluster DIR`` uses the local
cluster's admin token). ``bootstrap`` makes an identity through a node's
Admin service instead, with the cluster's credentials (a client
certificate of its CA, and the cluster secret for the cluster token): the
first admin of a cluster that has none.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
import grpc
from rich.table import Table

from roadlog.cli.common import cli, client_tls, connection, err, out, where
from roadlog.client import Admin
from roadlog.runtime.auth import cluster_token, token_metadata
from roadlog.runtime.config import read_secret
from roadlog.scopes import ScopeError, check_client_name, check_scopes, new_token, token_hash
from roadlog.v1 import admin_pb2_grpc, clients_pb2

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
    """Make a client identity NAME with SCOPEs; print its client id and token."""
    checked = _checked(name, scopes)
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
    with connection(cluster, servers) as conn:
        index = Admin(conn).revoke_client(name)
    err.print(f"client {name!r} revoked (index {index})")


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
