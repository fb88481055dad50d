"""The front door under many small clients, and reads spread over nodes.

1. Single-ping publishes from many concurrent clients (each its own client
   id), over gRPC and over HTTP, with server-side batching (publishes that
   arrive while the leader persists merged into one append op) and without
   it (one op per publish). pings/s and ack latency p50/p99.
2. Read throughput (fenced fetches of 100 pings) with 1 and with 3 nodes
   stealing reads from the queue server, and the share each node served.

Writes bench/results/front_door.json.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import urllib.request
from typing import Any

import aiohttp
import grpc

from bench.common import write_result
from bench.ingest import drive
from bench.peers import roadlog_cluster
from roadlog.client import Connection, Producer
from roadlog.columnar import PingColumns
from roadlog.tools.localcluster import LocalCluster
from roadlog.v1 import client_pb2, pings_pb2


def loader_pings(n: int, devices: int) -> PingColumns:
    now = int(time.time() * 1000)
    return PingColumns.from_columns(
        [f"car-{i % devices}" for i in range(n)],
        [now + i for i in range(n)],
        [48.137] * n,
        [11.575] * n,
    )


def one_ping_request(client: str) -> bytes:
    now = int(time.time() * 1000)
    batch = pings_pb2.PingBatch(
        device_ids=[client], device_index=[0], ts_ms=[now], lat=[48.137], lon=[11.575]
    )
    return client_pb2.PublishRequest(
        topic="bench", client_id=client, batch=batch
    ).SerializeToString()


async def grpc_singles(server: str, clients: int, seconds: float) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(server) as ch:
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = ch.unary_unary(
            "/roadlog.v1.Roadlog/Publish"
        )
        payloads = [one_ping_request(f"phone-{i}") for i in range(clients)]
        it = iter(range(1 << 62))

        async def send() -> None:
            i = next(it) % clients
            await call(payloads[i], timeout=30, metadata=(("roadlog-client", f"phone-{i}"),))

        await drive(send, clients, 1.0, 1)
        return await drive(send, clients, seconds, 1)


async def http_singles(base: str, clients: int, seconds: float) -> dict[str, Any]:
    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=conn) as session:
        it = iter(range(1 << 62))

        async def send() -> None:
            i = next(it) % clients
            body = {
                "client_id": f"phone-{i}",
                "pings": [
                    {
                        "device_id": f"phone-{i}",
                        "ts_ms": int(time.time() * 1000),
                        "lat": 48.137,
                        "lon": 11.575,
                    }
                ],
            }
            async with session.post(f"{base}/v1/topics/bench/pings", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
                await r.read()

        await drive(send, clients, 1.0, 1)
        return await drive(send, clients, seconds, 1)


def taken_reads(lc: LocalCluster) -> dict[str, float]:
    text = (
        urllib.request.urlopen(
            f"http://127.0.0.1:{lc.queue_servers[0].metrics_port}/metrics", timeout=10
        )
        .read()
        .decode()
    )
    return {
        line.split('node="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("roadlog_queue_work_taken_total") and 'kind="read"' in line
    }


async def reads(
    server: str, fence: int, partitions: int, concurrency: int, seconds: float
) -> dict[str, Any]:
    async with grpc.aio.insecure_channel(server) as ch:
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = ch.unary_unary(
            "/roadlog.v1.Roadlog/Fetch"
        )
        reqs = [
            client_pb2.FetchRequest(
                topic="bench", partition=p, max_pings=100, min_applied_index=fence
            ).SerializeToString()
            for p in range(partitions)
        ]
        it = iter(range(1 << 62))

        async def send() -> None:
            await call(reqs[next(it) % partitions], timeout=30)

        await drive(send, concurrency, 1.0, 1)
        return await drive(send, concurrency, seconds, 1)


def show(what: str, r: dict[str, Any]) -> None:
    print(
        f"{what:<34} {r['pings_per_s']:>10,.0f}/s  p50 {r['ack_p50_ms']} ms  "
        f"p99 {r['ack_p99_ms']} ms  errors {r['errors']}",
        file=sys.stderr,
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--readers", type=int, default=64)
    args = ap.parse_args(argv)
    singles: list[dict[str, Any]] = []
    for merge in (True, False):
        extra = [] if merge else ["--no-merge-publishes"]
        with roadlog_cluster(extra=extra) as lc:
            for api in ("grpc", "http"):
                if api == "grpc":
                    r = asyncio.run(grpc_singles(lc.servers[0], args.clients, args.seconds))
                else:
                    base = lc.queue_servers[0].http
                    r = asyncio.run(http_singles(base, args.clients, args.seconds))
                singles.append({"api": api, "server_side_batching": merge, **r})
                show(f"{api} single pings, batching {'on' if merge else 'off'}", r)
    read_cases: list[dict[str, Any]] = []
    for nodes in (1, 3):
        with roadlog_cluster(nodes=nodes) as lc:
            with Connection(lc.servers, tls=lc.tls()) as conn:
                ack = Producer(conn, "bench", client="loader").send_batch(loader_pings(8000, 64))
            before = taken_reads(lc)
            r = asyncio.run(reads(lc.servers[0], ack.applied_index, 8, args.readers, args.seconds))
            after = taken_reads(lc)
            served = {n: after.get(n, 0) - before.get(n, 0) for n in after}
            total = sum(served.values()) or 1
            share = {n: round(v / total, 3) for n, v in sorted(served.items())}
            r = {**r, "reads_per_s": r.pop("pings_per_s")}
            read_cases.append({"nodes": nodes, **r, "share_by_node": share})
            print(
                f"reads with {nodes} node(s): {r['reads_per_s']:,.0f}/s, "
                f"p50 {r['ack_p50_ms']} ms, share {share}",
                file=sys.stderr,
                flush=True,
            )
    print(
        write_result(
            "front_door",
            {
                "clients": args.clients,
                "readers": args.readers,
                "seconds": args.seconds,
                "single_pings": singles,
                "reads": read_cases,
            },
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
