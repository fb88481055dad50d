"""The data groups a node runs when ``data_groups`` is left at its default:
one per voter, decided once, at the first start, and kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from node_daemon.config import NodeConfig
from node_daemon.store.founded_data_groups import decide_data_groups, founded_data_groups, to_adopt
from roadlog.placement import DATA_GROUPS_RECORD

pytestmark = pytest.mark.unit

THREE = {1: "127.0.0.1:7400", 2: "127.0.0.1:7402", 3: "127.0.0.1:7404"}


def config(data: Path, **kw: object) -> NodeConfig:
    base: dict[str, object] = {"node_id": 1, "peers": THREE, "data_dir": data}
    return NodeConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_the_default_is_one_data_group_per_voter_and_places_topics(tmp_path: Path) -> None:
    cfg = config(tmp_path / "d")
    assert cfg.data_groups == 0 and cfg.place_topics
    assert founded_data_groups(cfg) == 3
    assert (tmp_path / "d" / DATA_GROUPS_RECORD).read_text() == "3\n"


@pytest.mark.parametrize(
    ("kw", "voters"),
    [
        ({"peers": {1: "127.0.0.1:7400"}}, 1),  # one node: one group
        ({"voters": 5, "peers": {i: f"127.0.0.1:{7400 + i}" for i in range(1, 6)}}, 5),
        ({"peers": {i: f"127.0.0.1:{7400 + i}" for i in range(1, 6)}}, 3),  # 2 standbys
        ({"peers": {}, "discovery_port": 7499, "bootstrap_expect": 5}, 5),
        ({"peers": {}, "discovery_port": 7499}, 3),  # a joiner: the default voters
    ],
    ids=["one-node", "five-voters", "three-voters-two-standbys", "discovery", "joiner"],
)
def test_one_per_voter_counts_the_voters_the_cluster_is_founded_with(
    tmp_path: Path, kw: dict[str, object], voters: int
) -> None:
    assert founded_data_groups(config(tmp_path, **kw)) == voters


def test_the_first_starts_number_is_kept_whatever_the_voters_become(tmp_path: Path) -> None:
    assert founded_data_groups(config(tmp_path)) == 3
    # The cluster grew to 5 voters: this node still runs the groups it was founded with.
    five = {i: f"127.0.0.1:{7400 + i}" for i in range(1, 6)}
    assert founded_data_groups(config(tmp_path, voters=5, peers=five)) == 3


def test_a_data_directory_from_before_the_default_keeps_one_group(tmp_path: Path) -> None:
    (tmp_path / "raft").mkdir()  # a node's log, made when one group was the default
    assert founded_data_groups(config(tmp_path)) == 1
    assert (tmp_path / DATA_GROUPS_RECORD).read_text() == "1\n"


def test_a_data_directory_with_data_groups_and_no_record_keeps_them(tmp_path: Path) -> None:
    for g in (1, 2, 4):
        (tmp_path / "groups" / str(g)).mkdir(parents=True)
    (tmp_path / "raft").mkdir()
    assert founded_data_groups(config(tmp_path)) == 4


def test_a_configured_number_is_used_as_it_is_and_not_recorded(tmp_path: Path) -> None:
    assert founded_data_groups(config(tmp_path, data_groups=2)) == 2
    assert founded_data_groups(config(tmp_path, data_groups=1)) == 1
    assert not (tmp_path / DATA_GROUPS_RECORD).exists()


def test_a_damaged_record_is_refused_not_guessed(tmp_path: Path) -> None:
    (tmp_path / DATA_GROUPS_RECORD).write_text("0\n")
    with pytest.raises(ValueError, match="not a number of data groups"):
        founded_data_groups(config(tmp_path))
    (tmp_path / DATA_GROUPS_RECORD).write_text("three\n")
    with pytest.raises(ValueError):
        founded_data_groups(config(tmp_path))


def test_a_node_that_decided_its_own_number_takes_the_clusters(tmp_path: Path) -> None:
    assert to_adopt(True, 5, 3) == 3  # joined with 5 voters configured; founded with 3
    assert to_adopt(True, 3, 3) is None
    assert to_adopt(True, 5, None) is None  # no topic yet: nothing decided
    assert to_adopt(False, 2, 3) is None  # a configured number is the operator's
    five = {i: f"127.0.0.1:{7400 + i}" for i in range(1, 6)}
    cfg = config(tmp_path, voters=5, peers=five)
    assert founded_data_groups(cfg) == 5
    decide_data_groups(cfg, 3)
    assert founded_data_groups(cfg) == 3  # the next start runs the cluster's groups
