"""``roadlog``: the command line for clusters, topics, producing and consuming.

Every command finds the cluster by ``--cluster DIR`` (a local cluster made
by ``cluster up``), ``--servers HOST:PORT,...`` or ROADLOG_SERVERS.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from discovery.listen import find_queue_servers
from roadlog import columnar
from roadlog.client import (
    Admin,
    Connection,
    Consumer,
    GroupConsumer,
    PermissionDenied,
    Producer,
    RoadlogError,
    servers_from_env,
)
from roadlog.geo import RegionError, bbox_region, parse_region
from roadlog.localcluster import LocalCluster, alive, gather_status
from roadlog.readers import InputError, read_pings
from roadlog.runtime.config import read_secret
from roadlog.traffic import TrafficSpec, simulate

DIR_HELP = "a local cluster's DIR (--cluster and --dir are the same)"
err = Console(stderr=True)
out = Console()


def _servers(cluster: Path | None, servers: str | None) -> list[str]:
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


def _local(directory: Path, action: Callable[[LocalCluster], T]) -> T:
    """Run ``action`` on the local cluster in DIR; a missing cluster or node
    is a clear error, not a traceback."""
    try:
        return action(LocalCluster.load(directory))
    except (FileNotFoundError, KeyError) as e:
        raise click.ClickException(str(e).strip("'\"")) from None


def _discovered(meta: dict[str, Any]) -> list[str]:
    secret_file = meta.get("secret_file") or os.environ.get("ROADLOG_SECRET_FILE")
    if not secret_file:
        raise click.UsageError(
            "--discover needs the cluster secret: --secret-file or ROADLOG_SECRET_FILE"
        )
    try:
        secret = read_secret(Path(secret_file))
        found = find_queue_servers(
            secret, meta.get("cluster_name"), meta.get("discovery_port", 7499)
        )
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


def where(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option("--servers", help="queue servers HOST:PORT,... (or ROADLOG_SERVERS)")(f)
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
        "--secret-file",
        expose_value=False,
        callback=_meta("secret_file"),
        help="with --discover: the cluster secret (or ROADLOG_SECRET_FILE)",
    )(f)
    f = click.option(
        "--cluster-name", expose_value=False, callback=_meta("cluster_name"), help="with --discover"
    )(f)
    f = click.option(
        "--discovery-port", type=int, expose_value=False, callback=_meta("discovery_port")
    )(f)
    return f


@contextmanager
def connection(cluster: Path | None, servers: str | None) -> Iterator[Connection]:
    try:
        conn = Connection(_servers(cluster, servers))
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    try:
        yield conn
    except RoadlogError as e:
        raise click.ClickException(str(e)) from None
    finally:
        conn.close()


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
def cli() -> None:
    """roadlog: GPS pings replicated with Raft, turned into traffic heat maps."""


# ------------------------------------------------------------------- cluster


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
def cluster_up(nodes: int, queue_servers: int, directory: Path, timeout: float) -> None:
    """Start node daemons and queue servers, wait for a leader, write DIR/cluster.json."""
    if nodes < 1 or queue_servers < 1:
        raise click.BadParameter("need at least one node and one queue server")
    try:
        lc = LocalCluster.create(directory, nodes, queue_servers)
    except FileExistsError as e:
        raise click.ClickException(str(e)) from None
    lc.start_all()
    with err.status("waiting for a leader") as st:
        try:
            status = lc.wait_ready(timeout, progress=lambda s: st.update(f"waiting: {s}"))
        except TimeoutError as e:
            lc.down()
            raise click.ClickException(f"{e}; logs in {directory / 'logs'}") from None
    err.print(
        f"cluster up: {nodes} nodes, leader {status['leader']} (term {status['term']}); "
        f"queue servers {', '.join(lc.servers)}; {lc.file}"
    )
    out.print(",".join(lc.servers))


@cluster.command("status")
@where
@click.option("--json", "as_json", is_flag=True, help="machine-readable")
def cluster_status(cluster: Path | None, servers: str | None, as_json: bool) -> None:
    """Leader, term, and each node's role and indexes."""
    if cluster is not None:
        st = _local(cluster, LocalCluster.status)
    else:
        st = gather_status(_servers(None, servers), [])
    if as_json:
        click.echo(json.dumps(st, indent=2))
        return
    t = Table(title=f"leader {st['leader'] or '-'}, term {st['term']}")
    for col in ("id", "address", "role", "term", "commit", "applied", "ready"):
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
        )
    out.print(t)
    for q in st["queue_servers"]:
        out.print(f"queue server {q['grpc']}" + (f" {q['http']}" if q.get("http") else ""))


@cluster.command("kill")
@click.argument("node")
@click.option(
    "--dir", "--cluster", "directory", type=click.Path(path_type=Path), required=True, help=DIR_HELP
)
def cluster_kill(node: str, directory: Path) -> None:
    """SIGKILL one node of a local cluster."""
    n = _local(directory, lambda lc: lc.kill(node))
    err.print(f"killed node {n.id}")


@cluster.command("start")
@click.argument("node")
@click.option(
    "--dir", "--cluster", "directory", type=click.Path(path_type=Path), required=True, help=DIR_HELP
)
def cluster_start(node: str, directory: Path) -> None:
    """Start a stopped node of a local cluster again (with its data)."""
    n = _local(directory, lambda lc: lc.start(node))
    err.print(f"started node {n.id} (pid {n.pid})")


@cluster.command("down")
@click.option(
    "--dir", "--cluster", "directory", type=click.Path(path_type=Path), required=True, help=DIR_HELP
)
def cluster_down(directory: Path) -> None:
    """Stop every process of a local cluster (data stays in DIR)."""
    lc = _local(directory, lambda lc: lc)
    lc.down()
    left = [p.pid for p in [*lc.nodes, *lc.queue_servers] if p.pid and alive(p.pid)]
    err.print("cluster down" + (f"; still running: {left}" if left else ""))


# --------------------------------------------------------------------- topics


@cli.group()
def topic() -> None:
    """Create, list, describe and delete topics (city regions)."""


@topic.command("create")
@click.argument("name")
@click.option("--region", type=click.Path(exists=True, path_type=Path), help="GeoJSON Polygon file")
@click.option("--bbox", help="MINLON,MINLAT,MAXLON,MAXLAT")
@click.option("--partitions", type=int, default=0, help="default 8")
@click.option("--retention-hours", type=float, default=0.0, help="default 168")
@click.option("--h3-resolution", type=int, default=0, help="default 9")
@where
@click.option("--json", "as_json", is_flag=True)
def topic_create(
    name: str,
    region: Path | None,
    bbox: str | None,
    partitions: int,
    retention_hours: float,
    h3_resolution: int,
    cluster: Path | None,
    servers: str | None,
    as_json: bool,
) -> None:
    """Create a topic for a region."""
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
    with connection(cluster, servers) as conn:
        d = Admin(conn).create_topic(
            name, geo.geojson, partitions, int(retention_hours * 3600_000), h3_resolution
        )
    _print_topic(d, as_json)


@topic.command("list")
@where
@click.option("--json", "as_json", is_flag=True)
def topic_list(cluster: Path | None, servers: str | None, as_json: bool) -> None:
    """The topics and their sizes."""
    with connection(cluster, servers) as conn:
        topics = Admin(conn).list_topics()
    if as_json:
        click.echo(json.dumps([_topic_doc(d) for d in topics], indent=2))
        return
    t = Table()
    for col in ("name", "partitions", "pings", "bbox"):
        t.add_column(col)
    for d in topics:
        doc = _topic_doc(d)
        t.add_row(doc["name"], str(doc["partitions"]), f"{doc['pings']:,}", str(doc["bbox"]))
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
    with connection(cluster, servers) as conn:
        _print_topic(Admin(conn).describe(name), as_json)


def _topic_doc(d: Any) -> dict[str, Any]:
    spec = d.topic.spec
    return {
        "name": spec.name,
        "id": d.topic.id,
        "partitions": spec.partitions,
        "retention_ms": spec.retention_ms,
        "h3_resolution": spec.h3_resolution,
        "bbox": [round(v, 6) for v in d.topic.bbox],
        "region": json.loads(spec.region_geojson),
        "pings": sum(p.next_offset - p.first_offset for p in d.partitions),
        "offsets": [
            {"partition": p.partition, "first": p.first_offset, "next": p.next_offset}
            for p in d.partitions
        ],
    }


def _print_topic(d: Any, as_json: bool) -> None:
    doc = _topic_doc(d)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    out.print(
        f"[bold]{doc['name']}[/] id {doc['id']}, {doc['partitions']} partitions, "
        f"H3 {doc['h3_resolution']}, retention {doc['retention_ms'] / 3600_000:g} h, "
        f"bbox {doc['bbox']}, {doc['pings']:,} pings"
    )
    for o in doc["offsets"]:
        out.print(f"  partition {o['partition']}: offsets {o['first']}..{o['next']}")


# ------------------------------------------------------------ produce/consume


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
    with connection(cluster, servers) as conn:
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
    with connection(cluster, servers) as conn:
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
    with connection(cluster, servers) as conn:
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
    out.print(f"group {g.name} on topic {g.topic}, generation {g.generation}")
    t = Table("member", "client", "partitions")
    for m in g.members:
        t.add_row(m.member_id, m.client_id, ",".join(map(str, m.partitions)))
    out.print(t)
    t = Table("partition", "committed offset")
    for o in d.offsets:
        t.add_row(str(o.partition), str(o.offset))
    out.print(t)


def _group_json(d: Any) -> dict[str, Any]:
    g = d.group
    return {
        "group": g.name,
        "topic": g.topic,
        "generation": g.generation,
        "session_timeout_ms": g.session_timeout_ms,
        "members": [
            {"member_id": m.member_id, "client_id": m.client_id, "partitions": list(m.partitions)}
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


@cli.group()
def heatmap() -> None:
    """Traffic heat maps (built by Spark, read under give-to-get)."""


_UNITS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def _duration_ms(text: str) -> int:
    try:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    except (KeyError, ValueError, IndexError):
        raise click.BadParameter(f"{text!r}: a number and s, m, h or d (15m, 2h)") from None


def _instant_ms(text: str) -> int:
    from datetime import datetime

    if text.isdigit():
        return int(text)
    try:
        return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)
    except ValueError:
        raise click.BadParameter(f"{text!r}: milliseconds or an ISO 8601 time") from None


def _window(window: str | None, since: str | None) -> tuple[int, int]:
    if window and since:
        raise click.UsageError("--window and --since exclude each other")
    if window:
        parts = window.split(",")
        if len(parts) != 2:
            raise click.BadParameter("--window START,END")
        start, end = _instant_ms(parts[0]), _instant_ms(parts[1])
        if end <= start:
            raise click.BadParameter("--window: END must come after START")
        return start, end
    end = int(time.time() * 1000)
    return end - _duration_ms(since or "15m"), end


@heatmap.command("build")
@click.argument("name")
@click.option("--since", help="the window is the last this long (15m, 2h; default 15m)")
@click.option("--window", help="START,END (milliseconds or ISO 8601)")
@click.option("--master", default="local[2]", show_default=True, help="or spark://HOST:7077")
@click.option("--out", type=click.Path(path_type=Path), default=Path("out/heatmaps"))
@click.option("--json", "as_json", is_flag=True)
@where
def heatmap_build(
    name: str,
    since: str | None,
    window: str | None,
    master: str,
    out: Path,
    as_json: bool,
    cluster: Path | None,
    servers: str | None,
) -> None:
    """Run the Spark job for one window: the heat map is committed into the
    cluster and written as Parquet, GeoJSON, PNG and HTML under --out."""
    try:
        from spark.jobs.heatmap import AlreadyRunning, lock, run
    except ImportError as e:
        raise click.ClickException(
            f"heatmap build runs Spark: install roadlog[spark] ({e})"
        ) from None

    start, end = _window(window, since)
    qs = _servers(cluster, servers)
    if cluster is not None:
        secret = Path(LocalCluster.load(cluster).secret_file)
    else:
        ctx = click.get_current_context()
        given = ctx.meta.get("secret_file") or os.environ.get("ROADLOG_SECRET_FILE")
        if not given:
            raise click.UsageError(
                "the job reads from the nodes: --secret-file or ROADLOG_SECRET_FILE"
            )
        secret = Path(given)
    st = gather_status(qs, [])
    nodes = [n["address"] for n in st["nodes"] if n.get("role") != "down"]
    if not nodes:
        raise click.ClickException("no node answers")
    try:
        held = lock(Path(f"/tmp/roadlog-heatmap-{name}.lock"))
    except AlreadyRunning as e:
        err.print(f"not running: {e}")
        return
    try:
        with err.status(f"building the heat map of {name!r} with Spark ({master})"):
            summary = run(
                topic=name,
                nodes=nodes,
                servers=qs,
                secret_file=secret,
                cluster_name=click.get_current_context().meta.get("cluster_name") or "roadlog",
                window_start_ms=start,
                window_end_ms=end,
                master=master,
                out_dir=out,
            )
    except RoadlogError as e:
        raise click.ClickException(str(e)) from None
    finally:
        held.close()
    if as_json:
        click.echo(json.dumps(summary))
    else:
        out.mkdir(parents=True, exist_ok=True)
        err.print(
            f"heat map of {name}: {summary['cells']} cells from {summary['pings']:,} pings "
            f"in {summary['seconds']} s; committed at index {summary['applied_index']}; "
            f"files in {summary['dir']}"
        )


@heatmap.command("get")
@click.argument("name")
@click.option("--window", help="the window's START (milliseconds or ISO 8601); default: latest")
@click.option("--png", type=click.Path(path_type=Path))
@click.option("--geojson", type=click.Path(path_type=Path))
@click.option("--html", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True)
@where
def heatmap_get(
    name: str,
    window: str | None,
    png: Path | None,
    geojson: Path | None,
    html: Path | None,
    as_json: bool,
    cluster: Path | None,
    servers: str | None,
) -> None:
    """The latest heat map (or one window's) for this client: allowed only if
    this client sent pings to the region lately (give-to-get)."""
    from roadlog.heatmap_render import geojson as to_geojson
    from roadlog.heatmap_render import write_geojson, write_html, write_png

    start = _instant_ms(window) if window else 0
    with connection(cluster, servers) as conn:
        try:
            resp = Admin(conn).heatmap(name, window_start_ms=start)
        except PermissionDenied as e:
            raise click.ClickException(f"not allowed: {e.reason}") from None
    hm = resp.heatmap
    if png:
        write_png(hm, png)
    if geojson:
        write_geojson(hm, geojson)
    if html:
        write_html(hm, html)
    if as_json:
        doc = to_geojson(hm)
        doc["properties"]["windows"] = list(resp.windows)
        click.echo(json.dumps(doc))
        return
    c = hm.cells
    worst = max(
        range(len(c.h3)),
        key=lambda i: (c.congestion[i] if c.congestion else 0) * c.pings[i],
        default=None,
    )
    err.print(
        f"{name}: window {hm.window_start_ms}..{hm.window_end_ms}, {len(c.h3)} cells, "
        f"{hm.source_pings:,} pings"
        + (f"; most congested busy cell {c.h3[worst]:x}" if worst is not None else "")
    )
    for label, path in (("PNG", png), ("GeoJSON", geojson), ("HTML", html)):
        if path:
            err.print(f"{label}: {path}")


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
