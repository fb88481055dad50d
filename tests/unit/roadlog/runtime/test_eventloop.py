"""The daemons' event loop: uvloop when installed, the standard loop on request."""

from __future__ import annotations

import asyncio

import pytest

from roadlog.runtime import eventloop

pytestmark = pytest.mark.unit


async def _loop_type() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_by_default_and_the_standard_loop_on_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ROADLOG_EVENT_LOOP", raising=False)
    assert eventloop.loop_name() == "uvloop"  # a locked dependency
    assert eventloop.run(_loop_type()).startswith("uvloop")
    monkeypatch.setenv("ROADLOG_EVENT_LOOP", "asyncio")
    assert eventloop.loop_name() == "asyncio"
    assert eventloop.run(_loop_type()).startswith("asyncio")
