"""Helpers for unit tests that run real sockets on an event loop: each test
on both loops the daemons may run on (uvloop and asyncio: their transports
differ), bounded in time, waiting on conditions with a deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from roadlog.runtime import eventloop

LOOPS = ["uvloop", "asyncio"]


def use_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """For a fixture parametrized by ``LOOPS``: the daemons' loop is that one."""
    monkeypatch.setenv("ROADLOG_EVENT_LOOP", request.param)
    assert eventloop.loop_name() == request.param
    return str(request.param)


def run_bounded(body: Callable[[], Awaitable[None]], seconds: float = 60.0) -> None:
    """Run ``body`` on the chosen loop; fail if it takes over ``seconds``."""

    async def bounded() -> None:
        await asyncio.wait_for(body(), seconds)

    eventloop.run(bounded())


async def until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Wait until ``cond()`` holds; fail naming ``what`` after ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
