"""Multi-raft in the deploy (issue 18): the node role renders
``data_groups`` and ``place_topics`` into node.toml, 1 and false by
default (a cluster as before), and an inventory may found a cluster with
data groups whose topics are placed in them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from node_daemon.config import load_config
from tests.unit.test_metrics_host_role import ROOT, render

pytestmark = pytest.mark.unit


def test_a_deployed_node_runs_group_0_alone_by_default(tmp_path: Path) -> None:
    cfg = load_config(render("roadlog_node", "node.toml.j2", {}, tmp_path), {})
    assert cfg.data_groups == 1 and not cfg.place_topics
    assert cfg.placement_groups == 1


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
