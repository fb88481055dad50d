"""``roadlog heatmap``: build a window's heat map with Spark, show one."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import click

from roadlog.cli.common import cli, client_tls, connection, err, resolve_servers, where
from roadlog.client import Admin, PermissionDenied, RoadlogError
from roadlog.client_tls import ClientTLS
from roadlog.tools.localcluster import LocalCluster, gather_status


@cli.group()
def heatmap() -> None:
    """Traffic heat maps (built by Spark, read under give-to-get)."""


DEFAULT_JOB_SERVER = "127.0.0.1:9460"
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


def _job_token(cluster: Path | None) -> str | None:
    """The job's identity (it commits heat maps: the scope admin): --token,
    else a local cluster's Spark identity, else ROADLOG_TOKEN."""
    explicit = click.get_current_context().meta.get("token")
    token = LocalCluster.load(cluster).spark_token if cluster is not None else None
    return explicit or token or client_tls(cluster).token


def _nodes(servers: list[str], tls: ClientTLS) -> list[str]:
    st = gather_status(servers, [], tls=tls)
    nodes = [n["address"] for n in st["nodes"] if n.get("role") != "down"]
    if not nodes:
        raise click.ClickException("no node answers")
    return nodes


def _job_inputs(
    cluster: Path | None, servers: str | None
) -> tuple[list[str], Path | None, list[str]]:
    """A Spark job's queue servers, the cluster secret (None with TLS: the
    job reads from the nodes with its client certificate alone) and the
    nodes that answer."""
    qs = resolve_servers(cluster, servers)
    secret: Path | None = None
    if cluster is not None:
        lc = LocalCluster.load(cluster)
        secret = None if lc.certs_dir else Path(lc.secret_file)  # with TLS: its certificate
    else:
        ctx = click.get_current_context()
        given = ctx.meta.get("secret_file") or os.environ.get("ROADLOG_SECRET_FILE")
        if given:
            secret = Path(given)
        elif ClientTLS.from_env().insecure:
            raise click.UsageError(
                "without TLS the job reads from the nodes with the cluster token: "
                "--secret-file or ROADLOG_SECRET_FILE"
            )
    # The job's connections take its token from ROADLOG_TOKEN (Spark runs
    # in this process).
    token = _job_token(cluster)
    tls = client_tls(cluster)
    if token:
        os.environ["ROADLOG_TOKEN"] = token
    if cluster is not None:
        # A local cluster's CA and client certificate, for the job's
        # connections and the data source's readers, which take them from
        # the environment (ClientTLS.from_env), as they do the token.
        if tls.insecure:
            os.environ["ROADLOG_INSECURE"] = "1"
        for name, path in (
            ("ROADLOG_CA_FILE", tls.ca_file),
            ("ROADLOG_CERT_FILE", tls.cert_file),
            ("ROADLOG_KEY_FILE", tls.key_file),
        ):
            if path is not None:
                os.environ[name] = str(path)
    return qs, secret, _nodes(qs, tls.with_token(token))


@heatmap.command("build")
@click.argument("name")
@click.option("--since", help="the window is the last this long (15m, 2h; default 15m)")
@click.option("--window", help="START,END (milliseconds or ISO 8601)")
@click.option("--master", default="local[2]", show_default=True, help="or spark://HOST:7077")
@click.option("--out", type=click.Path(path_type=Path), default=Path("out/heatmaps"))
@click.option(
    "--job-server",
    envvar="ROADLOG_HEATMAP_SERVER",
    default=DEFAULT_JOB_SERVER,
    show_default=True,
    help="the warm job server (heatmap serve) to build with when it answers; 'none': never",
)
@click.option("--json", "as_json", is_flag=True)
@where
def heatmap_build(
    name: str,
    since: str | None,
    window: str | None,
    master: str,
    out: Path,
    job_server: str,
    as_json: bool,
    cluster: Path | None,
    servers: str | None,
) -> None:
    """Run the Spark job for one window: the heat map is committed into the
    cluster and written as Parquet, GeoJSON, PNG and HTML under --out. When
    the warm job server (--job-server) answers, it builds the map (its
    files then lie under its own --out) and no Spark starts here."""
    try:
        from spark.jobs.heatmap import AlreadyRunning, lock
    except ImportError as e:
        raise click.ClickException(
            f"heatmap build runs Spark: install roadlog[spark] ({e})"
        ) from None

    start, end = _window(window, since)
    try:
        held = lock(Path(f"/tmp/roadlog-heatmap-{name}.lock"))
    except AlreadyRunning as e:
        err.print(f"not running: {e}")
        return
    try:
        summary = None
        if job_server != "none":
            summary = _through_server(job_server, name, start, end, cluster)
        if summary is None:
            summary = _build_here(name, start, end, master, out, cluster, servers)
    finally:
        held.close()
    if as_json:
        click.echo(json.dumps(summary))
    else:
        out.mkdir(parents=True, exist_ok=True)
        by = f"the job server at {job_server}" if summary.get("server") else "Spark here"
        err.print(
            f"heat map of {name}: {summary['cells']} cells from {summary['pings']:,} pings "
            f"in {summary['seconds']} s ({by}); committed at index {summary['applied_index']}; "
            f"files in {summary['dir']}"
        )


def _through_server(
    address: str, name: str, start: int, end: int, cluster: Path | None
) -> dict[str, Any] | None:
    """The summary of the window built by the job server at ``address``;
    None when it does not answer or refuses (the caller builds)."""
    from spark.job_client import JobRefused, NoServer, submit
    from spark.job_server import JobRequest

    t0 = time.monotonic()
    try:
        with err.status(f"building the heat map of {name!r} with the job server at {address}"):
            doc = submit(address, JobRequest(name, start, end), client_tls(cluster),
                         _job_token(cluster))  # fmt: skip
    except NoServer:
        return None  # as before the server: Spark here
    except JobRefused as e:
        if not e.build_instead:
            raise click.ClickException(f"the job server: {e.reason}") from None
        err.print(f"the job server at {address} refused ({e}); building here")
        return None
    return {**doc, "server": address, "seconds": round(time.monotonic() - t0, 1)}


def _build_here(
    name: str, start: int, end: int, master: str, out: Path, cluster: Path | None,
    servers: str | None,
) -> dict[str, Any]:  # fmt: skip
    from spark.jobs.heatmap import run

    qs, secret, nodes = _job_inputs(cluster, servers)
    try:
        with err.status(f"building the heat map of {name!r} with Spark ({master})"):
            return run(
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


@heatmap.command("stream")
@click.argument("name")
@click.option(
    "--every",
    default="60s",
    show_default=True,
    help="a trigger this often, at multiples of it on the clock (30s, 1m)",
)
@click.option(
    "--window",
    default="15m",
    show_default=True,
    help="each trigger commits the heat map of the window this long ending at it",
)
@click.option(
    "--lateness",
    default="10m",
    show_default=True,
    help="a window takes pings that arrive up to this long after its end",
)
@click.option(
    "--history",
    default="24h",
    show_default=True,
    help="free-flow speeds from this much history (as heatmap build)",
)
@click.option("--master", default="local[2]", show_default=True, help="or spark://HOST:7077")
@click.option(
    "--checkpoint",
    type=click.Path(path_type=Path),
    help="where the stream restarts from (default out/streams/NAME)",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    help="also write each window's Parquet, GeoJSON, PNG and HTML here",
)
@click.option("--metrics-port", type=int, help="serve the stream's Prometheus metrics here")
@click.option("--once", is_flag=True, help="read what is there now, commit, and stop")
@click.option("--json", "as_json", is_flag=True, help="one JSON line per trigger")
@where
def heatmap_stream(
    name: str,
    every: str,
    window: str,
    lateness: str,
    history: str,
    master: str,
    checkpoint: Path | None,
    out: Path | None,
    metrics_port: int | None,
    once: bool,
    as_json: bool,
    cluster: Path | None,
    servers: str | None,
) -> None:
    """Keep the topic's heat map current with Spark Structured Streaming:
    each trigger reads the pings committed since the last one and commits
    the heat map of the last --window into the cluster (the same cells and
    figures as heatmap build of that window). Runs until stopped (Ctrl-C);
    a restart goes on from --checkpoint without losing or counting a ping
    twice."""
    try:
        from pyspark.errors import StreamingQueryException

        from spark.jobs.heatmap import AlreadyRunning, lock, session
        from spark.jobs.heatmap_stream import Metrics, Windows, run_until_stopped, start
    except ImportError as e:
        raise click.ClickException(
            f"heatmap stream runs Spark: install roadlog[spark] ({e})"
        ) from None

    try:
        windows = Windows(_duration_ms(every), _duration_ms(window), _duration_ms(lateness))
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    history_ms = _duration_ms(history)
    if history_ms < windows.window_ms:
        raise click.BadParameter("--history must be at least as long as --window")
    qs, secret, nodes = _job_inputs(cluster, servers)
    checkpoint = checkpoint or Path("out/streams") / name
    try:
        held = lock(checkpoint / "stream.lock")
    except AlreadyRunning as e:
        raise click.ClickException(f"another stream uses {checkpoint}: {e}") from None

    def report(s: dict[str, Any]) -> None:
        if as_json:
            click.echo(json.dumps(s))
            return
        ending = time.strftime("%H:%M:%S", time.gmtime(s["end"] / 1000))
        err.print(
            f"{name}: window ending {ending} UTC, {s['cells']} cells from {s['pings']:,} pings "
            f"({s['new_pings']:,} new, {s['late']} late, {s['too_late']} too late); "
            f"{len(s['windows'])} window(s) committed in {s['seconds']} s"
        )

    metrics = Metrics()
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port)
    spark = session(master, app="roadlog-heatmap-stream")
    try:
        query = start(
            spark,
            topic=name,
            nodes=nodes,
            servers=qs,
            secret_file=secret,
            cluster_name=click.get_current_context().meta.get("cluster_name") or "roadlog",
            checkpoint=checkpoint,
            windows=windows,
            history_ms=history_ms,
            out_dir=out,
            once=once,
            metrics=metrics,
            report=report,
        )
        err.print(
            f"streaming the heat map of {name!r} every {every} (window {window}, lateness "
            f"{lateness}) with Spark ({master}); checkpoint {checkpoint}"
            + ("" if once else "; Ctrl-C stops")
        )
        run_until_stopped(query, err.print)  # Ctrl-C or SIGTERM: between triggers
    except RoadlogError as e:
        raise click.ClickException(str(e)) from None
    except StreamingQueryException as e:  # what a micro-batch raised; the checkpoint stays
        raise click.ClickException(f"the stream stopped: {e.getMessage()}") from None
    finally:
        spark.stop()
        held.close()


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


@heatmap.command("serve")
@click.option(
    "--listen",
    default=DEFAULT_JOB_SERVER,
    show_default=True,
    help="HOST:PORT of the job server (jobs, /metrics, /healthz, /readyz)",
)
@click.option("--master", default="local[2]", show_default=True, help="or spark://HOST:7077")
@click.option("--out", type=click.Path(path_type=Path), default=Path("out/heatmaps"))
@click.option(
    "--history",
    default="24h",
    show_default=True,
    help="free-flow speeds from this much history (a job may say another)",
)
@click.option(
    "--certs-dir",
    type=click.Path(path_type=Path),
    envvar="ROADLOG_SERVE_CERTS_DIR",
    help="the server's certificate of the cluster's CA (queue.crt, else node.crt, in it); "
    "default with --cluster: its first queue server's",
)
@click.option(
    "--metrics-token-file",
    type=click.Path(path_type=Path),
    help="/metrics and the health checks ask for this bearer token (else anyone may read them)",
)
@where
def heatmap_serve(
    listen: str,
    master: str,
    out: Path,
    history: str,
    certs_dir: Path | None,
    metrics_token_file: Path | None,
    cluster: Path | None,
    servers: str | None,
) -> None:
    """The warm job server: one long-lived Spark session on --master that
    builds heat maps on request (heatmap build and the cron job use it when
    it answers), so a small window does not pay a JVM's start. Jobs come
    over TLS (the server's certificate of the cluster's CA) with the
    heat-map identity's token; runs until stopped (Ctrl-C, SIGTERM)."""
    import signal

    try:
        from spark.job_server import JobRequest, JobServer
        from spark.jobs.heatmap import run, session, warm_up
    except ImportError as e:
        raise click.ClickException(
            f"heatmap serve runs Spark: install roadlog[spark] ({e})"
        ) from None
    from roadlog.runtime.config import ConfigError
    from roadlog.runtime.health import NO_AUTH, metrics_auth

    history_ms = _duration_ms(history)
    qs, secret, _ = _job_inputs(cluster, servers)
    token = _job_token(cluster)
    if not token:
        raise click.UsageError("the job server needs the heat-map identity's token: --token")
    tls = client_tls(cluster)
    try:
        ctx = None if tls.insecure else _server_ssl(certs_dir, cluster)
        auth = (
            metrics_auth("token", metrics_token_file, tls.insecure)
            if metrics_token_file
            else NO_AUTH
        )
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
    cluster_name = click.get_current_context().meta.get("cluster_name") or "roadlog"
    spark = session(master, app="roadlog-heatmap-serve")
    warm_up(spark)  # the session's first job (and Python workers) before a caller's
    jobs = {"n": 0}

    def build(job: JobRequest) -> dict[str, Any]:
        summary = run(
            topic=job.topic,
            nodes=_nodes(qs, tls.with_token(token)),
            servers=qs,
            secret_file=secret,
            cluster_name=cluster_name,
            window_start_ms=job.window_start_ms,
            window_end_ms=job.window_end_ms,
            master=master,
            out_dir=out,
            history_ms=history_ms if job.history_ms is None else job.history_ms,
            spark=spark,
        )
        jobs["n"] += 1
        return summary

    def ready() -> tuple[bool, dict[str, Any]]:
        alive = not spark.sparkContext._jsc.sc().isStopped()
        return alive, {"role": "heatmap-server", "master": master, "jobs": jobs["n"]}

    host, _, port = listen.rpartition(":")
    try:
        server = JobServer(
            (host.strip("[]") or "0.0.0.0", int(port)),
            build=build,
            ready=ready,
            token=token,
            ssl_context=ctx,
            metrics_auth=auth,
        )
    except (OSError, ValueError) as e:
        spark.stop()
        raise click.ClickException(f"--listen {listen}: {e}") from None

    def stop(signum: int, frame: Any) -> None:
        import threading

        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    scheme = "http" if ctx is None else "https"
    err.print(
        f"heat-map job server on {scheme}://{host}:{server.server_port} with Spark ({master}); "
        "Ctrl-C stops"
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        spark.stop()


def _server_ssl(certs_dir: Path | None, cluster: Path | None) -> Any:
    """The job server's TLS context: a queue server's certificate, else a
    node's, in ``certs_dir`` (with --cluster: its first queue server's)."""
    from roadlog.runtime.config import ConfigError
    from roadlog.runtime.tls import Credentials

    if certs_dir is None and cluster is not None:
        certs_dir = Path(LocalCluster.load(cluster).queue_servers[0].certs_dir)
    if certs_dir is None:
        raise click.UsageError("with TLS the job server needs its certificate: --certs-dir")
    last: ConfigError | None = None
    for kind in ("queue", "node"):
        try:
            return Credentials.load(certs_dir, kind).server_ssl(mutual=False)
        except ConfigError as e:
            last = e
    assert last is not None
    raise last
