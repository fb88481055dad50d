"""Replicated ingest: roadlog (3 nodes, through the queue server) against
NATS JetStream (3 servers, 3 replicas, file storage, fsync before ack), the
same pings packed the same number per message, the same number of
concurrent async publishers. Reports pings/s, ack latency p50/p99, server
CPU-seconds per million pings (server processes only, from /proc; the
client left out) with each process's share of a core, and the ratios
roadlog/JetStream of throughput and of CPU per ping. Both clients run on the same event loop (uvloop
when installed, as the daemons do). Writes bench/results/ingest.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shlex
import sys
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np

from bench.common import write_result
from bench.cpu import CpuMeter, spawned_children
from bench.peers import NatsCluster, nats_cluster, nats_stream, percentile, roadlog_cluster
from roadlog import columnar
from roadlog.cli.cluster import raft_groups
from roadlog.client import Admin, Connection
from roadlog.client_tls import ClientTLS
from roadlog.columnar import PingColumns
from roadlog.errors import NotFound
from roadlog.partitioning import partition_of
from roadlog.publisher import Publisher
from roadlog.runtime import eventloop
from roadlog.tools.localcluster import LocalCluster
from roadlog.v1 import client_pb2, pings_pb2

PING_BYTES = 36
# The standard load: 32 publishers, as issue 17's and 18's figures are stated.
DEFAULT_CONCURRENCY = 32


def batch_request(pings: int, devices: list[str] | None = None) -> bytes:
    """A publish of ``pings`` pings of 64 devices (``devices``: these)."""
    now = int(time.time() * 1000)
    fleet = devices or [f"dev-{i}" for i in range(64)]
    cols = PingColumns.from_columns(
        [fleet[i % len(fleet)] for i in range(pings)],
        np.full(pings, now, dtype=np.int64),
        np.full(pings, 48.1),
        np.full(pings, 11.5),
        speed_mps=np.full(pings, 10.0, dtype=np.float32),
    )
    req = client_pb2.PublishRequest(
        topic="bench", batch=pings_pb2.PingBatch.FromString(columnar.encode(cols))
    )
    return req.SerializeToString()


async def drive(
    send: Any, concurrency: int, seconds: float, pings: int, meter: CpuMeter | None = None
) -> dict[str, Any]:
    """``concurrency`` workers each awaiting ``send()`` in turn for ``seconds``;
    with a meter, the server processes' CPU over exactly that window."""
    lat: list[float] = []
    done = 0
    errors = 0
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done, errors
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            try:
                await send()
            except Exception:
                errors += 1
                continue
            lat.append(time.perf_counter() - t0)
            done += 1

    if meter is not None:
        meter.start()
    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed, client_cpu = time.perf_counter() - t0, time.process_time() - c0
    out: dict[str, Any] = {
        "messages": done,
        "errors": errors,
        "pings_per_s": round(done * pings / elapsed, 1),
        "ack_p50_ms": round(percentile(lat, 0.5) * 1000, 2),
        "ack_p99_ms": round(percentile(lat, 0.99) * 1000, 2),
        # The client (this process, every thread): what the senders cost,
        # which shares the machine's cores with the servers.
        "client_cpu_s_per_m_pings": round(client_cpu / max(done * pings, 1) * 1e6, 3),
        "client_cores": round(client_cpu / elapsed, 3),
    }
    if meter is not None:
        out |= meter.stop(done * pings)
    return out


def group_fleets(partition_groups: list[int], per_group: int = 64) -> dict[int, list[str]]:
    """For a topic placed in data groups: ``per_group`` device ids whose
    partitions lie in each group, so that each message is one group's (as a
    gateway that partitions its devices, Kafka-style, sends them)."""
    fleets: dict[int, list[str]] = {g: [] for g in sorted(set(partition_groups))}
    i = 0
    while any(len(f) < per_group for f in fleets.values()):
        d = f"dev-{i}"
        f = fleets[partition_groups[partition_of(d, len(partition_groups))]]
        if len(f) < per_group:
            f.append(d)
        i += 1
    return fleets


async def grouped_case(
    servers: list[str],
    pings: int,
    concurrency: int,
    seconds: float,
    meter: CpuMeter | None,
    tls: ClientTLS,
    partition_groups: list[int],
) -> dict[str, Any]:
    """Multi-raft's fast path: each publisher sends messages of one data
    group's devices (publishers spread over the groups in turn) through a
    ``Publisher(group=g)``, so each goes straight to that group's leader;
    with several queue servers, the groups' publishers go to them in turn."""
    fleets = group_fleets(partition_groups)
    payloads = {g: batch_request(pings, fleet) for g, fleet in fleets.items()}
    pubs = {
        g: Publisher([servers[k % len(servers)]], tls=tls, group=g)
        for k, g in enumerate(sorted(fleets))
    }
    turn = itertools.cycle(sorted(fleets))
    try:
        mine: dict[int, int] = {}  # worker task -> its group

        async def send() -> None:
            task = id(asyncio.current_task())
            g = mine.setdefault(task, next(turn))
            await pubs[g].publish(payloads[g])

        await drive(send, concurrency, 1.0, pings)  # warm up
        out = await drive(send, concurrency, seconds, pings, meter)
        calls = sum(p.stats.calls for p in pubs.values())
        out["publishes_per_call"] = round(
            sum(p.stats.sent for p in pubs.values()) / max(calls, 1), 1
        )
        return out
    finally:
        for p in pubs.values():
            await p.close()


async def roadlog_case(
    servers: list[str],
    pings: int,
    concurrency: int,
    seconds: float,
    meter: CpuMeter | None = None,
    corked: bool = True,
    tls: ClientTLS | None = None,
    partition_groups: list[int] | None = None,
    clients: int = 1,
) -> dict[str, Any]:
    """Corked (the default): publishes go through roadlog.publisher, which
    sends the publishes made while earlier calls are out together in one
    PublishBatch call (as nats-py buffers publishes into one socket write);
    each publish is still validated, stored and acknowledged on its own.
    Not corked: one unary Publish call per message. ``tls``: how to dial
    the queue server (plaintext when None). ``partition_groups``: the
    topic's map when it is placed in data groups (the fast path). With
    several ``servers`` (queue servers), the publishers are spread over
    them, a corked Publisher each; ``clients`` Publishers a queue server
    (separate clients, as a fleet of gateways: their calls are out at once,
    the publishers taking them in turn), for the plain and split shapes."""
    tls = tls or ClientTLS(insecure=True)
    if corked and partition_groups:
        return await grouped_case(
            servers, pings, concurrency, seconds, meter, tls, partition_groups
        )
    payload = batch_request(pings)
    if corked:
        pubs = [Publisher([s], tls=tls) for s in servers for _ in range(clients)]
        turn = itertools.cycle(range(len(pubs)))
        mine: dict[int, int] = {}  # worker task -> its publisher
        try:

            async def send() -> None:
                k = mine.setdefault(id(asyncio.current_task()), next(turn))
                await pubs[k].publish(payload)

            await drive(send, concurrency, 1.0, pings)  # warm up
            out = await drive(send, concurrency, seconds, pings, meter)
            calls = sum(p.stats.calls for p in pubs)
            out["publishes_per_call"] = round(sum(p.stats.sent for p in pubs) / max(calls, 1), 1)
            return out
        finally:
            for p in pubs:
                await p.close()
    async with tls.aio_channel(servers[0]) as ch:
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = ch.unary_unary(
            "/roadlog.v1.Roadlog/Publish"
        )

        async def send_one() -> None:
            await call(payload, timeout=30)

        await drive(send_one, concurrency, 1.0, pings)
        return await drive(send_one, concurrency, seconds, pings, meter)


async def nats_case(
    js: Any, pings: int, concurrency: int, seconds: float, meter: CpuMeter | None = None
) -> dict[str, Any]:
    payload = os.urandom(PING_BYTES * pings)

    async def send() -> None:
        await js.publish("pings.bench", payload, timeout=30)

    await drive(send, concurrency, 1.0, pings)
    return await drive(send, concurrency, seconds, pings, meter)


async def nats_round(
    nc: NatsCluster, pings: int, concurrency: int, seconds: float
) -> dict[str, Any]:
    """One JetStream case on a connection of its own (the stream is made
    once; making it again with the same config is a no-op)."""
    conn, js = await nats_stream(nc)
    try:
        meter = CpuMeter({s.name: s.pid for s in nc.servers})
        return await nats_case(js, pings, concurrency, seconds, meter)
    finally:
        await conn.close()


def cpu_ratio(ours: dict[str, Any], theirs: dict[str, Any]) -> float | None:
    """roadlog's server CPU per ping over JetStream's (lower is better)."""
    a, b = ours.get("server_cpu_s_per_m_pings"), theirs.get("server_cpu_s_per_m_pings")
    return round(a / b, 2) if a and b else None


def roadlog_meter(lc: LocalCluster) -> CpuMeter:
    """The queue server, the leader and the followers, labelled by role as
    they stand when the case starts (with data groups: the groups each
    node leads, ``node_2_leads_0_2``), and each node's worker processes
    (``node_2_leads_0_2_worker_0``: the main process's label then names
    what the whole node leads)."""
    st = lc.status()
    groups = raft_groups(st, None)
    leads: dict[int, list[int]] = {}
    for g in groups:
        if g["leader"]:
            leads.setdefault(int(g["leader"]), []).append(int(g["id"]))
    pids = {f"queue_server_{i + 1}": q.pid for i, q in enumerate(lc.queue_servers)}
    for n in lc.nodes:
        if len(groups) > 1:
            led = "_".join(str(g) for g in sorted(leads.get(n.id, [])))
            name = f"node_{n.id}_leads_{led}" if led else f"node_{n.id}"
        else:
            name = f"node_{n.id}_leader" if n.id == st["leader"] else f"node_{n.id}"
        pids[name] = n.pid
        for k, worker in enumerate(spawned_children(n.pid)):  # worker processes, if any
            pids[f"{name}_worker_{k}"] = worker
    return CpuMeter(pids)


def wait_spread(lc: LocalCluster, groups: int, timeout: float = 60.0) -> None:
    """With data groups: until each data group has a leader and, where there
    are as many nodes, no node leads two (the balancer's work), so that a
    case measures the groups spread as they run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = raft_groups(lc.status(), None)
        led = [int(g["leader"]) for g in seen if g["id"] and g["leader"]]
        if len(led) == groups and len(set(led)) == min(groups, len(lc.nodes)):
            return
        time.sleep(0.5)
    print(f"the data groups' leaders did not spread within {timeout} s", file=sys.stderr)


def topic_groups(lc: LocalCluster, name: str = "bench", timeout: float = 30.0) -> list[int]:
    """The data group of each of topic ``name``'s partitions. A fresh
    connection reads without a fence, so a node that has not applied the
    topic yet may answer NOT_FOUND: asked again until ``timeout``."""
    deadline = time.monotonic() + timeout
    with Connection(lc.servers, tls=lc.tls()) as conn:
        while True:
            try:
                return list(Admin(conn).describe(name).topic.partition_groups)
            except NotFound:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def median_case(system: str, pings: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One case from several rounds: the round with the median pings/s (its
    latencies with it), and every round's pings/s to show the spread."""
    ranked = sorted(runs, key=lambda r: r["pings_per_s"])
    mid = ranked[(len(ranked) - 1) // 2]
    return {
        "system": system,
        "pings_per_message": pings,
        **mid,
        "rounds_pings_per_s": [r["pings_per_s"] for r in runs],
        "rounds_server_cpu_s_per_m_pings": [r.get("server_cpu_s_per_m_pings") for r in runs],
    }


def run_rounds(
    system: str, sizes: list[int], rounds: int, one: Callable[[int], dict[str, Any]]
) -> list[dict[str, Any]]:
    """Every size once a round, rounds in turn (slow drift of the machine
    touches every size alike); one median case per size."""
    runs: dict[int, list[dict[str, Any]]] = {b: [] for b in sizes}
    for rnd in range(rounds):
        for b in sizes:
            r = one(b)
            runs[b].append(r)
            show(system, b, r, f"round {rnd + 1}/{rounds}")
    return [median_case(system, b, runs[b]) for b in sizes]


def show(system: str, b: int, r: dict[str, Any], what: str = "") -> None:
    cpu = r.get("server_cpu_s_per_m_pings")
    cores = " ".join(f"{k}={v}" for k, v in r.get("cores", {}).items())
    print(
        f"{system:<9} {b:>5}/msg: {r['pings_per_s']:>12,.0f} pings/s  "
        f"p50 {r['ack_p50_ms']} ms  p99 {r['ack_p99_ms']} ms  errors {r['errors']}  "
        f"server CPU-s/M pings {cpu}  cores {cores}  "
        f"client CPU-s/M pings {r.get('client_cpu_s_per_m_pings')}  {what}",
        file=sys.stderr,
        flush=True,
    )


# The systems a run may compare, with the extra node and queue server flags
# of roadlog's cases.
SYSTEMS: dict[str, tuple[list[str], list[str]]] = {
    "roadlog": ([], []),
    "roadlog-unary": ([], []),
    "roadlog-grpc-peers": (["--peer-frames-port", "-1"], []),
    "roadlog-grpc-work": ([], ["--work-frames-port", "-1"]),
    "roadlog-grpc": (["--peer-frames-port", "-1"], ["--work-frames-port", "-1"]),
    "jetstream": ([], []),
}


def find(cases: list[dict[str, Any]], system: str, b: int, tls: bool) -> dict[str, Any]:
    return next(
        c
        for c in cases
        if c["system"] == system and c["pings_per_message"] == b and c["tls"] == tls
    )


def compare(
    cases: list[dict[str, Any]], sizes: list[int], ours: str, theirs: str, tls: bool
) -> tuple[dict[str, float], dict[str, float | None]]:
    """Per message size: pings/s and CPU per ping of ``ours`` over ``theirs``."""
    ratios, cpu_ratios = {}, {}
    for b in sizes:
        a, c = find(cases, ours, b, tls), find(cases, theirs, b, tls)
        ratios[str(b)] = round(a["pings_per_s"] / max(c["pings_per_s"], 1e-9), 2)
        cpu_ratios[str(b)] = cpu_ratio(a, c)
    return ratios, cpu_ratios


def run_systems(
    systems: list[str], sizes: list[int], args: argparse.Namespace, tls: bool
) -> list[dict[str, Any]]:
    """Every system's median case per size, each on a fresh cluster, over
    TLS (client and peer links alike) or not; cases carry ``tls``."""
    cases: list[dict[str, Any]] = []
    for system in systems:
        if system == "jetstream":
            with nats_cluster(tls=tls) as nc:
                cases += run_rounds(
                    "jetstream",
                    sizes,
                    args.rounds,
                    lambda b, nc=nc: eventloop.run(  # type: ignore[misc]
                        nats_round(nc, b, args.concurrency, args.seconds)
                    ),
                )
            continue
        node_args, queue_args = SYSTEMS[system]
        node_args = [*node_args, *shlex.split(args.node_flags)]
        if args.data_groups > 1:  # multi-raft: topics placed in the data groups
            # Worker processes said every time: 1 (this bench's default) keeps
            # the groups in each node's main process, not the node's default.
            node_args = [
                *node_args, "--data-groups", str(args.data_groups), "--place-topics",
                "--workers", str(args.workers),
            ]  # fmt: skip
        with roadlog_cluster(
            extra=node_args, queue_extra=queue_args, tls=tls, queue_servers=args.queue_servers
        ) as lc:
            groups: list[int] = []
            if args.data_groups > 1:
                wait_spread(lc, args.data_groups)
                if not args.split:
                    groups = topic_groups(lc)
            corked = system != "roadlog-unary"
            cases += run_rounds(
                system,
                sizes,
                args.rounds,
                lambda b, lc=lc, corked=corked, groups=groups: eventloop.run(  # type: ignore[misc]
                    roadlog_case(
                        lc.servers,
                        b,
                        args.concurrency,
                        args.seconds,
                        roadlog_meter(lc),
                        corked=corked,
                        tls=lc.tls(),
                        partition_groups=groups,
                        clients=args.clients,
                    )
                ),
            )
    return [{**c, "tls": tls} for c in cases]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=6.0, help="per case and round")
    ap.add_argument(
        "--concurrency",
        type=int,
        default=DEFAULT_CONCURRENCY,
        help="publishers (async tasks) per system; another figure than "
        f"{DEFAULT_CONCURRENCY} adds -cN to the results' file name",
    )
    ap.add_argument("--batches", default="1,100,1000")
    ap.add_argument("--rounds", type=int, default=3, help="figures are the median round")
    ap.add_argument(
        "--systems",
        default="roadlog,roadlog-unary,jetstream",
        help=f"comma-separated, of: {', '.join(SYSTEMS)} (roadlog-grpc-peers: Raft over the "
        "gRPC stream instead of the framed peer link; roadlog-grpc-work: the queue server's "
        "Work stream over gRPC instead of the framed Work link; roadlog-grpc: both over gRPC)",
    )
    ap.add_argument(
        "--tls",
        choices=["off", "on", "both"],
        default="off",
        help="every system plaintext (off), over TLS with certificates from one CA (on: "
        "roadlog's client, peer and Work links; JetStream's client port and routes), or each "
        "both ways with TLS's cost per ping (both); on and both write ingest-tls.json",
    )
    ap.add_argument(
        "--groups",
        dest="data_groups",
        type=int,
        default=1,
        help="data groups of roadlog's clusters (multi-raft): above 1, every topic's "
        "partitions are placed in them (--data-groups G --place-topics); the results go to "
        "ingest-groups-G.json",
    )
    ap.add_argument(
        "--queue-servers",
        type=int,
        default=1,
        help="roadlog's queue servers, the publishers spread over them (one corked "
        "Publisher each): whether the queue server is the ceiling; results in "
        "ingest-qs-N.json",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=1,
        help="with --groups: each node's data groups in this many worker processes "
        "(--workers W; 0: one per core, the node's default; 1: in its main process); each "
        "worker's share of a core is reported; the results go to "
        "ingest-groups-G-workers-W.json",
    )
    ap.add_argument(
        "--clients",
        type=int,
        default=1,
        help="corked Publishers per queue server for the plain and --split shapes, the "
        "publishers spread over them (a fleet of clients: each group's round can carry "
        "parts of several calls); another figure than 1 adds -clientsN to the results' name",
    )
    ap.add_argument(
        "--node-flags",
        default="",
        help="more flags for every roadlog node, as one string (an experiment's knob, "
        "e.g. --node-flags='--snapshot-bytes 1073741824'); the results say them and go "
        "to a file ending -flags",
    )
    ap.add_argument(
        "--split",
        action="store_true",
        help="with --groups: messages of every group's devices, split by group 0's leader "
        "(the way of clients that do not route by group), instead of one group's each",
    )
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    sizes = [int(b) for b in args.batches.split(",")]
    systems = args.systems.split(",")
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"--systems: unknown {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.tls]
    cases: list[dict[str, Any]] = []
    for tls in modes:
        cases += run_systems(systems, sizes, args, tls)
    figures: dict[str, Any] = {
        "data_groups": args.data_groups,
        "workers": args.workers,
        "queue_servers": args.queue_servers,
        "split": args.split,
        "clients": args.clients,
        "node_flags": args.node_flags,
        "concurrency": args.concurrency,
        "event_loop": eventloop.loop_name(),
        "seconds": args.seconds,
        "rounds": args.rounds,
        "systems": systems,
        "tls": args.tls,
        "cases": cases,
    }
    if "roadlog" in systems and "jetstream" in systems:
        for tls in modes:
            ratios, cpu_ratios = compare(cases, sizes, "roadlog", "jetstream", tls)
            key = "_tls" if tls else ""
            figures[f"ratio{key}"], figures[f"cpu_ratio{key}"] = ratios, cpu_ratios
            label = " (TLS)" if tls else ""
            print(f"ratio roadlog/jetstream{label} (medians): {ratios}", file=sys.stderr)
            print(f"server CPU per ping, roadlog/jetstream{label}: {cpu_ratios}", file=sys.stderr)
    if args.tls == "both":
        # What TLS costs each system: its CPU per ping with TLS over without.
        figures["tls_cpu_cost"] = {
            system: {
                str(b): cpu_ratio(find(cases, system, b, True), find(cases, system, b, False))
                for b in sizes
            }
            for system in systems
        }
        print(f"server CPU per ping, TLS/plaintext: {figures['tls_cpu_cost']}", file=sys.stderr)
    name = "ingest" if args.tls == "off" else "ingest-tls"
    if args.data_groups > 1:
        name = f"ingest-groups-{args.data_groups}{'-split' if args.split else ''}"
        if args.workers != 1:
            name += f"-workers-{args.workers or 'auto'}"
    if args.queue_servers > 1:
        name += f"-qs-{args.queue_servers}"
    if args.clients != 1:
        name += f"-clients{args.clients}"
    if args.concurrency != DEFAULT_CONCURRENCY:  # another load: beside the standard figures
        name += f"-c{args.concurrency}"
    if args.node_flags:  # an experiment: never in place of the standard figures
        name += "-flags"
    print(write_result(name, figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
