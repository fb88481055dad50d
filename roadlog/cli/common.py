"""What every ``roadlog`` command shares: finding the cluster (``--cluster``,
``--servers``, ``--discover``), a connection, progress bars, and the root group."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from discovery.listen import find_queue_servers
from discovery.protocol import discovery_key
from roadlog.client import Connection, RoadlogError, servers_from_env
from roadlog.client_tls import ClientTLS
from roadlog.release import version_option
from roadlog.runtime.config import read_secret
from roadlog.tools.localcluster import LocalCluster

DIR_HELP = "a local cluster's DIR (--cluster and --dir are the same)"
err = Console(stderr=True)
out = Console()


def resolve_servers(cluster: Path | None, servers: str | None) -> list[str]:
    if cluster is not None:
        return LocalCluster.load(cluster).servers
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.meta.get("discover"):
        return _discovered(ctx.meta)
    found = servers_from_env(servers) if servers else servers_from_env()
    if not found:
        raise click.UsageError(
            "say where the cluster is: --cluster DIR, --servers HOST:PORT or ROADLOG_SERVERS"
        )
    return found


T = TypeVar("T")


def on_local_cluster(directory: Path, action: Callable[[LocalCluster], T]) -> T:
    """Run ``action`` on the local cluster in DIR; a missing cluster or node
    is a clear error, not a traceback."""
    try:
        return action(LocalCluster.load(directory))
    except (FileNotFoundError, KeyError) as e:
        raise click.ClickException(str(e).strip("'\"")) from None


def _discovery_key(meta: dict[str, Any]) -> bytes:
    """The discovery key: from --discovery-key-file (hex, as ``roadlog-node
    discovery-key`` prints it), or derived from --secret-file."""
    key_file = meta.get("discovery_key_file") or os.environ.get("ROADLOG_DISCOVERY_KEY_FILE")
    if key_file:
        try:
            key = bytes.fromhex(Path(key_file).read_text().strip())
        except (OSError, ValueError) as e:
            raise click.ClickException(f"discovery key {key_file}: {e}") from None
        if len(key) != 32:
            raise click.ClickException(
                f"discovery key {key_file}: not 64 hex digits (roadlog-node discovery-key)"
            )
        return key
    secret_file = meta.get("secret_file") or os.environ.get("ROADLOG_SECRET_FILE")
    if not secret_file:
        raise click.UsageError(
            "--discover needs the discovery key: --discovery-key-file (or "
            "ROADLOG_DISCOVERY_KEY_FILE; `roadlog-node discovery-key` prints it), or the "
            "cluster secret (--secret-file, ROADLOG_SECRET_FILE)"
        )
    try:
        return discovery_key(read_secret(Path(secret_file)))
    except (OSError, ValueError) as e:
        raise click.ClickException(f"discovery: {e}") from None


def _discovered(meta: dict[str, Any]) -> list[str]:
    key = _discovery_key(meta)
    try:
        found = find_queue_servers(key, meta.get("cluster_name"), meta.get("discovery_port", 7499))
    except (OSError, ValueError) as e:
        raise click.ClickException(f"discovery: {e}") from None
    if not found:
        raise click.ClickException("no queue server announced itself on this network")
    err.print(f"discovered queue servers: {', '.join(found)}")
    return found


def _meta(key: str) -> Callable[[click.Context, click.Parameter, Any], None]:
    def store(ctx: click.Context, _: click.Parameter, value: Any) -> None:
        if value is not None:
            ctx.meta[key] = value

    return store


DIRECTORY_HELP = (
    "a federation's directory: a local one's folder (`roadlog directory up`), else its "
    "queue servers HOST:PORT,... (or ROADLOG_DIRECTORY); the topic's home is asked there"
)


def directory_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--directory`` (and ROADLOG_DIRECTORY), kept in the context's meta."""
    return click.option(
        "--directory",
        envvar="ROADLOG_DIRECTORY",
        expose_value=False,
        callback=_meta("directory"),
        help=DIRECTORY_HELP,
    )(f)


def directory_given() -> str | None:
    """The ``--directory`` value of the command running (None: none)."""
    ctx = click.get_current_context(silent=True)
    value = ctx.meta.get("directory") if ctx is not None else None
    return str(value) if value else None


def where(f: Callable[..., Any]) -> Callable[..., Any]:
    f = directory_option(f)
    f = click.option("--servers", help="queue servers HOST:PORT,... (or ROADLOG_SERVERS)")(f)
    f = click.option(
        "--token",
        expose_value=False,
        callback=_meta("token"),
        help="the client identity's token (else --cluster DIR's admin token, else ROADLOG_TOKEN)",
    )(f)
    f = click.option(
        "--cluster",
        "--dir",
        "cluster",
        type=click.Path(path_type=Path),
        help=DIR_HELP,
    )(f)
    f = click.option(
        "--discover",
        is_flag=True,
        default=None,
        expose_value=False,
        callback=_meta("discover"),
        help="find queue servers by their announcements on this network",
    )(f)
    f = click.option(
        "--discovery-key-file",
        expose_value=False,
        callback=_meta("discovery_key_file"),
        help="with --discover: the discovery key, hex (`roadlog-node discovery-key`; or "
        "ROADLOG_DISCOVERY_KEY_FILE)",
    )(f)
    f = click.option(
        "--secret-file",
        expose_value=False,
        callback=_meta("secret_file"),
        help="with --discover and no discovery key: the cluster secret (or ROADLOG_SECRET_FILE)",
    )(f)
    f = click.option(
        "--cluster-name", expose_value=False, callback=_meta("cluster_name"), help="with --discover"
    )(f)
    f = click.option(
        "--discovery-port", type=int, expose_value=False, callback=_meta("discovery_port")
    )(f)
    return f


def client_tls(cluster: Path | None) -> ClientTLS:
    """A local cluster's CA, admin certificate and admin token (--cluster
    DIR), else ROADLOG_CA_FILE, ROADLOG_CERT_FILE, ROADLOG_KEY_FILE,
    ROADLOG_INSECURE and ROADLOG_TOKEN. ``--token`` wins over both."""
    ctx = click.get_current_context(silent=True)
    token = ctx.meta.get("token") if ctx is not None else None
    if cluster is not None:
        tls = LocalCluster.load(cluster).tls()
        if tls.token is None:  # a cluster from before identities: the environment's
            tls = tls.with_token(ClientTLS.from_env().token)
        return tls.with_token(token)
    return ClientTLS.from_env().with_token(token)


@contextmanager
def connection(
    cluster: Path | None, servers: str | None, topic: str | None = None
) -> Iterator[Connection]:
    """A connection to the cluster named; with ``--directory`` (and neither
    --cluster nor --servers), to ``topic``'s home in the federation."""
    fed = directory_given() if cluster is None and not servers else None
    try:
        if fed is not None and topic is not None:
            conn = federated_connection(fed, topic)
        else:
            try:
                found = resolve_servers(cluster, servers)
            except click.UsageError:
                if fed is None:
                    raise
                raise click.UsageError(
                    "this command does not take --directory yet (docs/federation.md, step 7): "
                    "give the member cluster's --cluster DIR or --servers"
                ) from None
            conn = Connection(found, tls=client_tls(cluster))
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    except RoadlogError as e:
        raise click.ClickException(str(e)) from None
    try:
        yield conn
    except RoadlogError as e:
        raise click.ClickException(str(e)) from None
    finally:
        conn.close()


def federated_connection(directory: str, topic: str) -> Connection:
    """A connection to ``topic``'s home, asked of the directory once."""
    from roadlog.tools.localdirectory import directory_of

    try:
        d = directory_of(directory)
    except (FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    with d:
        home = d.lookup(topic)
    ctx = click.get_current_context(silent=True)
    token = ctx.meta.get("token") if ctx is not None else None
    conn = Connection(home.queue_servers, tls=d.tls.with_token(token))
    conn.cluster = home.cluster
    return conn


def progress(known_total: bool = True) -> Progress:
    """A progress bar on stderr; without a known total it counts up."""
    count = (
        "{task.completed:,.0f}/{task.total:,.0f}" if known_total else "{task.completed:,.0f} pings"
    )
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn(count),
        TimeElapsedColumn(),
        console=err,
        transient=False,
    )


@click.group()
@version_option("roadlog")
def cli() -> None:
    """roadlog: GPS pings replicated with Raft, turned into traffic heat maps."""
