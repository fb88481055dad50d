"""``roadlog directory``: a federation's directory on loopback (up, down,
status), and what the other commands do with ``--directory`` (issue 43,
docs/federation.md): a topic placed and made on its home, every member's
topics listed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from roadlog.cli.common import DIR_HELP, DIRECTORY_HELP, cli, err, out
from roadlog.client import Admin, Connection, RoadlogError
from roadlog.tools.localdirectory import (
    directory_create,
    directory_down,
    directory_of,
)
from roadlog.v1 import federation_pb2


@cli.group()
def directory() -> None:
    """A federation's directory: which member cluster holds each topic."""


@directory.command("up")
@click.option("--nodes", default=1, show_default=True)
@click.option("--dir", "dd", type=click.Path(path_type=Path), required=True, help=DIR_HELP)
@click.option("--timeout", default=60.0, show_default=True, help="seconds to wait for a leader")
def directory_up(nodes: int, dd: Path, timeout: float) -> None:
    """Start a directory (a roadlog cluster of its own) in DD; member
    clusters join it with `roadlog cluster up --name NAME --directory DD`."""
    if nodes < 1:
        raise click.BadParameter("need at least one node")
    try:
        lc = directory_create(dd, nodes)
    except FileExistsError as e:
        raise click.ClickException(str(e)) from None
    lc.start_all()
    with err.status("waiting for the directory's leader"):
        try:
            st = lc.wait_ready(timeout)
        except TimeoutError as e:
            directory_down(dd)
            raise click.ClickException(f"{e}; logs in {dd / 'logs'}") from None
    err.print(
        f"directory up: {nodes} node(s), leader {st['leader']}; queue servers "
        f"{', '.join(lc.servers)}; its admin token in {lc.token_file}"
    )
    out.print(",".join(lc.servers))


@directory.command("down")
@click.option("--dir", "dd", type=click.Path(path_type=Path), required=True, help=DIR_HELP)
def directory_down_cmd(dd: Path) -> None:
    """Stop the local directory in DD (its member clusters keep running)."""
    try:
        directory_down(dd)
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    err.print(f"directory in {dd} stopped")


def status_doc(fed: federation_pb2.Federation) -> dict[str, Any]:
    """``directory status --json``: ``clusters`` and ``topics``."""
    return {
        "clusters": [
            {
                "name": m.name,
                "queue_servers": list(m.queue_servers),
                "http": list(m.http),
                "tags": list(m.tags),
                "topics": m.topics,
                "healthy": m.healthy,
                "publishes_per_s": round(sum(x.publishes_per_s for x in m.loads), 3),
                "reported_ms": m.reported_ms,
            }
            for m in fed.members
        ],
        "topics": {t.topic: t.cluster for t in fed.topics},
        "applied_index": fed.applied_index,
    }


@directory.command("status")
@click.option("--directory", "dd", envvar="ROADLOG_DIRECTORY", required=True, help=DIRECTORY_HELP)
@click.option("--json", "as_json", is_flag=True)
def directory_status(dd: str, as_json: bool) -> None:
    """The member clusters (health, load, topics) and each topic's home."""
    try:
        with directory_of(dd) as d:
            doc = status_doc(d.federation())
    except (FileNotFoundError, ValueError, RoadlogError) as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    t = Table()
    for col in ("cluster", "healthy", "topics", "publishes/s", "tags", "queue servers"):
        t.add_column(col)
    for c in doc["clusters"]:
        t.add_row(
            c["name"],
            "yes" if c["healthy"] else "NO",
            str(c["topics"]),
            f"{c['publishes_per_s']:g}",
            ",".join(c["tags"]),
            ",".join(c["queue_servers"]),
        )
    out.print(t)


# ------------------------------------------------- the other commands' side


def tag_list(tags: str | None) -> list[str]:
    """``--tags k=v,k=v`` as a list."""
    return [t.strip() for t in (tags or "").split(",") if t.strip()]


def create_in_federation(
    dd: str, name: str, on: str, tags: list[str], create: Callable[[Connection], Any]
) -> tuple[Any, str]:
    """Place ``name`` in the federation, then ``create`` it on its home
    (its answer, and the home's name); a creation refused there gives the
    home up again, so the name is free."""
    try:
        with directory_of(dd) as d:
            home = d.place(name, on, tags)
            try:
                return create(d.member(home)), home.cluster
            except RoadlogError:
                d.forget_home(name, home.cluster)
                raise
    except (FileNotFoundError, ValueError, RoadlogError) as e:
        raise click.ClickException(str(e)) from None


def list_federation(dd: str) -> list[tuple[Any, str]]:
    """Every member's topics, each with its member's name (a member that
    does not answer is named on stderr and left out)."""
    found: list[tuple[Any, str]] = []
    try:
        with directory_of(dd) as d:
            for m in d.federation().members:
                conn = d.member_by_name(m.name, list(m.queue_servers))
                try:
                    found += [(t, m.name) for t in Admin(conn).list_topics()]
                except RoadlogError as e:
                    err.print(f"[yellow]cluster {m.name}: {e}[/]")
    except (FileNotFoundError, ValueError, RoadlogError) as e:
        raise click.ClickException(str(e)) from None
    return found
