"""``roadlog cluster``: a local cluster on loopback (up, status, kill, start, down)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from roadlog.cli.common import (
    DIR_HELP,
    cli,
    connection,
    err,
    on_local_cluster,
    out,
    resolve_servers,
    where,
)
from roadlog.client import Admin
from roadlog.client_tls import ClientTLS
from roadlog.placement import (
    DATA_GROUPS_RECORD,
    MAX_DATA_GROUPS,
    worker_processes,
)
from roadlog.release import mixed
from roadlog.runtime.processes import alive
from roadlog.status import DOWN, raft_group_views
from roadlog.tools.localcluster import LocalCluster, gather_status
from roadlog.tools.localdirectory import MemberFounding, member_founding, wait_registered
from roadlog.v1 import topics_pb2


@cli.group()
def cluster() -> None:
    """Run a local cluster on 127.0.0.1, or look at any cluster."""


@cluster.command("up")
@click.option("--nodes", default=3, show_default=True)
@click.option("--queue-servers", default=1, show_default=True)
@click.option(
    "--dir", "--cluster", "directory", type=click.Path(path_type=Path), required=True, help=DIR_HELP
)
@click.option("--timeout", default=60.0, show_default=True, help="seconds to wait for a leader")
@click.option(
    "--groups",
    "data_groups",
    type=click.IntRange(1, MAX_DATA_GROUPS),
    default=None,
    help="data groups (multi-raft): above 1, every topic's partitions are placed in "
    "them and their leaders spread over the nodes (1: every ping in group 0) "
    "[default: one per voter, the nodes' default]",
)
@click.option(
    "--workers",
    type=click.IntRange(0, MAX_DATA_GROUPS),
    default=0,
    show_default=True,
    help="with more than one data group: worker processes per node for the data groups, "
    "each on a core of its own (0: one per core, at most one per group; 1: every group "
    "in the node's main process)",
)
@click.option(
    "--insecure",
    is_flag=True,
    help="no TLS: plaintext, unauthenticated ports (debugging only)",
)
@click.option("--name", help="the cluster's cluster_name (a federation member's name there)")
@click.option(
    "--directory",
    "federation",
    type=click.Path(path_type=Path),
    help="found a member of the local directory in this folder (`roadlog directory up`): "
    "it registers there as --name and reports its load",
)
@click.option("--tags", help="with --directory: the member's key=value,... tags")
def cluster_up(
    nodes: int,
    queue_servers: int,
    directory: Path,
    timeout: float,
    data_groups: int | None,
    workers: int,
    insecure: bool,
    name: str | None,
    federation: Path | None,
    tags: str | None,
) -> None:
    """Start node daemons and queue servers, wait for a leader, write
    DIR/cluster.json. TLS on every port: a CA in DIR/ca (its key too),
    each process's certificate in DIR/certs, the tools' in DIR/certs/client."""
    if nodes < 1 or queue_servers < 1:
        raise click.BadParameter("need at least one node and one queue server")
    node_args = ["--workers", str(workers)]
    if insecure:
        err.print(
            "[bold red]INSECURE: --insecure turns TLS off: every port of this cluster is "
            "plaintext and unauthenticated. For debugging only.[/]"
        )
    member = _member_founding(federation, name, tags, insecure)
    try:
        lc = LocalCluster.create(
            directory,
            nodes,
            queue_servers,
            extra_node_args=node_args,
            extra_queue_args=member.queue_args if member else None,
            insecure=insecure,
            data_groups=data_groups,  # None: the nodes' default, one per voter
            ca=member.ca if member else None,
            cluster_name=name or "roadlog",
        )
    except FileExistsError as e:
        raise click.ClickException(str(e)) from None
    lc.start_all()
    with err.status("waiting for a leader") as st:
        try:
            status = lc.wait_ready(
                timeout,
                progress=lambda s: st.update(f"waiting: {s}"),
                admin_token=member.admin_token if member else None,
            )
            if member is not None and federation is not None:
                st.update(f"waiting for {member.name} to register with the directory")
                wait_registered(federation, member.name, timeout)
        except TimeoutError as e:
            lc.down()
            raise click.ClickException(f"{e}; logs in {directory / 'logs'}") from None
        founded = data_groups or _recorded_data_groups(lc)
        if founded > 1:  # every data group led before a first topic is placed in them
            status = _wait_groups_led(lc, founded, timeout, st)
    procs = worker_processes(founded, workers)
    err.print(
        f"cluster up: {nodes} nodes, {founded} data group(s)"
        + (f" in {procs} worker processes a node" if procs > 1 else "")
        + f", leader {status['leader']} "
        f"(term {status['term']}); "
        f"queue servers {', '.join(lc.servers)}; {lc.file}; the admin identity's token in "
        f"{lc.token_file} (--cluster {directory} uses it)"
    )
    out.print(",".join(lc.servers))


def _member_founding(
    federation: Path | None, name: str | None, tags: str | None, insecure: bool
) -> MemberFounding | None:
    """A federation member's founding (None: a cluster on its own)."""
    if federation is None:
        if tags:
            raise click.UsageError("--tags are a federation member's: give --directory")
        return None
    if not name or insecure:
        raise click.UsageError("a member cluster (--directory) needs --name, and TLS")
    try:
        return member_founding(federation, name, [t for t in (tags or "").split(",") if t])
    except (FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from None


def _recorded_data_groups(lc: LocalCluster) -> int:
    """The data groups the first node recorded at its start (1 if none)."""
    try:
        return int((Path(lc.nodes[0].data_dir) / DATA_GROUPS_RECORD).read_text().strip())
    except (OSError, ValueError, IndexError):
        return 1


def _wait_groups_led(lc: LocalCluster, groups: int, timeout: float, st: Any) -> dict[str, Any]:
    """The status once group 0 and data groups 1..``groups`` each have a
    leader; ClickException (the cluster taken down) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        status = lc.status()
        led = {int(g["id"]) for g in raft_groups(status, None) if g["leader"]}
        if led >= set(range(groups + 1)):
            return status
        if time.monotonic() > deadline:
            lc.down()
            raise click.ClickException(
                f"data groups not all led after {timeout:.0f} s (led: {sorted(led)}); "
                f"logs in {lc.dir / 'logs'}"
            )
        st.update(f"waiting for the data groups' leaders: {len(led)}/{groups + 1} led")
        time.sleep(0.2)


@cluster.command("status")
@where
@click.option("--json", "as_json", is_flag=True, help="machine-readable")
def cluster_status(cluster: Path | None, servers: str | None, as_json: bool) -> None:
    """Leader, term, and each node's role and indexes."""
    if cluster is not None:
        st = on_local_cluster(cluster, LocalCluster.status)
    else:
        st = gather_status(resolve_servers(None, servers), [], tls=ClientTLS.from_env())
    answered = any(n.get("role", DOWN) != DOWN for n in st["nodes"])
    topics = None
    if answered:  # else asking for topics only retries until its deadline
        try:
            with connection(cluster, servers) as conn:
                topics = Admin(conn).list_topics()
        except click.ClickException as e:
            err.print(f"[yellow]partitions unknown: {e.message}[/]")
    st["groups"] = raft_groups(st, topics)
    st["mixed_releases"] = mixed_releases(st)
    if as_json:
        click.echo(json.dumps(st, indent=2))
        if not answered:
            _no_node_answered(st)
        return
    t = Table(title=f"leader {st['leader'] or '-'}, term {st['term']}")
    for col in ("id", "address", "role", "term", "commit", "applied", "ready", "version"):
        t.add_column(col)
    for n in st["nodes"]:
        t.add_row(
            str(n["id"]),
            n["address"],
            n["role"],
            str(n["term"]),
            str(n["commit_index"]),
            str(n["applied_index"]),
            "yes" if n["ready"] else "no",
            _release_text(n),
        )
    out.print(t)
    for q in st["queue_servers"]:
        out.print(
            f"queue server {q['grpc']}"
            + (f" {q['http']}" if q.get("http") else "")
            + (f" {_release_text(q)}" if q.get("up") and not q.get("error") else "")
        )
    for g in st["groups"]:
        n = len(g["partitions"]) if g["partitions_known"] else "?"
        lag = ", ".join(f"n{r['node']} {r['lag']}" for r in g["replicas"]) or "-"
        out.print(
            f"group {g['id']}: leader {g['leader'] or '-'}, term {g['term']}, "
            f"commit {g['commit_index']}, lag {lag}, {n} partitions"
        )
    if st["mixed_releases"]:
        says = "; ".join(
            f"{r or OLDER_RELEASE}: {', '.join(who)}" for r, who in st["mixed_releases"].items()
        )
        out.print(f"[yellow]mixed releases (a rolling upgrade under way?): {says}[/]")
    if not answered:
        _no_node_answered(st)


OLDER_RELEASE = "older (tells none)"


def _release_text(p: dict[str, Any]) -> str:
    if p.get("role", "") == DOWN:
        return "-"
    return str(p.get("version") or OLDER_RELEASE)


def mixed_releases(status: dict[str, Any]) -> dict[str, list[str]]:
    """``cluster status``'s ``mixed_releases``: when the processes that
    answered run more than one release (a rolling upgrade under way), each
    release ("": one from before releases were told) with the processes
    that run it (``n<id>``, a queue server's gRPC address); {} when they
    all run one."""
    who: dict[str, list[str]] = {}
    for n in status["nodes"]:
        if n.get("role", DOWN) != DOWN:
            who.setdefault(str(n.get("version", "")), []).append(f"n{n['id']}")
    for q in status["queue_servers"]:
        if q.get("up") and not q.get("error"):
            who.setdefault(str(q.get("version", "")), []).append(str(q["grpc"]))
    return dict(sorted(who.items())) if mixed(list(who)) else {}


def _no_node_answered(st: dict[str, Any]) -> None:
    """Say why, and exit 1."""
    refused = [q["error"] for q in st["queue_servers"] if q.get("error")]
    hint = ""
    if refused:
        hint = f" (the queue servers want an identity: --token or ROADLOG_TOKEN; {refused[0]})"
    err.print("[red]no node answered[/]" + hint)
    raise SystemExit(1)


def raft_groups(
    status: dict[str, Any], topics: list[topics_pb2.TopicDescription] | None
) -> list[dict[str, Any]]:
    """``cluster status``'s ``groups``: each Raft group with its leader, term,
    commit index, replicas (each node's role, applied index and lag behind
    the leader's commit: ``roadlog.status.raft_group_views``, what the
    dashboard shows too) and partitions ([topic, partition] pairs; topics
    None: unknown, ``partitions_known`` false)."""
    views = {g["id"]: g for g in raft_group_views(status["nodes"])}
    by_group: dict[int, list[list[Any]]] = {g: [] for g in views}
    for t in topics or []:
        for p in t.partitions:
            by_group.setdefault(p.group, []).append([t.topic.spec.name, p.partition])
    out = []
    for g, parts in sorted(by_group.items()):
        view = views.get(g, {"id": g, "leader": 0, "term": 0, "commit_index": 0, "replicas": []})
        out.append({**view, "partitions": parts, "partitions_known": topics is not None})
    return out


@cluster.command("kill")
@click.argument("node")
@click.option(
    "--dir", "--cluster", "directory", type=click.Path(path_type=Path), required=True, help=DIR_HELP
)
def cluster_kill(node: str, directory: Path) -> None:
    """SIGKILL one node of a local cluster."""
    n = on_local_cluster(directory, lambda lc: lc.kill(node))
    err.print(f"killed node {n.id}")


@cluster.command("start")
@click.argument("node")
@click.option(
    "--dir", "--cluster", "directory", type=click.Path(path_type=Path), required=True, help=DIR_HELP
)
def cluster_start(node: str, directory: Path) -> None:
    """Start a stopped node of a local cluster again (with its data)."""
    n = on_local_cluster(directory, lambda lc: lc.start(node))
    err.print(f"started node {n.id} (pid {n.pid})")


@cluster.command("down")
@click.option(
    "--dir", "--cluster", "directory", type=click.Path(path_type=Path), required=True, help=DIR_HELP
)
def cluster_down(directory: Path) -> None:
    """Stop every process of a local cluster (data stays in DIR)."""
    lc = on_local_cluster(directory, lambda lc: lc)
    lc.down()
    left = [p.pid for p in [*lc.nodes, *lc.queue_servers] if p.pid and alive(p.pid)]
    err.print("cluster down" + (f"; still running: {left}" if left else ""))
