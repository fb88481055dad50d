"""Running a daemon's asyncio main: on uvloop when it is installed (a libuv
event loop: less CPU and latency per gRPC hop and per task switch than the
standard loop), else on the standard loop. ``ROADLOG_EVENT_LOOP=asyncio``
forces the standard loop (for comparison, or if uvloop misbehaves)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_name() -> str:
    """The loop ``run`` uses: "uvloop" or "asyncio"."""
    if os.environ.get("ROADLOG_EVENT_LOOP", "").lower() == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    if loop_name() == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
