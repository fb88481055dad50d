"""The main process's side of its workers' pipes (``WorkerPool._take``):
each kind a worker sends is taken as the typed message it is, and a message
a worker never sends is logged and left, never raised."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from node_daemon.process import pipe_messages as pm
from node_daemon.process.worker_metrics import WorkerMetrics
from node_daemon.process.worker_pool import WorkerPool, remote_replicas

pytestmark = pytest.mark.unit


class _Transport:
    def __init__(self) -> None:
        self.group_ports: dict[int, int] = {}

    def set_group_ports(self, ports: dict[int, int]) -> None:
        self.group_ports = dict(ports)


def _pool(tmp_path: Path) -> tuple[WorkerPool, _Transport]:
    cfg: Any = SimpleNamespace(
        data_dir=str(tmp_path), data_groups=3, worker_processes=2, worker_ports=0
    )
    transport = _Transport()
    meta: Any = SimpleNamespace(transport=transport)
    pool = WorkerPool(cfg, meta, remote_replicas(cfg), list, WorkerMetrics())
    return pool, transport


def test_each_kind_a_worker_sends_is_taken(tmp_path: Path) -> None:
    pool, transport = _pool(tmp_path)
    w = pool.workers[1]  # group 2
    pool._take(w, pm.Ports(7412, 7413))
    assert (w.grpc_port, w.frames_port) == (7412, 7413)
    assert transport.group_ports == {1: 0, 2: 7412, 3: 0}
    pool._take(w, pm.Metrics("roadlog_x 1.0\n"))
    assert pool.metrics is not None and pool.metrics._texts == {1: "roadlog_x 1.0\n"}
    status = b"\x08\x02"  # GroupStatus(id=2)
    pool._take(w, pm.Groups((pm.GroupTold(2, 30, (1, 2, 3), (4,), True, status),)))
    rg = pool.remote[2]
    assert rg.committed_index() == 30 and rg.is_leader
    assert rg.conf_state().voters == {1, 2, 3} and rg.conf_state().learners == {4}
    assert rg.status is not None and rg.status.id == 2


def test_a_kind_a_worker_never_sends_is_logged_and_left(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pool, _ = _pool(tmp_path)
    with caplog.at_level(logging.ERROR, logger="roadlog.node"):
        pool._take(pool.workers[0], pm.Stop())
        pool._take(pool.workers[0], pm.HandOver(3))
    assert [r.getMessage() for r in caplog.records] == [
        "a message a worker does not send: ignored"
    ] * 2
    assert [getattr(r, "kind", None) for r in caplog.records] == ["Stop", "HandOver"]
