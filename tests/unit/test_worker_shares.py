"""Which worker process runs which data group (multi-raft step 5): group g
in worker (g-1) mod W, every group in exactly one worker, no worker empty,
the same map on every node with the same W."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node_daemon.worker_process import shares, worker_of
from roadlog.placement import MAX_DATA_GROUPS

pytestmark = pytest.mark.unit


def test_the_documented_map() -> None:
    assert shares(4, 2) == [(1, 3), (2, 4)]
    assert shares(6, 3) == [(1, 4), (2, 5), (3, 6)]
    assert shares(3, 8) == [(1,), (2,), (3,)]  # at most one worker per group
    assert shares(5, 1) == [(1, 2, 3, 4, 5)]
    assert [worker_of(g, 2) for g in (1, 2, 3, 4)] == [0, 1, 0, 1]


@given(st.integers(1, MAX_DATA_GROUPS), st.integers(1, MAX_DATA_GROUPS))
def test_every_group_in_exactly_one_worker_and_none_empty(groups: int, workers: int) -> None:
    got = shares(groups, workers)
    assert len(got) == min(groups, workers)
    assert all(got)
    flat = [g for share in got for g in share]
    assert sorted(flat) == list(range(1, groups + 1))
    for w, share in enumerate(got):
        assert all(worker_of(g, len(got)) == w for g in share)


def test_worker_ports_leave_two_ports_for_each_worker() -> None:
    from node_daemon.config import ConfigError, NodeConfig

    ok = NodeConfig(node_id=1, peers={1: "127.0.0.1:7400"}, workers=4, worker_ports=65527)
    ok.validate()
    for bad in (-1, 65530):
        cfg = NodeConfig(node_id=1, peers={1: "127.0.0.1:7400"}, workers=4, worker_ports=bad)
        with pytest.raises(ConfigError, match="worker_ports"):
            cfg.validate()
