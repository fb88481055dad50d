"""``roadlog-node``: run a node (``run``), and the operator's commands on
one (leave, backup, restore, transfer-leader)."""

from __future__ import annotations

import json
import logging
import socket
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import click
import grpc
import lmdb

from discovery.protocol import discovery_key
from node_daemon.config import ConfigError, NodeConfig, load_config, parse_peers
from node_daemon.process import zygote
from node_daemon.process.backup import (
    BackupError,
    backup_files,
    check_backup_key,
    read_backup_key,
    restore_backup,
    take_backup,
    verify_backup,
)
from node_daemon.process.serve import NodeFailed, serve
from node_daemon.raft import StorageFullError
from node_daemon.storage.damage import DamagedLogError
from roadlog.client_tls import ClientTLS
from roadlog.leadership import HostView, leader_host, transfer_target
from roadlog.release import version_option
from roadlog.runtime import config as configfile
from roadlog.runtime import eventloop, tls
from roadlog.runtime.auth import cluster_token, token_metadata
from roadlog.runtime.config import check_secret, config_flags, private_files, refuse_to_start
from roadlog.runtime.health import metrics_auth
from roadlog.runtime.logs import setup_logging
from roadlog.status import ask_node
from roadlog.v1 import (
    admin_pb2,
    admin_pb2_grpc,
)

log = logging.getLogger("roadlog.node")


@click.group()
@version_option("roadlog-node")
def cli() -> None:
    """The roadlog node daemon."""
    private_files()  # data, snapshots and backups: 0600 files, 0700 directories


@cli.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="TOML file")
@config_flags(NodeConfig)
def run(config_path: Path | None, **flags: Any) -> None:
    """Run a node until SIGTERM."""
    try:
        cfg = load_config(config_path, flags)
        check_secret(cfg.secret_file)
        metrics_auth(cfg.metrics_auth, cfg.metrics_token_file, cfg.insecure)  # refused here
        security = tls.load_security(cfg.certs_dir, cfg.insecure, "node")
        cfg = _node_id_of_certificate(cfg, security)
    except ConfigError as e:
        refuse_to_start("roadlog-node", e)
    tls.install(security)
    setup_logging("node", cfg.log_level)
    if security.insecure:
        tls.warn_insecure("roadlog-node")
    zygote.start_for(cfg)  # before any gRPC object, LMDB environment or thread: worker forks
    try:
        eventloop.run(serve(cfg))
    except ConfigError as e:
        log.error("bad configuration", extra={"error": str(e)})
        sys.exit(2)
    except NodeFailed as e:
        log.error("stopped on a failure", extra={"error": str(e)})
        sys.exit(1)  # systemd restarts it (Restart=on-failure)
    except StorageFullError as e:  # opening the log or the state on a full disk
        log.error("cannot start: the disk is full", extra={"error": str(e)})
        sys.exit(1)  # systemd tries again later, when there may be room
    except DamagedLogError as e:  # and nothing to catch up from
        log.error("cannot start: the log is damaged", extra={"error": str(e)})
        sys.exit(1)


@cli.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="the node's TOML")
@click.option("--address", help="the node's gRPC HOST:PORT (default: from the config)")
@click.option("--secret-file", type=click.Path(path_type=Path))
@click.option("--cluster-name")
@click.option("--certs-dir", type=click.Path(path_type=Path), help="default: the config's")
@click.option("--insecure", is_flag=True, default=None, help="plaintext, to an --insecure node")
@click.option("--timeout", default=60.0, show_default=True)
def leave(
    config_path: Path | None,
    address: str | None,
    secret_file: Path | None,
    cluster_name: str | None,
    certs_dir: Path | None,
    insecure: bool | None,
    timeout: float,
) -> None:
    """Make a running node leave its cluster gracefully (it hands over
    leadership, has the leader remove it, then stops)."""
    cfg = _dialing_config(config_path, secret_file, cluster_name, certs_dir, insecure)
    target = _dialable(address or cfg.address)
    token = cluster_token(cfg.secret(), cfg.cluster_name)
    with _security(cfg).sync_channel(target) as ch:
        try:
            resp = admin_pb2_grpc.AdminStub(ch).Leave(
                admin_pb2.LeaveRequest(), metadata=token_metadata(token), timeout=timeout
            )
        except grpc.RpcError as e:
            raise click.ClickException(f"{target}: {e.code().name}: {e.details()}") from None
    click.echo(f"node at {target} left the cluster (removed at index {resp.index}); it stops now")


@cli.command("discovery-key")
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="the node's TOML")
@click.option("--secret-file", type=click.Path(path_type=Path), help="default: the config's")
def discovery_key_cmd(config_path: Path | None, secret_file: Path | None) -> None:
    """Print the key discovery HELLOs are signed with (hex), derived from the
    cluster secret: what clients need to find queue servers (`roadlog ...
    --discover --discovery-key-file F`), without holding the secret."""
    cfg = _offline_config(config_path, {"secret_file": secret_file})
    try:
        secret = cfg.secret()
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    click.echo(discovery_key(secret).hex())


def _node_id_of_certificate(cfg: NodeConfig, security: tls.Security) -> NodeConfig:
    """With TLS a node is the node its certificate names: node_id unset
    takes it; another id is refused."""
    if security.creds is None:
        return cfg
    cert_id = security.creds.identity.node_id
    if cfg.node_id and cfg.node_id != cert_id:
        raise ConfigError(
            f"node_id: {cfg.node_id}, but the certificate {security.creds.cert_file} names "
            f"node {cert_id}; make this node's certificate with --node-id {cfg.node_id}"
        )
    return replace(cfg, node_id=cert_id)


def _dialable(address: str) -> str:
    """A listen address one can connect to: 0.0.0.0 means this host."""
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host in ("", "0.0.0.0") else address


def _offline_config(config_path: Path | None, flags: dict[str, Any]) -> NodeConfig:
    """The node's configuration for commands that do not run it."""
    try:
        return configfile.load(
            NodeConfig,
            config_path,
            {**flags, "discovery_port": 0, "node_id": 0},
            {"secret_file": Path, "data_dir": Path, "peers": parse_peers, "certs_dir": Path},
            validate=False,
        )
    except ConfigError as e:
        raise click.BadParameter(str(e)) from None


def _dialing_config(
    config_path: Path | None,
    secret_file: Path | None,
    cluster_name: str | None,
    certs_dir: Path | None,
    insecure: bool | None,
) -> NodeConfig:
    """The node's configuration for an operator's command that dials it
    (leave, transfer-leader): the file's, with the flags given."""
    return _offline_config(
        config_path,
        {
            "secret_file": secret_file,
            "cluster_name": cluster_name,
            "certs_dir": certs_dir,
            "insecure": insecure,
        },
    )


def _security(cfg: NodeConfig) -> tls.Security:
    """An operator's command on a node's host speaks with the node's own
    certificate (its port is mutual TLS), or plaintext to an --insecure node."""
    try:
        return tls.load_security(cfg.certs_dir, cfg.insecure, "node")
    except ConfigError as e:
        raise click.ClickException(str(e)) from None


KEY_STDIN = Path("-")
MAX_KEY_LINE = 4096

backup_key_option = click.option(
    "--backup-key-file",
    type=click.Path(path_type=Path),
    envvar="ROADLOG_BACKUP_KEY_FILE",
    help="the operators' backup key (HMAC of the manifest): a file of at least 16 bytes, "
    "mode 0600; '-' reads it as one line from stdin (how the playbooks and fab pass it)",
)


def _backup_key(path: Path | None) -> bytes:
    """The backup key from --backup-key-file (a private file, or '-': stdin)."""
    try:
        if path == KEY_STDIN:
            return check_backup_key(sys.stdin.buffer.readline(MAX_KEY_LINE).strip())
        return read_backup_key(path)
    except BackupError as e:
        raise click.BadParameter(str(e), param_hint="--backup-key-file") from None


@cli.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="the node's TOML")
@click.option("--data-dir", type=click.Path(path_type=Path))
@click.option("--cluster-name")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="a new directory")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="print the manifest as JSON, with `files`: the backup's files, relative to OUT",
)
@backup_key_option
def backup(
    config_path: Path | None,
    data_dir: Path | None,
    cluster_name: str | None,
    out: Path,
    as_json: bool,
    backup_key_file: Path | None,
) -> None:
    """Copy this node's state (consistent, at its applied index) into OUT,
    with a manifest authenticated by the backup key. Safe while the node runs.
    OUT and its files are readable by this user only."""
    key = _backup_key(backup_key_file)
    cfg = _offline_config(config_path, {"data_dir": data_dir, "cluster_name": cluster_name})
    data = Path(cfg.data_dir)
    node_id = int((data / "node_id").read_text()) if (data / "node_id").exists() else cfg.node_id
    try:
        manifest = take_backup(data, out, cfg.cluster_name, node_id, key)
    except (BackupError, lmdb.Error, OSError) as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        fields = asdict(manifest)
        click.echo(json.dumps({**fields, "files": backup_files(fields)}))
    else:
        click.echo(
            f"backup of {cfg.cluster_name} at index {manifest.applied_index} "
            f"({manifest.bytes} bytes) in {out}"
        )


@cli.command("verify-backup")
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="the node's TOML")
@click.option("--cluster-name")
@click.option("--from", "source", type=click.Path(path_type=Path), required=True, help="a backup")
@backup_key_option
def verify_backup_cmd(
    config_path: Path | None,
    cluster_name: str | None,
    source: Path,
    backup_key_file: Path | None,
) -> None:
    """Check a backup as a restore would (the manifest's HMAC under the
    backup key, the state's SHA-256, the cluster) without touching any node;
    prints the manifest as JSON."""
    key = _backup_key(backup_key_file)
    cfg = _offline_config(config_path, {"cluster_name": cluster_name})
    try:
        manifest = verify_backup(source, cfg.cluster_name, key)
    except (BackupError, OSError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(asdict(manifest)))


@cli.command()
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="the node's TOML")
@click.option("--data-dir", type=click.Path(path_type=Path))
@click.option("--cluster-name")
@click.option("--listen", help="the node's HOST:PORT (checked: it must not be serving)")
@click.option("--from", "source", type=click.Path(path_type=Path), required=True, help="a backup")
@click.option(
    "--voters", required=True, help="every node of the restored cluster: ID=HOST:PORT,..."
)
@backup_key_option
def restore(
    config_path: Path | None,
    data_dir: Path | None,
    cluster_name: str | None,
    listen: str | None,
    source: Path,
    voters: str,
    backup_key_file: Path | None,
) -> None:
    """Make this (stopped) node start from a backup. Restore every node from
    the same backup with the same --voters; the old data is moved aside. The
    backup's manifest must carry a valid HMAC under the backup key."""
    key = _backup_key(backup_key_file)
    cfg = _offline_config(
        config_path, {"data_dir": data_dir, "cluster_name": cluster_name, "listen": listen}
    )
    host, _, port = _dialable(cfg.listen).rpartition(":")
    if _listening(host, int(port)):
        raise click.ClickException(f"a node is serving on {cfg.listen}: stop it before a restore")
    try:
        aside = restore_backup(
            Path(cfg.data_dir), source, cfg.cluster_name, parse_peers(voters), key
        )
    except (BackupError, ConfigError, lmdb.Error, OSError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"restored from {source}; the previous data is in {aside}")


@cli.command("transfer-leader")
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="the node's TOML")
@click.option("--address", help="any node's gRPC HOST:PORT (default: this node's, from the config)")
@click.option("--secret-file", type=click.Path(path_type=Path))
@click.option("--cluster-name")
@click.option("--certs-dir", type=click.Path(path_type=Path), help="default: the config's")
@click.option("--insecure", is_flag=True, default=None, help="plaintext, to an --insecure node")
@click.option("--to", "to", type=int, default=0, help="node id (default: the most caught-up)")
@click.option("--timeout", default=30.0, show_default=True)
def transfer_leader(
    config_path: Path | None,
    address: str | None,
    secret_file: Path | None,
    cluster_name: str | None,
    certs_dir: Path | None,
    insecure: bool | None,
    to: int,
    timeout: float,
) -> None:
    """Hand the leadership to another voter and wait until it leads; prints
    {"from": ID, "to": ID, "seconds": S} as JSON."""
    cfg = _dialing_config(config_path, secret_file, cluster_name, certs_dir, insecure)
    security = _security(cfg)
    client_tls = security.client_tls()
    start = _dialable(address or cfg.address)
    views, addresses = _member_views(start, client_tls)
    lead = leader_host(views)
    if lead is None:
        raise click.ClickException("no leader right now: nothing to transfer")
    lead_id = next(v.node_id for v in views if v.host == lead)
    said = ask_node(addresses[lead_id], 2.0, client_tls)
    groups = (said or {}).get("groups") or []
    voters = set(groups[0]["voters"]) if groups and groups[0].get("voters") else None
    target = transfer_target(views, prefer=to, voters=voters)
    if target == 0:
        raise click.ClickException(
            f"no ready voter to hand over to{f' (node {to} is not one)' if to else ''}"
        )
    token = cluster_token(cfg.secret(), cfg.cluster_name)
    t0 = time.monotonic()
    with security.sync_channel(addresses[lead_id]) as ch:
        try:
            admin_pb2_grpc.AdminStub(ch).TransferLeader(
                admin_pb2.TransferLeaderRequest(node_id=target, all_groups=True),
                metadata=token_metadata(token),
                timeout=timeout,
            )
        except grpc.RpcError as e:
            raise click.ClickException(f"{e.code().name}: {e.details()}") from None
    while time.monotonic() - t0 < timeout:
        view = ask_node(addresses[target], 2.0, client_tls)
        if view is not None and view["role"] == "leader":
            break
        time.sleep(0.1)
    else:
        raise click.ClickException(f"node {target} did not take over within {timeout:.0f} s")
    # The data groups the old leader led went too (a group with no voter to
    # take it stays: it is named, not waited for past the timeout).
    kept: list[int] = []
    while time.monotonic() - t0 < timeout:
        old = ask_node(addresses[lead_id], 2.0, client_tls)
        groups = (old or {}).get("groups") or []
        kept = [g["id"] for g in groups if g["id"] != 0 and g["role"] == "leader"]
        if not kept:
            break
        time.sleep(0.1)
    out: dict[str, Any] = {"from": lead_id, "to": target}
    out["seconds"] = round(time.monotonic() - t0, 3)
    if kept:
        out["still_leads"] = kept
    click.echo(json.dumps(out))


def _member_views(start: str, client_tls: ClientTLS) -> tuple[list[HostView], dict[int, str]]:
    """Every member's own view, found from one node; hosts named by address."""
    first = ask_node(start, 2.0, client_tls)
    if first is None:
        raise click.ClickException(f"no node answers at {start}")
    addresses = {int(first["id"]): str(first["address"]), **first["members"]}
    views = []
    for node_id, addr in sorted(addresses.items()):
        view = first if node_id == first["id"] else ask_node(addr, 2.0, client_tls)
        doc = None
        if view is not None:
            doc = {**view, "node_id": node_id, "member": node_id in addresses}
        views.append(HostView.from_readyz(addr, doc, "unknown"))
    return views, addresses


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
