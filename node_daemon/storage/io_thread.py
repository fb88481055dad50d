"""One long-lived thread that runs blocking jobs in order (the Raft log's
writes, the state machine's applies), with a light hand-over each way.

``call(loop, fn, *args)`` returns an asyncio future settled on ``loop`` once
``fn`` ran on the thread: one queue put to get there, one
``call_soon_threadsafe`` to come back. ``loop.run_in_executor`` on a
ThreadPoolExecutor costs more per job (a work item, a concurrent future
with its condition, the thread-count check, and asyncio's chaining of one
future to the other), and a follower hands over two jobs per entry it
stores. It is also an ``Executor`` (``submit``), for the callers that want
one (snapshots compact the log on the log's thread).

Invariants: jobs run one at a time, in the order they were handed over;
each future is settled exactly once, with the job's result or exception
(a future cancelled meanwhile is left alone); after ``shutdown`` the
thread finishes the jobs already handed over and takes no more. ``idle``
is true only when every job handed over has finished: a caller that is the
only one handing jobs over may then do the thread's kind of work itself,
knowing that nothing runs beside it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_Job = tuple[Callable[[], Any], asyncio.AbstractEventLoop | None, Any]


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.cancelled():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class IoThread(concurrent.futures.Executor):
    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._handed = 0  # jobs handed over (by the callers)
        self._finished = 0  # jobs finished (by the thread)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(
        self, loop: asyncio.AbstractEventLoop, fn: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        """Run ``fn(*args)`` on the thread; the future settles on ``loop``."""
        if self._closed:
            raise RuntimeError("the I/O thread is shut down")
        fut: asyncio.Future[T] = loop.create_future()
        self._handed += 1
        self._jobs.put((functools.partial(fn, *args), loop, fut))
        return fut

    def submit(
        self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        if self._closed:
            raise RuntimeError("the I/O thread is shut down")
        cf: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._handed += 1
        self._jobs.put((functools.partial(fn, *args, **kwargs), None, cf))
        return cf

    @property
    def idle(self) -> bool:
        """Every job handed over has finished (its future may not be settled
        on its loop yet)."""
        return self._finished == self._handed

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
        if wait and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, loop, fut = job
            if loop is None:  # submit(): a concurrent future
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:
                        fut.set_exception(e)
                self._finished += 1
                continue
            try:
                result, exc = fn(), None
            except BaseException as e:
                result, exc = None, e
            self._finished += 1
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(_settle, fut, result, exc)
