"""When a node compacts its log into a snapshot (node_daemon.replica.snapshots.snapshot_due)."""

from __future__ import annotations

import pytest

from node_daemon.replica.snapshots import snapshot_due

pytestmark = pytest.mark.unit

MiB = 1 << 20


def _state(size: int) -> object:
    def size_bytes() -> int:
        return size

    return size_bytes


@pytest.mark.parametrize(
    ("entries", "log_bytes", "state", "due"),
    [
        (10, 1 * MiB, 10 * MiB, False),  # below both limits
        (20_000, 1 * MiB, 10 * MiB, True),  # enough entries, small state
        (10, 256 * MiB, 200 * MiB, True),  # enough bytes, state no bigger than the limit
        (10, 256 * MiB, 10_000 * MiB, False),  # a big state waits for a log half its size
        (20_000, 300 * MiB, 10_000 * MiB, False),  # ... whatever the entry count
        (10, 5_000 * MiB, 10_000 * MiB, True),  # ... and then it is due
    ],
)
def test_snapshot_due(entries: int, log_bytes: int, state: int, due: bool) -> None:
    got = snapshot_due(entries, log_bytes, _state(state), 20_000, 256 * MiB)  # type: ignore[arg-type]
    assert got is due


def test_the_state_is_measured_only_once_a_limit_is_reached() -> None:
    def never() -> int:
        raise AssertionError("measured the state below the limits")

    assert snapshot_due(10, MiB, never, 20_000, 256 * MiB) is False
