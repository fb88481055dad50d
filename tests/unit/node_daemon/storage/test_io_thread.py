"""The node's I/O thread: jobs run one at a time in the order handed over,
on the thread; each future settles once on the caller's loop with the
job's result or exception; a cancelled future is left alone; the Executor
face works for run_in_executor; after shutdown it takes no more."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from node_daemon.storage.io_thread import IoThread

pytestmark = pytest.mark.unit


def test_jobs_run_in_order_on_the_thread_and_settle_on_the_loop() -> None:
    io = IoThread("test-io")
    ran: list[tuple[int, str]] = []

    def job(i: int) -> int:
        ran.append((i, threading.current_thread().name))
        if i == 3:
            raise ValueError("job 3 failed")
        return i * 10

    async def main() -> list[object]:
        loop = asyncio.get_running_loop()
        futs = [io.call(loop, job, i) for i in range(6)]
        return await asyncio.gather(*futs, return_exceptions=True)

    try:
        out = asyncio.run(main())
    finally:
        io.shutdown()
    assert ran == [(i, "test-io") for i in range(6)]
    assert out[:3] == [0, 10, 20] and out[4:] == [40, 50]
    assert isinstance(out[3], ValueError) and str(out[3]) == "job 3 failed"


def test_a_cancelled_future_is_left_alone_and_later_jobs_still_run() -> None:
    io = IoThread("test-io")
    gate = threading.Event()

    async def main() -> int:
        loop = asyncio.get_running_loop()
        first = io.call(loop, gate.wait, 10)
        second = io.call(loop, lambda: 7)
        first.cancel()
        gate.set()
        return await second

    try:
        assert asyncio.run(main()) == 7
    finally:
        io.shutdown()


def test_it_is_an_executor_and_shutdown_finishes_what_was_handed_over() -> None:
    io = IoThread("test-io")
    gate = threading.Event()
    done: list[int] = []

    async def main() -> int:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(io, lambda a, b: a + b, 2, 3)

    assert asyncio.run(main()) == 5
    io.submit(gate.wait, 10)
    late = io.submit(done.append, 1)
    gate.set()
    io.shutdown(wait=True)
    assert late.done() and done == [1]
    with pytest.raises(RuntimeError, match="shut down"):
        io.submit(done.append, 2)


def test_idle_only_once_every_job_handed_over_has_finished() -> None:
    io = IoThread("test-io")
    gate = threading.Event()
    assert io.idle
    try:
        running = io.submit(gate.wait, 10)
        queued = io.submit(lambda: 1)
        assert not io.idle  # one runs, one waits behind it
        gate.set()
        assert running.result(10) and queued.result(10) == 1

        def finished() -> bool:  # the thread counts a job once its future is set
            deadline = time.monotonic() + 10
            while not io.idle and time.monotonic() < deadline:
                time.sleep(0.001)
            return io.idle

        assert finished()

        async def main() -> None:
            loop = asyncio.get_running_loop()
            fut = io.call(loop, gate.wait, 10)
            assert not io.idle
            await fut

        asyncio.run(main())
        assert finished()
    finally:
        io.shutdown()
