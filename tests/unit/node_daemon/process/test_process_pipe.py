"""The pipe between a node's main process and a worker process: whole
messages in order, sends that never block the event loop however far the
other side is behind (droppable ones left out then), EOF when the other
side goes, and no oversized message in either direction."""

from __future__ import annotations

import asyncio
import multiprocessing

import pytest

from node_daemon.process import pipe as process_pipe
from node_daemon.process.pipe import HIGH_WATER, ProcessPipe
from tests.unit.support.loops import run_bounded

pytestmark = pytest.mark.unit


def test_messages_arrive_whole_in_order_and_sends_never_block() -> None:
    async def body() -> None:
        a_conn, b_conn = multiprocessing.Pipe()
        a, b = await ProcessPipe.open(a_conn), await ProcessPipe.open(b_conn)
        try:
            for i in range(100):
                assert a.send({"kind": "n", "i": i, "pad": b"x" * (i * 997)})
            got = [await b.recv() for _ in range(100)]
            assert [m["i"] for m in got] == list(range(100))
            assert all(len(m["pad"]) == m["i"] * 997 for m in got)
            # The other side reads nothing: sends go on without blocking, the
            # droppable ones stop once HIGH_WATER bytes wait, the others not.
            big = {"kind": "metrics", "text": "y" * (64 << 10)}
            sent = sum(a.send(big, droppable=True) for _ in range(200))
            assert sent < 200 and a.backlog() > HIGH_WATER
            assert a.send({"kind": "stop"})  # never dropped
            for _ in range(sent):
                assert (await b.recv())["kind"] == "metrics"
            assert (await b.recv())["kind"] == "stop"
            with pytest.raises(ValueError):
                a.send({"kind": "huge", "pad": b"z" * (process_pipe.MAX_MESSAGE + 1)})
        finally:
            a.close()
        with pytest.raises(EOFError):
            await asyncio.wait_for(b.recv(), 5)
        b.close()

    run_bounded(body)
