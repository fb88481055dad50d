"""Producing and consuming pings: ``produce``, ``simulate``, ``consume`` and
``group`` (consumer groups)."""

from __future__ import annotations

import csv
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from roadlog import columnar
from roadlog.cli.common import cli, connection, err, out, progress, where
from roadlog.client import Admin, Consumer, GroupConsumer, Producer
from roadlog.geo import parse_region
from roadlog.readers import InputError, read_pings
from roadlog.tools.traffic import TrafficSpec, simulate


@cli.command()
@click.argument("name")
@click.option(
    "--file",
    "path",
    type=click.Path(exists=True, path_type=Path),
    required=True,
    help="CSV (device_id,ts_ms,lat,lon,speed_mps,heading_deg), GPX or GeoJSON points",
)
@where
@click.option("--json", "as_json", is_flag=True)
def produce(
    name: str, path: Path, cluster: Path | None, servers: str | None, as_json: bool
) -> None:
    """Send the pings of a file; prints how many were acknowledged."""
    with connection(cluster, servers, name) as conn:
        p = Producer(conn, name)
        try:
            with progress(known_total=False) as bar:
                task = bar.add_task("producing", total=None)
                for cols in read_pings(path):
                    p.send_batch(cols)
                    bar.update(task, advance=len(cols))
        except InputError as e:
            raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps({"acknowledged": p.acked}))
    else:
        out.print(f"{p.acked} pings acknowledged")


@cli.command("simulate")
@click.argument("name")
@click.option("--vehicles", default=200, show_default=True)
@click.option("--duration", default=300, show_default=True, help="seconds of driving to simulate")
@click.option("--hotspot", multiple=True, help="LON,LAT of a jam (repeatable)")
@click.option("--seed", default=1, show_default=True)
@where
@click.option("--json", "as_json", is_flag=True)
def simulate_cmd(
    name: str,
    vehicles: int,
    duration: int,
    hotspot: tuple[str, ...],
    seed: int,
    cluster: Path | None,
    servers: str | None,
    as_json: bool,
) -> None:
    """Drive synthetic traffic along a street grid inside the topic's region
    (faster than real time; slow traffic around hot spots)."""
    try:
        spots = tuple(tuple(float(v) for v in h.split(",")) for h in hotspot)
        if any(len(s) != 2 for s in spots):
            raise ValueError
    except ValueError:
        raise click.BadParameter("--hotspot wants LON,LAT") from None
    with connection(cluster, servers) as conn:
        d = Admin(conn).describe(name)
        region = parse_region(d.topic.spec.region_geojson)
        spec = TrafficSpec(vehicles, duration, int(time.time() * 1000), spots, seed=seed)  # type: ignore[arg-type]
        p = Producer(conn, name)
        with progress() as bar:
            task = bar.add_task("simulating", total=vehicles * duration)
            for cols in simulate(region, spec):
                if len(cols):
                    p.send_batch(cols)
                bar.update(task, advance=len(cols))  # one ping per vehicle and second
    if as_json:
        click.echo(
            json.dumps({"acknowledged": p.acked, "vehicles": vehicles, "duration_s": duration})
        )
    else:
        out.print(f"{p.acked} pings acknowledged from {vehicles} vehicles over {duration} s")


@cli.command()
@click.argument("name")
@click.option("--partition", type=int, help="one partition (default: all)")
@click.option("--offset", type=int, help="start here")
@click.option("--from-beginning", is_flag=True, help="start at the oldest retained ping")
@click.option("--limit", type=int, help="at most this many pings per partition")
@click.option(
    "--format", "fmt", type=click.Choice(["csv", "jsonl"]), default="csv", show_default=True
)
@click.option(
    "--group",
    help="read as a member of this consumer group: the partitions the cluster assigns, "
    "from the group's committed offsets; runs until stopped and commits as it goes",
)
@click.option("--idle-exit", type=float, help="with --group: stop after this many idle seconds")
@click.option(
    "--session-timeout-ms",
    type=int,
    default=10_000,
    show_default=True,
    help="with --group: silence after which the cluster expires this member",
)
@where
def consume(
    name: str,
    partition: int | None,
    offset: int | None,
    from_beginning: bool,
    limit: int | None,
    fmt: str,
    group: str | None,
    idle_exit: float | None,
    session_timeout_ms: int,
    cluster: Path | None,
    servers: str | None,
) -> None:
    """Read pings up to the current end and print them (or, with --group,
    keep reading as a group member until stopped)."""
    if offset is not None and from_beginning:
        raise click.UsageError("--offset and --from-beginning exclude each other")
    if group is not None:
        if partition is not None or offset is not None or from_beginning or limit is not None:
            raise click.UsageError(
                "--group takes no --partition, --offset, --from-beginning or --limit"
            )
        _consume_group(name, group, fmt, idle_exit, session_timeout_ms, cluster, servers)
        return
    with connection(cluster, servers, name) as conn:
        d = Admin(conn).describe(name)
        parts = [partition] if partition is not None else list(range(d.topic.spec.partitions))
        if any(p < 0 or p >= d.topic.spec.partitions for p in parts):
            raise click.BadParameter(f"partition must be in 0..{d.topic.spec.partitions - 1}")
        c = Consumer(conn, name)
        writer = csv.writer(sys.stdout) if fmt == "csv" else None
        if writer is not None:
            writer.writerow(_HEADER)
        for p in parts:
            info = d.partitions[p]
            start = info.first_offset if (from_beginning or offset is None) else offset
            c.seek(p, start)
            for b in c.read_to_end(p, limit):
                _emit(b, writer)


_HEADER = list(columnar.PING_FIELDS)


def _consume_group(
    name: str,
    group: str,
    fmt: str,
    idle_exit: float | None,
    session_timeout_ms: int,
    cluster: Path | None,
    servers: str | None,
) -> None:
    """Read as a group member until SIGTERM/SIGINT (or idle for
    ``idle_exit`` s): print each batch, flush, then commit its offsets (at
    least once: a crash between the two repeats the batch, never skips it)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with connection(cluster, servers, name) as conn:
        gc = GroupConsumer(conn, name, group, session_timeout_ms=session_timeout_ms)
        writer = csv.writer(sys.stdout) if fmt == "csv" else None
        if writer is not None:
            writer.writerow(_HEADER)
        gc.join()
        err.print(
            f"member {gc.member_id} of {group!r}, generation {gc.generation}, "
            f"partitions {gc.assigned}"
        )
        idle_since = time.monotonic()
        try:
            while not stop.is_set():
                batches = gc.poll()
                if not batches:
                    gc.commit()
                    if idle_exit is not None and time.monotonic() - idle_since > idle_exit:
                        break
                    stop.wait(0.2)
                    continue
                idle_since = time.monotonic()
                for b in batches:
                    _emit(b, writer)
                sys.stdout.flush()
                gc.commit()
        finally:
            gc.close()


@cli.group("group")
def group_cmd() -> None:
    """Consumer groups."""


@group_cmd.command("list")
@where
@click.option("--json", "as_json", is_flag=True)
def group_list(cluster: Path | None, servers: str | None, as_json: bool) -> None:
    """Every consumer group, its topic, generation and members."""
    with connection(cluster, servers) as conn:
        groups = Admin(conn).list_groups()
    if as_json:
        click.echo(json.dumps([_group_json(d) for d in groups], indent=2))
        return
    t = Table("group", "topic", "generation", "members")
    for d in groups:
        g = d.group
        t.add_row(g.name, g.topic, str(g.generation), str(len(g.members)))
    out.print(t)


@group_cmd.command("describe")
@click.argument("name")
@where
@click.option("--json", "as_json", is_flag=True)
def group_describe(name: str, cluster: Path | None, servers: str | None, as_json: bool) -> None:
    """A group's members, their partitions and the committed offsets."""
    with connection(cluster, servers) as conn:
        d = Admin(conn).describe_group(name)
    if as_json:
        click.echo(json.dumps(_group_json(d), indent=2))
        return
    g = d.group
    owner = f", created by {g.owner}" if g.owner else ""
    out.print(f"group {g.name} on topic {g.topic}, generation {g.generation}{owner}")
    t = Table("member", "client", "partitions")
    for m in g.members:
        t.add_row(m.member_id, m.client_id, ",".join(map(str, m.partitions)))
    out.print(t)
    t = Table("partition", "committed offset")
    for o in d.offsets:
        t.add_row(str(o.partition), str(o.offset))
    out.print(t)


@group_cmd.command("delete")
@click.argument("name")
@click.option("--yes", is_flag=True, help="do not ask first")
@where
@click.option("--json", "as_json", is_flag=True)
def group_delete(
    name: str, yes: bool, cluster: Path | None, servers: str | None, as_json: bool
) -> None:
    """Delete a group no member is in any more, with its committed offsets."""
    if not yes:
        click.confirm(f"delete group {name!r} and its committed offsets?", abort=True, err=True)
    with connection(cluster, servers) as conn:
        index = Admin(conn).delete_group(name)
    if as_json:
        click.echo(json.dumps({"deleted": name, "applied_index": index}))
    else:
        err.print(f"deleted group {name}")


def _group_json(d: Any) -> dict[str, Any]:
    g = d.group
    return {
        "group": g.name,
        "topic": g.topic,
        "generation": g.generation,
        "session_timeout_ms": g.session_timeout_ms,
        "owner": g.owner,  # the identity it counts against ("": none)
        "empty_since_ms": g.empty_since_ms,  # 0: members are in it
        "members": [
            {
                "member_id": m.member_id,
                "client_id": m.client_id,
                "partitions": list(m.partitions),
                "revoking": list(m.revoking),
            }
            for m in g.members
        ],
        "offsets": {str(o.partition): o.offset for o in d.offsets},
    }


def _emit(b: Any, writer: Any) -> None:
    for row in columnar.rows(b.pings, b.partition, b.base_offset, digits=3):
        if writer is not None:
            writer.writerow(["" if v is None else v for v in row])
        else:
            click.echo(json.dumps(dict(zip(_HEADER, row, strict=True))))
