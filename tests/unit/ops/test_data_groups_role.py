"""Multi-raft in the deploy (issue 18): the node role renders
``data_groups`` and ``place_topics`` into node.toml, 0 (one data group per
voter, decided at a node's first start) and true by default, and an
inventory may found a cluster with a number of its own, or with group 0
alone (1)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from node_daemon.config import load_config
from node_daemon.store.founded_data_groups import founded_data_groups
from tests.unit.ops.test_metrics_host_role import ROOT, render

pytestmark = pytest.mark.unit


def test_a_deployed_node_runs_one_data_group_per_voter_by_default(tmp_path: Path) -> None:
    cfg = load_config(render("roadlog_node", "node.toml.j2", {}, tmp_path), {})
    assert cfg.data_groups == 0 and cfg.place_topics  # 0: one per voter, at the first start
    peers = {1: "10.0.0.1:7400", 2: "10.0.0.2:7400", 3: "10.0.0.3:7400"}
    founding = replace(cfg, node_id=1, peers=peers, data_dir=tmp_path / "data")
    assert founded_data_groups(founding) == 3


def test_an_inventory_keeps_every_ping_in_group_0(tmp_path: Path) -> None:
    inventory = {"roadlog_node_data_groups": 1}
    cfg = load_config(render("roadlog_node", "node.toml.j2", inventory, tmp_path), {})
    assert cfg.data_groups == 1 and cfg.placement_groups == 1


def test_an_inventory_founds_a_cluster_with_placed_data_groups(tmp_path: Path) -> None:
    inventory = {"roadlog_node_data_groups": 3, "roadlog_node_place_topics": "yes"}
    cfg = load_config(render("roadlog_node", "node.toml.j2", inventory, tmp_path), {})
    assert cfg.data_groups == 3 and cfg.place_topics
    assert cfg.placement_groups == 3


def test_the_variables_are_documented_with_their_defaults() -> None:
    spec = yaml.safe_load((ROOT / "roles/roadlog_node/meta/argument_specs.yml").read_text())
    options = spec["argument_specs"]["main"]["options"]
    defaults = yaml.safe_load((ROOT / "roles/roadlog_node/defaults/main.yml").read_text())
    for name, kind in (("roadlog_node_data_groups", "int"), ("roadlog_node_place_topics", "bool")):
        assert options[name]["type"] == kind
        assert options[name]["default"] == defaults[name]
