"""Every numeric (and true/false) key of the node's and the queue server's
configuration refuses a value of the wrong type at start, naming the key
(issue 39): a quoted number in the TOML (``http_body_timeout_s = "30"``, as
a template easily writes), a boolean for a number, a fraction for an
integer, a non-finite number. The keys are taken from the declarations, so
a key added later is covered too. A flag's text is parsed (the command line
has no types), and refused when it does not parse."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, get_type_hints

import pytest
from click.testing import CliRunner

from node_daemon.config import NodeConfig, load_config
from queue_server.config import QueueConfig, load_queue_config
from roadlog.runtime.config import ConfigError, keys
from roadlog.runtime.config_types import typed

pytestmark = pytest.mark.unit

# A node config that validates (a peer list); the key under test is written after.
NODE_BASE = {"node_id": 1, "peers": ["1=127.0.0.1:7400"]}


def numeric(cls: type) -> list[tuple[str, Any]]:
    hints = get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in keys(cls) if hints[f.name] in (int, float, bool)]


LOADERS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "node": (NodeConfig, load_config, NODE_BASE),
    "queue": (QueueConfig, load_queue_config, {}),
}
CASES = [(d, k, t) for d, (cls, _, _) in LOADERS.items() for k, t in numeric(cls)]


def load_toml(tmp_path: Path, daemon: str, line: str) -> Any:
    _, loader, base = LOADERS[daemon]
    name = line.split("=")[0].strip()
    f = tmp_path / f"{daemon}.toml"
    f.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in base.items() if k != name) + line)
    return loader(f, {})


def good_value(daemon: str, name: str) -> Any:
    cls, _, base = LOADERS[daemon]
    return base.get(name, getattr(cls(), name))


def test_the_declarations_have_numeric_keys_of_each_kind() -> None:
    kinds = {t for _, _, t in CASES}
    assert kinds == {int, float, bool}, kinds
    assert ("queue", "http_body_timeout_s", float) in CASES
    assert ("queue", "clients_used_report_s", float) in CASES
    assert len(CASES) >= 40


@pytest.mark.parametrize(("daemon", "name", "kind"), CASES)
def test_a_value_of_the_wrong_type_in_the_toml_is_refused_naming_the_key(
    daemon: str, name: str, kind: Any, tmp_path: Path
) -> None:
    default = good_value(daemon, name)
    wrong = [f'{name} = "{json.dumps(default)}"']  # the right value, quoted: text
    if kind is bool:
        wrong += [f"{name} = 1"]
    else:
        wrong += [f"{name} = true", f"{name} = nan" if kind is float else f"{name} = 1.5"]
    for line in wrong:
        with pytest.raises(ConfigError, match=rf"^{name}: must be "):
            load_toml(tmp_path, daemon, line)
    right = f"{name} = {json.dumps(default)}"
    got = getattr(load_toml(tmp_path, daemon, right), name)
    assert got == default and type(got) is kind


def test_an_integer_is_a_number_and_a_flag_is_parsed(tmp_path: Path) -> None:
    q = load_toml(tmp_path, "queue", "http_body_timeout_s = 12")
    assert q.http_body_timeout_s == 12.0 and isinstance(q.http_body_timeout_s, float)
    q = load_queue_config(None, {"http_body_timeout_s": "7.5", "max_reads": " 9 "})
    assert (q.http_body_timeout_s, q.max_reads) == (7.5, 9)
    with pytest.raises(ConfigError, match=r"^http_body_timeout_s: must be a number, not 'soon'"):
        load_queue_config(None, {"http_body_timeout_s": "soon"})
    with pytest.raises(ConfigError, match=r"^max_reads: must be an integer, not '1\.5'"):
        load_queue_config(None, {"max_reads": "1.5"})
    with pytest.raises(ConfigError, match=r"^insecure: must be true or false"):
        load_queue_config(None, {"insecure": "yes"})
    with pytest.raises(
        ConfigError, match=r"^tick_ms: must be an integer, not the text '20' \(write"
    ):
        load_toml(tmp_path, "node", 'tick_ms = "20"')


def test_typed_leaves_other_kinds_alone() -> None:
    assert typed(str, 5, text=False) == 5  # not a numeric key: other checks' business
    assert typed(Path, "x", text=True) == "x"
    with pytest.raises(ValueError, match="finite"):
        typed(float, float("inf"), text=False)


@pytest.mark.parametrize("daemon", ["node", "queue"])
def test_a_daemon_refuses_to_start_with_a_quoted_number(daemon: str, tmp_path: Path) -> None:
    """At start: one line naming the key, exit status 2, nothing run."""
    if daemon == "node":
        from node_daemon.process.main import cli

        line, key = 'tick_ms = "20"', "tick_ms"
    else:
        from queue_server.main import cli

        line, key = 'http_body_timeout_s = "30"', "http_body_timeout_s"
    f = tmp_path / "daemon.toml"
    base = LOADERS[daemon][2]
    f.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in base.items()) + line + "\n")
    r = CliRunner().invoke(cli, ["run", "--config", str(f)])
    assert r.exit_code == 2, r.output
    assert f"{key}: must be a number" in r.output or f"{key}: must be an integer" in r.output
