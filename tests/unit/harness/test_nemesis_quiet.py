"""The quiet kinds of fault (wipes, corruptions, membership changes) take a
copy or a member only while a majority of the voters keeps its copy after:
with 3 nodes that is the rule the nemesis always had (every node a voter
holding its copy); with 5, two may be under way at once, never three.
And a nemesis run holds the bridge subnet's lock while it runs."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest

from tests import bridge_lock
from tests.nemesis.cluster import NemesisCluster, Service
from tests.nemesis.faults import Nemesis, Skip, keeps_a_majority
from tests.nemesis.history import Recorder
from tests.nemesis.schedule import Fault

pytestmark = pytest.mark.unit


def _subsets(nodes: set[int]) -> list[set[int]]:
    return [set(c) for k in range(len(nodes) + 1) for c in itertools.combinations(nodes, k)]


def test_with_three_nodes_a_quiet_fault_needs_every_node_a_voter_holding_its_copy() -> None:
    nodes = {1, 2, 3}
    for removed, lost in itertools.product(_subsets(nodes), _subsets(nodes)):
        for take, remove in itertools.product(nodes, (False, True)):
            before = not removed and not lost  # the rule before 5 nodes
            assert keeps_a_majority(nodes, removed, lost, take, remove) == before, (
                removed,
                lost,
                take,
                remove,
            )


def test_with_five_nodes_two_quiet_faults_may_overlap_never_three() -> None:
    nodes = {1, 2, 3, 4, 5}
    assert keeps_a_majority(nodes, set(), set(), 1, remove=False)
    assert keeps_a_majority(nodes, set(), {2}, 1, remove=False)  # a second copy
    assert not keeps_a_majority(nodes, set(), {2, 3}, 1, remove=False)  # not a third
    assert keeps_a_majority(nodes, set(), {2}, 1, remove=True)  # a member while one catches up
    assert keeps_a_majority(nodes, {2}, set(), 1, remove=False)  # a copy while one is out
    assert not keeps_a_majority(nodes, {2}, {3}, 1, remove=False)  # 2 of 4 voters would hold
    assert not keeps_a_majority(nodes, set(), {2, 3}, 1, remove=True)
    # Never the node already without its copy, nor one out of the configuration.
    assert not keeps_a_majority(nodes, set(), {1}, 1, remove=False)
    assert not keeps_a_majority(nodes, {1}, set(), 1, remove=True)


@dataclass
class _Svc:
    ident: int
    up: bool = True

    @property
    def name(self) -> str:
        return f"n{self.ident}"

    def running(self) -> bool:
        return self.up


@dataclass
class _Cluster:
    """What ``Nemesis`` asks of a cluster for a wipe: every node up and
    holding its copy on disk, leader 1 with every node a voter; a node says
    it is catching up while it is in ``catching``."""

    nodes: list[_Svc]
    root: Path
    catching: set[str] = field(default_factory=set)
    killed: list[str] = field(default_factory=list)

    @property
    def node_services(self) -> list[_Svc]:
        return self.nodes

    def group_dirs(self, svc: _Svc) -> dict[int, Path]:
        d = self.root / svc.name
        (d / "raft").mkdir(parents=True, exist_ok=True)
        return {0: d}

    def groups(self) -> list[int]:
        return [0]

    def catching_up(self, svc: _Svc) -> bool | None:
        return svc.name in self.catching

    def voters(self, leader: int, committed: bool = False) -> tuple[set[int], set[int]]:
        return {s.ident for s in self.nodes}, set()

    def data_groups_settled(self, voters: set[int], catching_up: set[int] | None = None) -> bool:
        return True

    def kill(self, svc: _Svc) -> None:
        svc.up = False
        self.killed.append(svc.name)

    def start(self, svc: _Svc) -> None:
        svc.up = True


def _nemesis(tmp_path: Path, n: int) -> tuple[Nemesis, _Cluster]:
    cluster = _Cluster([_Svc(k) for k in range(1, n + 1)], tmp_path / "disks")
    rec = Recorder(tmp_path / "history.jsonl")
    nem = Nemesis(cast(NemesisCluster, cluster), rec, [], seed=1)
    return nem, cluster


def _wipe(nem: Nemesis, k: int) -> Callable[[], None]:
    f = Fault(f"wipe-{k}", 0.0, "wipe", "follower", 1.0)

    def damage(svc: Service) -> dict[str, Any]:
        return {}

    heal, _ = nem._lose_a_copy(f, 1, damage)
    return heal


def test_with_five_nodes_a_second_copy_is_taken_while_the_first_catches_up(
    tmp_path: Path,
) -> None:
    nem, cluster = _nemesis(tmp_path, 5)
    try:
        heals = [_wipe(nem, 0)]
        heals.append(_wipe(nem, 1))  # the first is down, without its copy: a second may go
        first, second = cluster.killed
        assert first != second and "n1" not in cluster.killed  # followers, never the leader
        with pytest.raises(Skip, match="not caught up"):
            _wipe(nem, 2)
        # Started again, a node lacks its copy until it says it caught up.
        cluster.catching = {first, second}
        for heal in heals:
            heal()
        with pytest.raises(Skip, match="not caught up"):
            _wipe(nem, 3)
        cluster.catching = {first}
        _wipe(nem, 4)
        assert len(cluster.killed) == 3 and cluster.killed[2] != first
    finally:
        nem.rec.close()


def test_with_three_nodes_one_copy_at_a_time(tmp_path: Path) -> None:
    nem, cluster = _nemesis(tmp_path, 3)
    try:
        _wipe(nem, 0)
        with pytest.raises(Skip, match="not caught up"):
            _wipe(nem, 1)
        assert len(cluster.killed) == 1
    finally:
        nem.rec.close()


def test_a_nemesis_run_holds_the_bridge_subnet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.nemesis import run

    monkeypatch.setattr(bridge_lock, "LOCK", tmp_path / "bridge.lock")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    seen: list[str | None] = []

    def fake_run(*args: object) -> int:
        seen.append(bridge_lock.held_by_another())
        return 0

    monkeypatch.setattr(run, "run", fake_run)
    assert run.main(["--seconds", "1", "--dir", str(tmp_path / "run")]) == 0
    assert seen == [f"pid {os.getpid()}, nemesis, in {os.getcwd()}"]
    assert bridge_lock.held_by_another() is None  # released with the run
