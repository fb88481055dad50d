"""DiskGuard: when a node's disk counts as too full for growing writes."""

from __future__ import annotations

import pytest

from node_daemon.storage.disk import LOOK_EVERY_S, RETRY_FIRST_S, RETRY_MAX_S, DiskGuard
from roadlog.errors import Code, RoadlogError

pytestmark = pytest.mark.unit

MIB = 1 << 20


class Disk:
    def __init__(self, free: int) -> None:
        self.free = free
        self.now = 0.0
        self.looks = 0

    def statvfs(self, path: str) -> int:
        self.looks += 1
        return self.free

    def guard(self) -> DiskGuard:
        return DiskGuard("/data", 100 * MIB, lambda: self.now, self.statvfs)


def test_below_min_free_only_growing_ops_are_refused_with_a_clear_reason() -> None:
    d = Disk(50 * MIB)
    g = d.guard()
    assert g.low
    with pytest.raises(RoadlogError) as e:
        g.refuse("append", node_id=2)
    assert e.value.code == Code.RESOURCE_EXHAUSTED
    assert "node 2's disk is nearly full (50 MiB free" in e.value.message
    assert "reads go on" in e.value.message
    for kind in ("delete_topic", "trim", "commit_offsets", "leave_group", None):
        g.refuse(kind, node_id=2)  # small, or freeing space: taken


def test_the_free_space_is_looked_at_again_only_after_a_while() -> None:
    d = Disk(500 * MIB)
    g = d.guard()
    assert not g.low and d.looks == 1
    d.free = 10 * MIB
    assert not g.low and d.looks == 1  # the last look stands for LOOK_EVERY_S
    d.now += LOOK_EVERY_S
    assert g.low and d.looks == 2
    d.free = 500 * MIB
    d.now += LOOK_EVERY_S
    assert not g.low


def test_a_failed_write_keeps_it_low_until_a_retry_goes_through() -> None:
    d = Disk(500 * MIB)  # plenty free, yet a write failed (say, the LMDB map at its maximum)
    g = d.guard()
    waits = [g.write_failed() for _ in range(8)]
    assert waits[0] == RETRY_FIRST_S and waits[1] == 2 * RETRY_FIRST_S
    assert waits[-1] == RETRY_MAX_S and waits == sorted(waits)  # backoff, bounded
    d.now += 10 * LOOK_EVERY_S
    assert g.low  # room on the filesystem does not clear a write that failed
    with pytest.raises(RoadlogError):
        g.refuse("put_heatmap", node_id=1)
    g.write_succeeded()
    assert not g.low
    assert g.write_failed() == RETRY_FIRST_S  # the backoff starts over


def test_an_unreadable_path_keeps_the_last_figure() -> None:
    d = Disk(10 * MIB)
    g = d.guard()
    assert g.low

    def broken(path: str) -> int:
        raise OSError("gone")

    g.free = broken
    d.now += LOOK_EVERY_S
    assert g.low and g.free_now == 10 * MIB
