"""A Raft group's figures are read off its core in one place
(``replica.status.group_figures``) and every status is made of them: the
node's status and each group's in it, a group another process runs (as it
told them), and what a worker process tells the main process (each group
that moved, once a message)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from node_daemon.config import NodeConfig
from node_daemon.process import pipe_messages as pm
from node_daemon.process.worker_process import _Teller
from node_daemon.raft import ConfState, Role
from node_daemon.replica.remote import RemoteReplica
from node_daemon.replica.replica import Replica
from node_daemon.replica.status import (
    GroupFigures,
    figures_of,
    group_figures,
    group_status,
    node_readiness,
    node_status,
)
from roadlog.runtime.processes import free_port

pytestmark = pytest.mark.unit


def test_the_figures_are_the_cores_and_every_status_is_made_of_them(tmp_path: Path) -> None:
    async def main() -> None:
        addr = f"127.0.0.1:{free_port()}"
        cfg = NodeConfig(node_id=1, data_dir=tmp_path / "n1", listen=addr, peers={1: addr})
        node = Replica(cfg)
        await node.start()
        try:
            node.submit(lambda core: core.campaign())  # the only voter
            deadline = asyncio.get_running_loop().time() + 10
            while not (node.is_leader and node.sm.applied_index >= node.core.log.committed):
                assert asyncio.get_running_loop().time() < deadline, "no leader"
                await asyncio.sleep(0.01)
            f = group_figures(node)
            core = node.core
            assert f == GroupFigures(
                group=0,
                role=Role.LEADER,
                term=core.term,
                leader=1,
                commit_index=core.log.committed,
                applied_index=node.sm.applied_index,
                voters=(1,),
                learners=(),
                conf_index=core.conf_index,
                catching_up=False,
            )
            assert f.is_leader and f.term >= 1 and f.commit_index >= 1
            assert figures_of(node) == f and group_status(node) == f.status()
            ns = node_status(node)
            assert (ns.role, ns.term, ns.leader, ns.commit_index, ns.applied_index) == (
                "leader",
                f.term,
                1,
                f.commit_index,
                f.applied_index,
            )
            assert list(ns.voters) == [1] and ns.conf_index == f.conf_index
            assert list(ns.groups) == [f.status()]  # group 0's, from the same figures
            ready, detail = node_readiness(node, member=True)
            assert ready and detail["term"] == f.term and detail["role"] == "leader"
        finally:
            await node.stop()

    asyncio.run(main())


def test_a_group_another_process_runs_shows_what_it_told(tmp_path: Path) -> None:
    rg = RemoteReplica(2, tmp_path / "groups" / "2" / "state")
    assert figures_of(rg) is None
    st = group_status(rg)
    assert st.id == 2 and not st.role and not st.term  # not told yet: its id only
    f = GroupFigures(2, Role.CANDIDATE, 9, 0, 40, 38, (1, 2, 3), (), 12, True)
    rg.told(f)
    assert figures_of(rg) == f and group_status(rg) == f.status()
    assert group_status(rg).role == "candidate" and group_status(rg).catching_up
    assert rg.committed_index() == 40 and not rg.is_leader
    assert rg.conf_state() == ConfState(frozenset({1, 2, 3}))
    # Group 0 as a worker reads it: commit index and configuration only,
    # never led from there, no figures of its own.
    g0 = RemoteReplica(0, tmp_path / "state")
    g0.told_conf(7, (1, 2), (3,))
    assert (g0.committed_index(), g0.is_leader, figures_of(g0)) == (7, False, None)


class _Pipe:
    def __init__(self) -> None:
        self.sent: list[pm.Message] = []

    def send(self, msg: pm.Message, droppable: bool = False) -> bool:
        self.sent.append(msg)
        return True

    def close(self) -> None:
        pass


def _group(group: int) -> Any:
    core = SimpleNamespace(
        role=Role.FOLLOWER,
        term=3,
        lead=2,
        log=SimpleNamespace(committed=10),
        conf=ConfState(frozenset({3, 1, 2})),
        conf_index=4,
        catching_up=False,
    )
    return SimpleNamespace(group=group, core=core, sm=SimpleNamespace(applied_index=10))


def test_a_worker_tells_each_group_that_moved_once_a_message() -> None:
    pipe = _Pipe()
    one, two = _group(1), _group(2)
    teller = _Teller(pipe, {1: one, 2: two})  # type: ignore[arg-type]
    teller._tell()
    [first] = pipe.sent
    assert isinstance(first, pm.Groups)
    assert [(f.group, f.voters, f.commit_index) for f in first.figures] == [
        (1, (1, 2, 3), 10),
        (2, (1, 2, 3), 10),
    ]
    teller._tell()  # nothing moved: nothing told
    assert len(pipe.sent) == 1
    two.core.role, two.core.term, two.core.lead = Role.PRE_CANDIDATE, 3, 0
    teller._tell()
    [moved] = pipe.sent[1:]
    assert isinstance(moved, pm.Groups)
    assert [(f.group, f.role, f.leader) for f in moved.figures] == [(2, Role.PRE_CANDIDATE, 0)]
    assert pm.decode(pm.encode(moved)) == moved
