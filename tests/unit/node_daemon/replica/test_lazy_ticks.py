"""A replica's lazy ticks (``Replica.owe_ticks``): every tick boundary that
passed is handed to the core, in order, before any input that came after
it; none is handed twice or before its boundary; and until the driver has
run them, the replica names no tick due (``ticks.due_at``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.unit.node_daemon.replica.test_follower_inline_io import _close, _node
from tests.unit.support.loops import run_bounded

pytestmark = pytest.mark.unit


class _Core:
    def __init__(self, seen: list[str]) -> None:
        self.seen = seen

    def tick(self) -> None:
        self.seen.append("tick")


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
