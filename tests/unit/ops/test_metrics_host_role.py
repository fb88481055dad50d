"""Where the deployed metrics ports listen (issue 19, finding 15): the node
and queue roles render node.toml and queue.toml, with the roles' own
defaults, to files the daemons load whose ``metrics_host`` is the host's
address on the hosts' private network (``ansible_host``), not every
address, and an inventory may set another (or "" for every address again)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml

from node_daemon.config import load_config
from queue_server.config import load_queue_config

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]

# A host of inventory/lab.ini as Ansible sees it when it renders its files.
HOST: dict[str, Any] = {
    "inventory_hostname": "lab2",
    "ansible_host": "10.77.0.12",
    "ansible_managed": "Ansible managed",
    "playbook_dir": "/srv/roadlog/playbooks",
    "groups": {"nodes": ["lab1", "lab2", "lab3"], "queue_servers": ["lab1", "lab2"]},
    "hostvars": {f"lab{i}": {"ansible_host": f"10.77.0.1{i}"} for i in (1, 2, 3)},
}


def ansible_bool(value: object) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("yes", "on", "1", "true", "y", "t")
    return bool(value)


def environment() -> jinja2.Environment:
    """Jinja as Ansible's template module renders, with the filters the
    roles' templates and defaults use."""
    env = jinja2.Environment(
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=True
    )
    env.filters["bool"] = ansible_bool
    env.filters["to_json"] = json.dumps
    env.filters["extract"] = lambda item, container: container[item]
    env.filters["regex_replace"] = lambda value, pattern, repl: re.sub(pattern, repl, value)
    return env


def role_vars(
    env: jinja2.Environment, role: str, inventory: dict[str, Any], host: dict[str, Any]
) -> dict[str, Any]:
    """The variables ``host`` has in ``role``: the inventory's win over the
    role's defaults (and roadlog_common's), each templated default resolved
    against the rest, in order, as Ansible does lazily."""
    context: dict[str, Any] = dict(host)
    for r in ("roadlog_common", role):
        for k, v in yaml.safe_load((ROOT / f"roles/{r}/defaults/main.yml").read_text()).items():
            if k in inventory:
                continue
            text = str(v).strip()
            if isinstance(v, str) and "{{" in text:
                whole = text.startswith("{{") and text.endswith("}}") and text.count("{{") == 1
                context[k] = (
                    env.compile_expression(text[2:-2].strip(), undefined_to_none=False)(**context)
                    if whole  # one expression: its value as it is (a list, an int, a bool)
                    else env.from_string(text).render(context)
                )
            else:
                context[k] = v
    return context | inventory


ROLES = [
    pytest.param("roadlog_node", "node.toml.j2", load_config, id="node"),
    pytest.param("roadlog_queue", "queue.toml.j2", load_queue_config, id="queue"),
]


def render(
    role: str, template: str, inventory: dict[str, Any], where: Path, host: dict[str, Any] = HOST
) -> Path:
    env = environment()
    env.loader = jinja2.FileSystemLoader(ROOT / f"roles/{role}/templates")
    out = where / template.removesuffix(".j2")
    out.write_text(env.get_template(template).render(role_vars(env, role, inventory, host)))
    return out


@pytest.mark.parametrize(("role", "template", "load"), ROLES)
def test_the_metrics_port_binds_the_hosts_private_address_not_every_address(
    role: str, template: str, load: Callable[..., Any], tmp_path: Path
) -> None:
    config = render(role, template, {}, tmp_path)
    cfg = load(config, {})
    assert cfg.listen.startswith("0.0.0.0:")  # the client and cluster ports: every address
    assert cfg.metrics_host == "10.77.0.12"  # /metrics, /healthz, /readyz: ansible_host only
    assert re.search(r'^metrics_host = "10\.77\.0\.12"$', config.read_text(), flags=re.M)
    # A host without an ansible_host: its inventory name (what Ansible dials).
    named = {k: v for k, v in HOST.items() if k != "ansible_host"}
    (tmp_path / "named").mkdir()
    assert load(render(role, template, {}, tmp_path / "named", named), {}).metrics_host == "lab2"


@pytest.mark.parametrize(("role", "template", "load"), ROLES)
@pytest.mark.parametrize("address", ["192.168.40.12", ""])
def test_the_inventory_may_bind_it_elsewhere_or_everywhere(
    role: str, template: str, load: Callable[..., Any], address: str, tmp_path: Path
) -> None:
    cfg = load(render(role, template, {f"{role}_metrics_host": address}, tmp_path), {})
    assert cfg.metrics_host == address  # "": the daemon binds listen's host, 0.0.0.0


@pytest.mark.parametrize("role", ["roadlog_node", "roadlog_queue"])
def test_the_variable_is_documented_with_its_default(role: str) -> None:
    spec = yaml.safe_load((ROOT / f"roles/{role}/meta/argument_specs.yml").read_text())
    option = spec["argument_specs"]["main"]["options"][f"{role}_metrics_host"]
    assert option["type"] == "str" and "ansible_host" in " ".join(option["description"])
    defaults = yaml.safe_load((ROOT / f"roles/{role}/defaults/main.yml").read_text())
    assert defaults[f"{role}_metrics_host"] == "{{ ansible_host | default(inventory_hostname) }}"
