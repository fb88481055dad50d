"""Each config key is declared once (its type, default and help, in the
config dataclass) and everything else agrees with that declaration: the
daemon's flags, the example TOML files, the Ansible roles' templates and
argument specs, and the README."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import click
import pytest
import yaml

from node_daemon.config import NodeConfig
from node_daemon.process.main import cli as node_cli
from queue_server.config import QueueConfig
from queue_server.main import cli as queue_cli
from roadlog.runtime.config import keys

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[4]
DAEMONS = [
    pytest.param(NodeConfig, node_cli, "node", "roadlog_node", id="node"),
    pytest.param(QueueConfig, queue_cli, "queue", "roadlog_queue", id="queue"),
]


def names(cls: type) -> list[str]:
    return [f.name for f in keys(cls)]


@pytest.mark.parametrize(("cls", "cli", "short", "role"), DAEMONS)
def test_every_key_says_what_it_means_and_is_a_flag(
    cls: type, cli: click.Group, short: str, role: str
) -> None:
    for f in keys(cls):
        assert len(f.metadata["help"]) > 8, f.name
    run = cli.commands["run"]
    flags = {p.name for p in run.params}
    assert set(names(cls)) <= flags
    assert flags - set(names(cls)) == {"config_path"}


@pytest.mark.parametrize(("cls", "cli", "short", "role"), DAEMONS)
def test_the_example_file_sets_exactly_the_keys(
    cls: type, cli: click.Group, short: str, role: str
) -> None:
    example = tomllib.loads((ROOT / f"etc/{short}.toml.example").read_text())
    assert sorted(example) == sorted(names(cls))


@pytest.mark.parametrize(("cls", "cli", "short", "role"), DAEMONS)
def test_the_roles_template_sets_only_keys_and_documents_its_variables(
    cls: type, cli: click.Group, short: str, role: str
) -> None:
    template = (ROOT / f"roles/{role}/templates/{short}.toml.j2").read_text()
    set_keys = re.findall(r"^(\w+) = ", template, flags=re.M)
    assert set_keys and set(set_keys) <= set(names(cls))
    used = set(re.findall(rf"\b({role}_\w+)\b", template))
    spec = yaml.safe_load((ROOT / f"roles/{role}/meta/argument_specs.yml").read_text())
    documented = set(spec["argument_specs"]["main"]["options"])
    assert used <= documented, used - documented
    defaults = yaml.safe_load((ROOT / f"roles/{role}/defaults/main.yml").read_text())
    assert used <= set(defaults), used - set(defaults)


@pytest.mark.parametrize(("cls", "cli", "short", "role"), DAEMONS)
def test_the_readme_names_every_key(cls: type, cli: click.Group, short: str, role: str) -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [k for k in names(cls) if f"`{k}`" not in readme]
    assert not missing, missing
