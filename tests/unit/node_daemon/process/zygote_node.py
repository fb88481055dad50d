"""A stand-in node for test_zygote (run as a process of its own: it makes
itself a subreaper and forks a zygote, which the test process must not).

``python -m tests.unit.node_daemon.process.zygote_node MODE`` prints one
JSON line, then (mode ``hold``) waits to be killed."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import select
import signal
import sys
import time
from multiprocessing.connection import Connection

from bench.cpu import spawned_children
from node_daemon.process import zygote
from node_daemon.process.worker_process import _die_with_parent


def _exit_with(code: int, conn: Connection, parent: int) -> None:
    _die_with_parent(parent)
    sys.exit(code)


def _hold(seconds: float, conn: Connection, parent: int) -> None:
    """A worker: dies with its node, tells its parent, then waits."""
    _die_with_parent(parent)
    conn.send(os.getppid())
    conn.poll(seconds)  # until the node closes its end (or dies)


_kept: list[Connection] = []


async def _fork(z: zygote.Zygote, entry: zygote.Entry, spec: object) -> tuple[int, Connection]:
    here, there = multiprocessing.Pipe()
    pid = await z.fork(entry, spec, there, os.getpid())
    there.close()
    return pid, here


async def _main(mode: str) -> dict[str, object]:
    z = zygote.start()
    assert z is not None
    if mode == "exit":
        pid, _ = await _fork(z, _exit_with, 3)
        w = zygote.Forked(pid)
        select.select([w.sentinel], [], [], 30)
        return {"alive": w.is_alive(), "exitcode": w.exitcode}
    if mode == "gone":
        os.kill(z.pid, signal.SIGKILL)
        try:
            await _fork(z, _hold, 30.0)
        except zygote.ZygoteError as e:
            return {"error": str(e), "current": zygote.current() is not None}
        return {"error": ""}
    pid, here = await _fork(z, _hold, 120.0)
    _kept.append(here)  # open while this node lives: the worker waits on it
    said = here.recv() if here.poll(30) else None
    with open(f"/proc/{pid}/comm") as f:
        comm = f.read().strip()
    deadline = time.monotonic() + 10
    while spawned_children(os.getpid()) != [pid] and time.monotonic() < deadline:
        time.sleep(0.01)  # /proc read while settling
    return {
        "node": os.getpid(),
        "zygote": z.pid,
        "worker": pid,
        "worker_says_parent": said,
        "comm": comm,
        "workers_found": spawned_children(os.getpid()),
    }


def main() -> None:
    mode = sys.argv[1]
    out = asyncio.run(_main(mode))
    print(json.dumps(out), flush=True)
    if mode == "hold":
        time.sleep(120)  # the test kills this process


if __name__ == "__main__":
    main()
