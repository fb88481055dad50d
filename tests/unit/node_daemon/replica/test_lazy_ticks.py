"""A replica's lazy ticks (``Replica.owe_ticks``): every tick boundary that
passed is handed to the core, in order, before any input that came after
it; none is handed twice or before its boundary; and until the driver has
run them, the replica names no tick due (``ticks.due_at``)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from node_daemon.config import NodeConfig
from node_daemon.replica.replica import Replica
from roadlog.runtime.processes import free_port
from tests.unit.support.loops import run_bounded

pytestmark = pytest.mark.unit


class _Core:
    def __init__(self, seen: list[str]) -> None:
        self.seen = seen

    def tick(self) -> None:
        self.seen.append("tick")


def _node(tmp_path: Path) -> Replica:
    addr, other = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    cfg = NodeConfig(node_id=1, data_dir=tmp_path / "n1", listen=addr, peers={1: addr, 2: other})
    node = Replica(cfg)
    node._loop = asyncio.get_running_loop()
    return node


def _close(node: Replica) -> None:
    node._log_io.shutdown()
    node._apply_io.shutdown()
    node.sm.close()
    node.log_store.close()


def test_the_ticks_owed_come_before_what_came_after_them(tmp_path: Path) -> None:
    async def body() -> None:
        node = _node(tmp_path)
        try:
            period = node.cfg.tick_ms / 1000
            seen: list[str] = []
            core: Any = _Core(seen)

            def run() -> None:
                while node._inbox:
                    node._inbox.popleft()(core)

            node.ticks.on = True
            node.ticks.next_at = time.monotonic() + 3600  # no boundary passed
            node.submit(lambda c: seen.append("a"))
            run()
            assert seen == ["a"]
            # Three boundaries passed (the last 0.5 tick ago): three ticks, then the input.
            node.ticks.next_at = time.monotonic() - 2.5 * period
            node.submit(lambda c: seen.append("b"))
            at = node.ticks.next_at
            node.owe_ticks(at - period / 2)  # none twice
            run()
            assert seen == ["a", "tick", "tick", "tick", "b"]
            assert node.ticks.due_at == float("inf")  # until the driver says
            node.lazy_tick(at)  # the ticker, at the next boundary: one more
            run()
            assert seen.count("tick") == 4 and node.ticks.next_at == pytest.approx(at + period)
        finally:
            _close(node)

    run_bounded(body)
