"""What one internal hop costs: a gRPC aio bidi stream (what the peer and
Work streams use today) against length-prefixed frames on plain asyncio
streams, both on the daemons' event loop (uvloop when installed).

A server process echoes every message with a 200-byte answer; the client
keeps ``concurrency`` exchanges going at once over one connection (one
stream for gRPC). Reported: exchanges per second and the CPU-seconds of each
side per exchange (user + system from /proc, every thread). This is the
figure behind the choice of transport for the internal hops (issue 17):
how much of the fixed cost of a replication round is the transport.
Writes bench/results/transport_hop.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import struct
import subprocess
import sys
import time
from typing import Any

import grpc

from bench.common import write_result
from bench.cpu import cpu_seconds
from roadlog.runtime import eventloop
from roadlog.runtime.processes import free_port

ANSWER = b"y" * 200
FRAME = struct.Struct("!I")  # payload length, then the payload
READ_LIMIT = 16 << 20


# ------------------------------------------------------------------ servers


async def grpc_server(port: int) -> None:
    async def exchange(it: Any, ctx: Any) -> Any:
        async for _ in it:
            yield ANSWER

    handler = grpc.method_handlers_generic_handler(
        "bench.Hop", {"Exchange": grpc.stream_stream_rpc_method_handler(exchange)}
    )
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def frame_server(port: int) -> None:
    async def conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answer = FRAME.pack(len(ANSWER)) + ANSWER
        try:
            while True:
                (n,) = FRAME.unpack(await reader.readexactly(FRAME.size))
                await reader.readexactly(n)
                writer.write(answer)
        except asyncio.IncompleteReadError:
            writer.close()

    # A buffer limit above the largest message: at the default 64 KiB the
    # reader pauses and resumes the socket several times per message.
    server = await asyncio.start_server(conn, "127.0.0.1", port, limit=READ_LIMIT)
    async with server:
        await server.serve_forever()


# ------------------------------------------------------------------ clients


async def grpc_client(port: int, size: int, concurrency: int, seconds: float) -> int:
    """Exchanges done: ``concurrency`` messages kept in flight on one stream."""
    payload = b"p" * size
    opts = [("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
        call: grpc.aio.StreamStreamCall[bytes, bytes] = ch.stream_stream("/bench.Hop/Exchange")()
        for _ in range(concurrency):
            await call.write(payload)
        done = 0
        stop = time.perf_counter() + seconds
        while time.perf_counter() < stop:
            await call.read()
            done += 1
            await call.write(payload)
        for _ in range(concurrency):
            await call.read()
        await call.done_writing()
        return done


async def frame_client(port: int, size: int, concurrency: int, seconds: float) -> int:
    payload = FRAME.pack(size) + b"p" * size
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=READ_LIMIT)
    for _ in range(concurrency):
        writer.write(payload)
    done = 0
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        (n,) = FRAME.unpack(await reader.readexactly(FRAME.size))
        await reader.readexactly(n)
        done += 1
        writer.write(payload)
        await writer.drain()
    for _ in range(concurrency):
        (n,) = FRAME.unpack(await reader.readexactly(FRAME.size))
        await reader.readexactly(n)
    writer.close()
    return done


CLIENTS = {"grpc-aio-stream": grpc_client, "frames-asyncio": frame_client}


def measure(kind: str, size: int, concurrency: int, seconds: float) -> dict[str, Any]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.transport_hop", "--serve", kind, str(port)]
    )
    try:
        eventloop.run(_until_up(port))
        eventloop.run(CLIENTS[kind](port, size, concurrency, 0.5))  # warm up
        c0, s0, t0 = cpu_seconds(os.getpid()), cpu_seconds(server.pid), time.perf_counter()
        done = eventloop.run(CLIENTS[kind](port, size, concurrency, seconds))
        elapsed = time.perf_counter() - t0
        c1, s1 = cpu_seconds(os.getpid()), cpu_seconds(server.pid)
    finally:
        server.kill()
        server.wait(10)
    return {
        "transport": kind,
        "payload_bytes": size,
        "concurrency": concurrency,
        "exchanges_per_s": round(done / elapsed),
        "client_us_per_exchange": round((c1 - c0) / done * 1e6, 1),
        "server_us_per_exchange": round((s1 - s0) / done * 1e6, 1),
    }


async def _until_up(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--sizes", default="4000,37000,260000", help="payload bytes per message")
    ap.add_argument("--concurrency", default="1,8")
    args = ap.parse_args(argv)
    if args.serve:
        kind, port = args.serve
        eventloop.run((grpc_server if kind == "grpc-aio-stream" else frame_server)(int(port)))
        return 0
    cases = []
    for size in [int(s) for s in args.sizes.split(",")]:
        for conc in [int(c) for c in args.concurrency.split(",")]:
            for kind in CLIENTS:
                r = measure(kind, size, conc, args.seconds)
                cases.append(r)
                print(
                    f"{kind:<16} {size:>7} B x{conc}: {r['exchanges_per_s']:>7,} exchanges/s  "
                    f"client {r['client_us_per_exchange']} us  "
                    f"server {r['server_us_per_exchange']} us CPU each",
                    file=sys.stderr,
                    flush=True,
                )
    print(write_result("transport_hop", {"event_loop": eventloop.loop_name(), "cases": cases}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
