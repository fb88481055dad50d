"""fab drill's temporary files (issue 19, finding 17): the probe writes into
a directory mktemp makes on the prober (an unguessable name, 0700), never a
fixed /tmp path a local user could plant a link at, and the directory is
removed also when the drill fails. SSH is replaced by a recorder: what is
checked is the commands fab sends."""

from __future__ import annotations

import importlib
import json
import secrets
import shlex
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from roadlog.leadership import HostView
from roadlog.tools.ops import SshHost

pytestmark = pytest.mark.unit

fabfile: Any = importlib.import_module("fabfile")

NODES = [SshHost("lab1", "10.77.0.11"), SshHost("lab2", "10.77.0.12")]


class FakeConn:
    user = "root"

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> FakeConn:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class Hosts:
    """Records every command per host and answers as the hosts would."""

    def __init__(self, probe_finishes: bool = True) -> None:
        self.commands: list[tuple[str, str]] = []
        self.made: list[str] = []
        self.probe_finishes = probe_finishes

    def connect(self, h: SshHost) -> FakeConn:
        return FakeConn(h.name)

    def run(self, conn: Any, cmd: str, as_user: str | None = None, warn: bool = False,
            stdin: str | None = None) -> Any:  # fmt: skip
        self.commands.append((conn.name, cmd))
        out, failed = "", False
        if cmd.startswith("mktemp -d "):
            template = cmd.split()[-1]
            assert template.endswith("XXXXXXXXXX"), template
            self.made.append(template.replace("XXXXXXXXXX", secrets.token_hex(5)))
            out = self.made[-1] + "\n"
        elif cmd.startswith("date "):
            out = "1000.0\n"
        elif cmd.startswith("test -f "):
            failed = not self.probe_finishes
        elif cmd.startswith("cat ") and cmd.endswith("/probe.json"):
            out = json.dumps({"acks": [999.5, 1000.2, 1001.0], "errors": 1})
        elif cmd.startswith("cat "):  # a config file on the prober: this machine's stand-in
            path = Path(cmd.split(maxsplit=1)[1])
            failed = not path.exists()
            out = "" if failed else path.read_text()
        return SimpleNamespace(stdout=out, stderr="", failed=failed)


@pytest.fixture
def hosts(monkeypatch: pytest.MonkeyPatch) -> Hosts:
    h = Hosts()
    monkeypatch.setattr(
        fabfile, "_inventory", lambda path: {"nodes": NODES, "queue_servers": NODES}
    )
    views = [
        HostView(host="lab1", reachable=True, ready=True, member=True, node_id=1, role="leader",
                 term=3, leader=1, service="active"),
        HostView(host="lab2", reachable=True, ready=True, member=True, node_id=2,
                 role="follower", term=3, leader=1, service="active"),
    ]  # fmt: skip
    monkeypatch.setattr(fabfile, "_wait_healthy", lambda nodes: views)
    monkeypatch.setattr(fabfile, "_connect", h.connect)
    monkeypatch.setattr(fabfile, "_run", h.run)
    clock = iter(range(0, 10**9, 30))  # each look at the clock: 30 s later
    monkeypatch.setattr(
        fabfile, "time", SimpleNamespace(sleep=lambda s: None, monotonic=lambda: next(clock))
    )
    return h


def test_the_probe_writes_only_into_the_directory_mktemp_made_and_it_is_removed(
    hosts: Hosts, capsys: pytest.CaptureFixture[str]
) -> None:
    fabfile.drill.body(None, seconds=3, json=True)
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["killed"] == "lab1" and report["acks"] == 3
    [work] = hosts.made
    on_prober = [c for name, c in hosts.commands if name == "lab2"]
    assert on_prober[0] == "mktemp -d /tmp/roadlog-drill.XXXXXXXXXX"
    probe = next(c for c in on_prober if "roadlog.tools.probe" in c)
    assert f"--out {work}/probe.json" in probe and f"HOME={work}" in probe
    # No other path under /tmp: every one is inside the made directory.
    for c in on_prober[1:]:
        for word in c.replace("'", " ").split():
            if word.startswith("/tmp") or "/tmp/" in word:
                assert word.split("=")[-1].startswith(work), (word, c)
    assert on_prober[-1] == f"rm -rf {work}"


def test_a_drill_whose_probe_never_finishes_still_removes_its_directory(hosts: Hosts) -> None:
    hosts.probe_finishes = False
    with pytest.raises(SystemExit, match="did not finish"):
        fabfile.drill.body(None, seconds=3, json=True)
    [work] = hosts.made
    assert hosts.commands[-1] == ("lab2", f"rm -rf {work}")


CERTS = "/etc/roadlog/certs"


@pytest.mark.parametrize(("config", "expected"), [
    ("insecure = true\n", {"ROADLOG_INSECURE": "1"}),
    ("insecure = false\n", {
        "ROADLOG_CA_FILE": f"{CERTS}/ca.crt",
        "ROADLOG_CERT_FILE": f"{CERTS}/client.ops.crt",
        "ROADLOG_KEY_FILE": f"{CERTS}/client.ops.key",
    }),
    ('certs_dir = "/srv/rl certs"\ninsecure = false\n', {
        "ROADLOG_CA_FILE": "/srv/rl certs/ca.crt",
        "ROADLOG_CERT_FILE": "/srv/rl certs/client.ops.crt",
        "ROADLOG_KEY_FILE": "/srv/rl certs/client.ops.key",
    }),
    (None, {
        "ROADLOG_CA_FILE": f"{CERTS}/ca.crt",
        "ROADLOG_CERT_FILE": f"{CERTS}/client.ops.crt",
        "ROADLOG_KEY_FILE": f"{CERTS}/client.ops.key",
    }),
])  # fmt: skip
def test_the_probe_dials_with_the_ca_and_the_operators_certificate_unless_the_queue_is_insecure(
    hosts: Hosts,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    config: str | None,
    expected: dict[str, str],
) -> None:
    """Issue 19: the drill's probe trusts the cluster's CA and presents the
    operators' client certificate from the prober's queue server certs_dir;
    plaintext only where that queue server runs insecure."""
    queue_toml = tmp_path / "queue.toml"
    if config is not None:
        queue_toml.write_text(f'listen = "0.0.0.0:7500"\n{config}')
    monkeypatch.setattr(fabfile, "QUEUE_CONFIG", str(queue_toml))
    fabfile.drill.body(None, seconds=3, json=True)
    launch = next(c for name, c in hosts.commands if "roadlog.tools.probe" in c)
    inner = shlex.split(launch)[3]  # nohup sh -c INNER: the prober's shell runs it
    # The probe's environment as that shell gives it (the probe itself left out).
    env_part = inner.split(" timeout ")[0]
    shown = subprocess.run(
        ["sh", "-c", f"{env_part} env"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    got = {k: v for k, _, v in (line.partition("=") for line in shown) if k in NAMES}
    assert got == expected


NAMES = ("ROADLOG_INSECURE", "ROADLOG_CA_FILE", "ROADLOG_CERT_FILE", "ROADLOG_KEY_FILE")


def test_a_queue_config_that_is_not_toml_stops_the_drill_before_the_probe(
    hosts: Hosts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    queue_toml = tmp_path / "queue.toml"
    queue_toml.write_text("insecure = = true\n")
    monkeypatch.setattr(fabfile, "QUEUE_CONFIG", str(queue_toml))
    with pytest.raises(SystemExit, match="not a daemon's TOML"):
        fabfile.drill.body(None, seconds=3, json=True)
    assert not any("roadlog.tools.probe" in c for _, c in hosts.commands)
    assert hosts.commands[-1][1].startswith("rm -rf ")  # its directory removed all the same
