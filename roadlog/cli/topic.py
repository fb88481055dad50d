"""``roadlog topic``: create, update, list, describe and delete topics (city regions)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from roadlog.cli.common import DIRECTORY_HELP, cli, connection, directory_given, err, out, where
from roadlog.cli.directory import create_in_federation, list_federation, tag_list
from roadlog.client import Admin, Connection, RoadlogError
from roadlog.contribution import (
    DEFAULT_CONTRIBUTION_MIN_PINGS,
    DEFAULT_CONTRIBUTION_MIN_SECONDS,
    min_pings,
    min_seconds,
)
from roadlog.geo import RegionError, bbox_region, parse_region


@cli.group()
def topic() -> None:
    """Create, list, describe and delete topics (city regions)."""


def _access_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Who may publish to the topic and what give-to-get counts (issue 39)."""
    f = click.option(
        "--contribution-min-seconds",
        type=click.IntRange(0),
        default=None,
        help=f"over at least S seconds (default {DEFAULT_CONTRIBUTION_MIN_SECONDS})",
    )(f)
    f = click.option(
        "--contribution-min-pings",
        type=click.IntRange(1),
        default=None,
        help="give-to-get counts a client's contribution once it sent at least N pings "
        f"(default {DEFAULT_CONTRIBUTION_MIN_PINGS})",
    )(f)
    return click.option(
        "--no-open-produce/--open-produce",
        default=None,
        help="self-registered identities' produce:* does not cover this topic (default: open)",
    )(f)


@topic.command("create")
@click.argument("name")
@click.option("--region", type=click.Path(exists=True, path_type=Path), help="GeoJSON Polygon file")
@click.option("--bbox", help="MINLON,MINLAT,MAXLON,MAXLAT")
@click.option("--partitions", type=int, default=0, help="default 8")
@click.option("--retention-hours", type=float, default=0.0, help="default 168")
@click.option("--h3-resolution", type=int, default=0, help="default 9")
@_access_options
@click.option("--on", "on", help="with --directory: the member cluster to hold it")
@click.option(
    "--tags",
    help="with --directory: key=value,... a member cluster holding it must carry "
    "(default: the least loaded)",
)
@where
@click.option("--json", "as_json", is_flag=True)
def topic_create(
    name: str,
    region: Path | None,
    bbox: str | None,
    partitions: int,
    retention_hours: float,
    h3_resolution: int,
    no_open_produce: bool | None,
    contribution_min_pings: int | None,
    contribution_min_seconds: int | None,
    on: str | None,
    tags: str | None,
    cluster: Path | None,
    servers: str | None,
    as_json: bool,
) -> None:
    """Create a topic for a region (with --directory: placed in the
    federation first, then made on its home)."""
    if (region is None) == (bbox is None):
        raise click.UsageError("give exactly one of --region FILE.geojson or --bbox")
    try:
        if region is not None:
            geo = parse_region(region.read_text())
        else:
            parts = [float(v) for v in (bbox or "").split(",")]
            if len(parts) != 4:
                raise RegionError("bbox needs four numbers")
            geo = bbox_region(*parts)
    except (RegionError, ValueError) as e:
        raise click.BadParameter(str(e)) from None

    def create(conn: Connection) -> Any:
        return Admin(conn).create_topic(
            name,
            geo.geojson,
            partitions,
            int(retention_hours * 3600_000),
            h3_resolution,
            no_open_produce=bool(no_open_produce),
            contribution_min_pings=contribution_min_pings,
            contribution_min_seconds=contribution_min_seconds,
        )

    fed = directory_given() if cluster is None and not servers else None
    if fed is not None:
        d, home = create_in_federation(fed, name, on or "", tag_list(tags), create)
        _print_topic(d, as_json, home)
        return
    if on or tags:
        raise click.UsageError("--on and --tags place a topic in a federation: give --directory")
    with connection(cluster, servers) as conn:
        d = create(conn)
    _print_topic(d, as_json)


@topic.command("update")
@click.argument("name")
@_access_options
@where
@click.option("--json", "as_json", is_flag=True)
def topic_update(
    name: str,
    no_open_produce: bool | None,
    contribution_min_pings: int | None,
    contribution_min_seconds: int | None,
    cluster: Path | None,
    servers: str | None,
    as_json: bool,
) -> None:
    """Change who may publish to a topic and what give-to-get counts (the
    options not given are kept)."""
    if (no_open_produce, contribution_min_pings, contribution_min_seconds) == (None,) * 3:
        raise click.UsageError(
            "nothing to change: give --no-open-produce/--open-produce, "
            "--contribution-min-pings or --contribution-min-seconds"
        )
    with connection(cluster, servers) as conn:
        d = Admin(conn).update_topic(
            name, no_open_produce, contribution_min_pings, contribution_min_seconds
        )
    _print_topic(d, as_json)


@topic.command("list")
@where
@click.option("--json", "as_json", is_flag=True)
def topic_list(cluster: Path | None, servers: str | None, as_json: bool) -> None:
    """The topics and their sizes (with --directory: every member's, each
    with its cluster)."""
    fed = directory_given() if cluster is None and not servers else None
    if fed is not None:
        docs = [_topic_doc(d, home) for d, home in list_federation(fed)]
    else:
        with connection(cluster, servers) as conn:
            docs = [_topic_doc(d) for d in Admin(conn).list_topics()]
    if as_json:
        click.echo(json.dumps(docs, indent=2))
        return
    t = Table()
    for col in ("name", *(["cluster"] if fed else []), "partitions", "pings", "bbox"):
        t.add_column(col)
    for doc in docs:
        where_ = [doc["cluster"]] if fed else []
        t.add_row(
            doc["name"], *where_, str(doc["partitions"]), f"{doc['pings']:,}", str(doc["bbox"])
        )
    out.print(t)


@topic.command("delete")
@click.argument("name")
@click.option("--yes", is_flag=True, help="do not ask first")
@where
@click.option("--json", "as_json", is_flag=True)
def topic_delete(
    name: str, yes: bool, cluster: Path | None, servers: str | None, as_json: bool
) -> None:
    """Delete a topic with every ping, offset, consumer group and heat map in it."""
    if not yes:
        click.confirm(f"delete topic {name!r} and every ping in it?", abort=True, err=True)
    with connection(cluster, servers) as conn:
        Admin(conn).delete_topic(name)
        fence = conn.fence  # reads fenced by it no longer see the topic
    if as_json:
        click.echo(json.dumps({"deleted": name, "applied_index": fence}))
    else:
        err.print(f"deleted topic {name}")


@topic.command("describe")
@click.argument("name")
@where
@click.option("--json", "as_json", is_flag=True)
def topic_describe(name: str, cluster: Path | None, servers: str | None, as_json: bool) -> None:
    """One topic: its region, partitions and offsets."""
    with connection(cluster, servers, name) as conn:
        d = Admin(conn).describe(name)
        _print_topic(d, as_json, conn.cluster if directory_given() else None)


def _topic_doc(d: Any, home: str | None = None) -> dict[str, Any]:
    """A topic as JSON; ``home``: its cluster in a federation (``cluster``)."""
    spec = d.topic.spec
    return {
        "name": spec.name,
        **({"cluster": home} if home is not None else {}),
        "id": d.topic.id,
        "partitions": spec.partitions,
        "retention_ms": spec.retention_ms,
        "h3_resolution": spec.h3_resolution,
        "no_open_produce": spec.no_open_produce,
        "contribution_window_ms": spec.contribution_window_ms,
        "contribution_min_pings": min_pings(spec),
        "contribution_min_seconds": min_seconds(spec),
        "bbox": [round(v, 6) for v in d.topic.bbox],
        "region": json.loads(spec.region_geojson),
        "pings": sum(p.next_offset - p.first_offset for p in d.partitions),
        "applied_index": d.applied_index,  # a create's or update's: a read fence
        "offsets": [
            {
                "partition": p.partition,
                "first": p.first_offset,
                "next": p.next_offset,
                "group": p.group,
            }
            for p in d.partitions
        ],
    }


def _print_topic(d: Any, as_json: bool, home: str | None = None) -> None:
    doc = _topic_doc(d, home)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    out.print(
        f"[bold]{doc['name']}[/]"
        + (f" in cluster {home}" if home is not None else "")
        + f" id {doc['id']}, {doc['partitions']} partitions, "
        f"H3 {doc['h3_resolution']}, retention {doc['retention_ms'] / 3600_000:g} h, "
        f"bbox {doc['bbox']}, {doc['pings']:,} pings"
    )
    out.print(
        f"  give-to-get: {doc['contribution_min_pings']} pings over "
        f"{doc['contribution_min_seconds']} s "
        f"within {doc['contribution_window_ms'] / 60000:g} min; "
        + ("closed to self-registered identities" if doc["no_open_produce"] else "open produce")
    )
    for o in doc["offsets"]:
        out.print(
            f"  partition {o['partition']}: offsets {o['first']}..{o['next']}, group {o['group']}"
        )


@topic.command("move")
@click.argument("name")
@click.option("--to", "to", required=True, help="the member cluster to move it to")
@click.option(
    "--tail-pings",
    type=click.IntRange(0),
    default=20_000,
    help="copy while the source takes writes until at most this many are left, then fence",
)
@click.option("--directory", "dd", envvar="ROADLOG_DIRECTORY", required=True, help=DIRECTORY_HELP)
@click.option("--token", help="an admin token good on the directory and both clusters")
@click.option("--json", "as_json", is_flag=True)
def topic_move(
    name: str, to: str, tail_pings: int, dd: str, token: str | None, as_json: bool
) -> None:
    """Move a topic to another member cluster with its pings at their
    offsets, producers, consumer-group offsets and heat maps; producers and
    consumers follow (docs/federation.md, "Topic moves")."""
    from roadlog.federation.directory import Directory
    from roadlog.federation.move import TopicMove
    from roadlog.tools.localdirectory import directory_of

    try:
        d = directory_of(dd)
    except (FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    if token is not None:
        servers, tls = d.conn.servers, d.tls.with_token(token)
        d.close()
        d = Directory(servers, tls=tls)
    try:
        with d:
            report = TopicMove(d, name, to, tail_pings=tail_pings).run()
    except RoadlogError as e:
        raise click.ClickException(str(e)) from None
    doc = report.as_json()
    if as_json:
        click.echo(json.dumps(doc))
    else:
        err.print(
            f"moved topic {name} from {report.source} to {report.target}: "
            f"{report.pings:,} pings ({doc['pings_per_s']:,} a second), "
            f"writes paused {report.fenced_s:.2f} s, {report.producers} producers, "
            f"{report.groups} consumer groups"
        )
