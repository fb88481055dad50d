"""``roadlog ca``: the cluster's CA and its certificates (create-ca,
create-node, create-queue, create-client, list), as ``cockroach cert``.

A certs dir holds ``ca.crt`` and one host's certificates and keys; the CA's
key (``--ca-key``) stays with the operators, never on a host."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.table import Table

from roadlog.cli.common import cli, err, out
from roadlog.runtime.tls import Identity

T = TypeVar("T")


def _ca() -> Any:
    try:
        from roadlog.tools import ca
    except ImportError as e:  # pragma: no cover - an install without the extra
        raise click.ClickException(
            f"making certificates needs the cryptography package ({e}); "
            "install roadlog with the ops or dev extra"
        ) from None
    return ca


def _run(action: Callable[[], T]) -> T:
    ca = _ca()
    try:
        return action()
    except (ca.CAError, ValueError) as e:
        raise click.ClickException(str(e)) from None


certs_dir_option = click.option(
    "--certs-dir",
    type=click.Path(path_type=Path),
    required=True,
    envvar="ROADLOG_CERTS_DIR",
    help="the directory of ca.crt and the certificates (or ROADLOG_CERTS_DIR)",
)
ca_key_option = click.option(
    "--ca-key",
    type=click.Path(path_type=Path),
    required=True,
    envvar="ROADLOG_CA_KEY",
    help="the CA's private key (0600; keep it off the hosts) (or ROADLOG_CA_KEY)",
)
overwrite_option = click.option(
    "--overwrite", is_flag=True, help="replace a certificate or key that exists"
)
days_option = click.option("--days", type=click.IntRange(1, 36500), help="validity in days")


@cli.group("ca")
def ca_group() -> None:
    """The cluster's CA and the certificates of nodes, queue servers and clients."""


@ca_group.command("create-ca")
@certs_dir_option
@ca_key_option
@days_option
@overwrite_option
def create_ca(certs_dir: Path, ca_key: Path, days: int | None, overwrite: bool) -> None:
    """Make the cluster's CA: CERTS_DIR/ca.crt and its key at --ca-key (0600)."""
    ca = _ca()
    kw = {"days": days} if days else {}
    path = _run(lambda: ca.create_ca(certs_dir, ca_key, overwrite=overwrite, **kw))
    err.print(f"CA certificate {path}; its key {ca_key} (0600: keep it with the operators)")


def _create(
    certs_dir: Path,
    ca_key: Path,
    ident: Identity,
    hosts: tuple[str, ...],
    days: int | None,
    overwrite: bool,
) -> None:
    ca = _ca()
    kw = {"days": days} if days else {}
    crt, key = _run(
        lambda: ca.create_cert(certs_dir, ca_key, ident, list(hosts), overwrite=overwrite, **kw)
    )
    err.print(f"{ident}: certificate {crt}, key {key} (0600)")


@ca_group.command("create-node")
@certs_dir_option
@ca_key_option
@click.option("--node-id", type=click.IntRange(1, (1 << 53) - 1), required=True)
@click.argument("hosts", nargs=-1, required=True)
@days_option
@overwrite_option
def create_node(
    certs_dir: Path,
    ca_key: Path,
    node_id: int,
    hosts: tuple[str, ...],
    days: int | None,
    overwrite: bool,
) -> None:
    """A node's certificate (node.crt, node.key) naming NODE_ID, for HOSTS
    (the names and addresses others dial it at)."""
    _create(certs_dir, ca_key, Identity("node", str(node_id)), hosts, days, overwrite)


@ca_group.command("create-queue")
@certs_dir_option
@ca_key_option
@click.option("--name", default="queue", show_default=True, help="the queue server's name")
@click.argument("hosts", nargs=-1, required=True)
@days_option
@overwrite_option
def create_queue(
    certs_dir: Path,
    ca_key: Path,
    name: str,
    hosts: tuple[str, ...],
    days: int | None,
    overwrite: bool,
) -> None:
    """A queue server's certificate (queue.crt, queue.key), for HOSTS (the
    names and addresses clients and nodes dial it at)."""
    _create(certs_dir, ca_key, Identity("queue", name), hosts, days, overwrite)


@ca_group.command("create-client")
@certs_dir_option
@ca_key_option
@click.argument("name")
@days_option
@overwrite_option
def create_client(
    certs_dir: Path, ca_key: Path, name: str, days: int | None, overwrite: bool
) -> None:
    """A client certificate (client.NAME.crt, .key): an operator's tools
    (status, leave, transfer-leader) or the Spark job's reader."""
    if not name.replace("-", "").replace("_", "").isalnum():
        raise click.BadParameter("letters, digits, '-' and '_' only", param_hint="NAME")
    _create(certs_dir, ca_key, Identity("client", name), (), days, overwrite)


@ca_group.command("list")
@certs_dir_option
@click.option("--json", "as_json", is_flag=True, help="machine-readable")
def list_certs(certs_dir: Path, as_json: bool) -> None:
    """The certificates in CERTS_DIR: whom each names, its hosts, its expiry."""
    ca = _ca()
    if not certs_dir.is_dir():
        raise click.ClickException(f"{certs_dir}: no such directory")
    infos = _run(lambda: ca.list_certs(certs_dir))
    if as_json:
        click.echo(json.dumps([asdict(i) for i in infos], indent=2))
        return
    t = Table(title=str(certs_dir))
    for col in ("file", "names", "hosts", "expires"):
        t.add_column(col)
    for i in infos:
        t.add_row(i.file, "CA" if i.ca else i.subject, ", ".join(i.hosts), i.not_after)
    out.print(t)
