"""Discovery's own key (issue 19): HELLOs are signed with a key derived from
the cluster secret by HKDF, so a client that finds queue servers holds that
key, not the secret; `roadlog-node discovery-key` prints it and the CLI's
--discovery-key-file takes it."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from discovery.agent import DiscoveryAgent
from discovery.core import DiscoveryCore
from discovery.listen import find_queue_servers
from discovery.protocol import Hello, Rejected, ReplayGuard, decode, discovery_key, encode
from node_daemon.process.main import cli as node_cli
from roadlog.cli.common import _discovery_key
from roadlog.runtime.processes import free_port

pytestmark = pytest.mark.unit

SECRET = bytes(range(40))


def test_the_key_is_hkdf_sha256_of_the_secret() -> None:
    expected = HKDF(
        algorithm=hashes.SHA256(), length=32, salt=b"roadlog", info=b"roadlog discovery v1"
    ).derive(SECRET)
    assert discovery_key(SECRET) == expected
    assert discovery_key(SECRET) != SECRET and discovery_key(SECRET + b"x") != expected


def test_hellos_are_signed_with_the_derived_key_not_the_secret() -> None:
    now = int(time.time() * 1000)
    h = Hello("munich", 7, "queue", "10.77.0.7:7500", ts_ms=now)
    key = discovery_key(SECRET)
    assert decode(encode(h, key), key, "munich", now, ReplayGuard()).node_id == 7
    with pytest.raises(Rejected):
        decode(encode(h, SECRET), key, "munich", now, ReplayGuard())
    agent = DiscoveryAgent(DiscoveryCore("munich", 7, "queue", "10.77.0.7:7500"), SECRET, 0)
    assert agent.key == key


def test_a_client_with_only_the_key_finds_a_queue_server() -> None:
    port = free_port()
    key = discovery_key(SECRET)
    found: list[str] = []
    listener = threading.Thread(
        target=lambda: found.extend(find_queue_servers(key, "munich", port, wait_s=5.0))
    )
    listener.start()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        deadline = time.monotonic() + 5.0
        n = 0
        while listener.is_alive() and time.monotonic() < deadline:
            n += 1  # a fresh nonce each time: the listener refuses replays
            h = Hello("munich", 7, "queue", "10.77.0.9:7500", ts_ms=int(time.time() * 1000))
            s.sendto(encode(h, key), ("127.0.0.1", port))
            time.sleep(0.05)
    listener.join(10)
    assert found == ["10.77.0.9:7500"], n


def test_roadlog_node_prints_the_key_and_the_cli_takes_it(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET.hex().encode() + b"\n")
    secret_file.chmod(0o600)
    out = CliRunner().invoke(node_cli, ["discovery-key", "--secret-file", str(secret_file)])
    assert out.exit_code == 0, out.output
    printed = out.output.strip()
    key_file = tmp_path / "discovery.key"
    key_file.write_text(printed + "\n")
    from_key = _discovery_key({"discovery_key_file": str(key_file)})
    from_secret = _discovery_key({"secret_file": str(secret_file)})
    assert from_key == from_secret == bytes.fromhex(printed)
    key_file.write_text("not hex\n")
    with pytest.raises(click.ClickException, match="discovery key"):
        _discovery_key({"discovery_key_file": str(key_file)})
    with pytest.raises(click.UsageError, match="discovery-key-file"):
        _discovery_key({})
