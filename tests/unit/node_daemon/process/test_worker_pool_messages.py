"""The main process's side of its workers' pipes (``WorkerPool._take``):
each kind a worker sends is taken as the typed message it is, and a message
a worker never sends is logged and left, never raised; a scrape asks the
running workers for their metrics; the pool looks when poked, not on a
short timer."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from node_daemon.process import pipe_messages as pm
from node_daemon.process import worker_pool
from node_daemon.process.worker_metrics import WorkerMetrics
from node_daemon.process.worker_pool import WorkerPool, remote_replicas
from node_daemon.raft import Role
from node_daemon.replica.status import GroupFigures, group_status
from tests.unit.node_daemon.replica.test_group_figures import _Pipe
from tests.unit.support.loops import run_bounded, until

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
    rg = pool.remote[2]
    assert group_status(rg).id == 2 and not group_status(rg).role  # not told yet: its id only
    fig = GroupFigures(2, Role.LEADER, 5, 1, 30, 29, (1, 2, 3), (4,), 7, False)
    pool._take(w, pm.Groups((fig,)))
    assert rg.committed_index() == 30 and rg.is_leader
    assert rg.conf_state().voters == {1, 2, 3} and rg.conf_state().learners == {4}
    assert group_status(rg) == fig.status()  # the status is made of the figures told
    st = group_status(rg)
    assert (st.role, st.term, st.leader, st.applied_index, st.conf_index) == ("leader", 5, 1, 29, 7)
    # Figures told again with a lower commit index (a restarted worker) never
    # move the view's commit index back; the status is the latest told.
    pool._take(
        w, pm.Groups((GroupFigures(2, Role.FOLLOWER, 6, 3, 20, 20, (1, 2, 3), (), 7, True),))
    )
    assert rg.committed_index() == 30 and not rg.is_leader and group_status(rg).term == 6


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


def test_a_scrape_asks_each_running_worker_once_and_waits_for_those(tmp_path: Path) -> None:
    pool, _ = _pool(tmp_path)
    pipe: Any = _Pipe()
    pool.workers[1].pipe = pipe  # worker 0 has no pipe (not running)
    asked: list[set[int]] = []
    assert pool.metrics is not None
    pool.metrics.asked = lambda workers: asked.append(set(workers))  # type: ignore[method-assign]
    pool.ask_metrics()
    assert pipe.sent == [pm.AskMetrics()] and asked == [{1}]
    pool._take(pool.workers[1], pm.Metrics("roadlog_x 2.0\n"))
    assert pool.metrics._texts == {1: "roadlog_x 2.0\n"}


def test_the_pool_looks_when_poked_not_on_a_short_timer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Idle, nothing but a poke (group 0 moved, a worker exited), a dead
    worker's restart coming due, or LOOK_EVERY_S has the pool look."""
    monkeypatch.setattr(worker_pool, "SUPERVISE_S", 0.001)
    monkeypatch.setattr(worker_pool, "LOOK_EVERY_S", 3600.0)

    async def body() -> None:
        pool, _ = _pool(tmp_path)
        looks: list[float] = []

        async def look() -> None:
            looks.append(time.monotonic())

        pool._look = look  # type: ignore[method-assign]
        for w in pool.workers:  # both running: no restart is due
            w.process = cast(Any, SimpleNamespace())
        task = asyncio.get_running_loop().create_task(pool._supervise())
        await until(lambda: len(looks) == 1, "the first look")  # none poked: it waits
        for _ in range(20):  # turns of the loop: it does not look again unpoked
            await asyncio.sleep(0)
        assert len(looks) == 1
        pool.poke()
        await until(lambda: len(looks) == 2, "a look once poked")
        now = time.monotonic()
        assert pool._next_look_in(now) == 3600.0
        pool.workers[0].process, pool.workers[0].due = None, now + 0.5
        assert 0.4 < pool._next_look_in(now) <= 0.5  # its restart is due then
        pool._stopping = True
        pool.poke()
        await asyncio.wait_for(task, 5)

    run_bounded(body)
