"""Which worker process runs which data group (multi-raft step 5): group g
in worker (g-1) mod W, every group in exactly one worker, no worker empty,
the same map on every node with the same W."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node_daemon.process.worker_process import shares, worker_of
from roadlog.placement import MAX_DATA_GROUPS, worker_processes

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

    peers = {1: "127.0.0.1:7400"}
    ok = NodeConfig(node_id=1, peers=peers, data_groups=4, workers=4, worker_ports=65527)
    ok.validate()
    for bad in (-1, 65530):
        cfg = NodeConfig(node_id=1, peers=peers, data_groups=4, workers=4, worker_ports=bad)
        with pytest.raises(ConfigError, match="worker_ports"):
            cfg.validate()
    # Four workers asked for but two data groups: two run, two ports each.
    NodeConfig(node_id=1, peers=peers, data_groups=2, workers=4, worker_ports=65531).validate()


def test_by_default_one_worker_per_core_at_most_one_per_group() -> None:
    """``workers`` 0 (the default): one per core this process may run on;
    never more than the data groups; none (1) with one group."""
    from node_daemon.config import NodeConfig

    cores = len(os.sched_getaffinity(0))
    peers = {1: "127.0.0.1:7400"}
    assert NodeConfig(node_id=1, peers=peers).workers == 0
    assert NodeConfig(node_id=1, peers=peers).worker_processes == 1  # one group: none
    assert worker_processes(1, 8) == 1
    assert worker_processes(64, 0) == min(cores, 64)
    assert worker_processes(3, 0) == min(cores, 3)
    assert worker_processes(3, 8) == 3
    assert worker_processes(6, 2) == 2
    assert worker_processes(6, 1) == 1
