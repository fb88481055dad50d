"""fab checks SSH host keys (issue 19, finding 17): Fabric's own default
accepts any key; fabfile's connections refuse a host that is in no
known-hosts file and a key that changed, and trust a new host only when
ROADLOG_SSH_ACCEPT_NEW_HOST_KEYS says so (loudly, remembering the key).

A real SSH handshake with an in-process paramiko server on loopback."""

from __future__ import annotations

import importlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paramiko  # type: ignore[import-untyped]
import pytest

from roadlog.tools.ops import SshHost

pytestmark = pytest.mark.unit

# Loaded by name: fabfile is a script of Fabric tasks, outside the type-checked packages.
fabfile: Any = importlib.import_module("fabfile")


class _AnyPassword(paramiko.ServerInterface):  # type: ignore[misc]
    def get_allowed_auths(self, username: str) -> str:
        return "password"

    def check_auth_password(self, username: str, password: str) -> int:
        return int(paramiko.AUTH_SUCCESSFUL)


class SshServer:
    """An SSH server on 127.0.0.1 that presents `host_key` and lets anyone in."""

    def __init__(self, host_key: paramiko.PKey) -> None:
        self.host_key = host_key
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.transports: list[paramiko.Transport] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            t = paramiko.Transport(conn)
            t.add_server_key(self.host_key)
            self.transports.append(t)
            # With an event it returns at once; the transport runs its own thread.
            t.start_server(event=threading.Event(), server=_AnyPassword())

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self.sock.close()
        for t in self.transports:
            t.close()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


@pytest.fixture
def host_key() -> paramiko.PKey:
    return paramiko.ECDSAKey.generate()


@pytest.fixture
def server(host_key: paramiko.PKey) -> Iterator[SshServer]:
    s = SshServer(host_key)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def known_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "known_hosts"
    monkeypatch.setenv("ROADLOG_KNOWN_HOSTS", str(path))
    monkeypatch.delenv("ROADLOG_SSH_ACCEPT_NEW_HOST_KEYS", raising=False)
    return path


def connect(server: SshServer) -> Any:
    """fabfile's Connection to the server, opened (password auth for the test)."""
    conn = fabfile._connect(SshHost("h", "127.0.0.1", user="ops", port=server.port))
    conn.connect_kwargs.update(password="pw", look_for_keys=False, allow_agent=False)
    conn.open()
    return conn


def entry(server: SshServer, key: paramiko.PKey) -> str:
    return f"[127.0.0.1]:{server.port} {key.get_name()} {key.get_base64()}\n"


def test_an_unknown_host_is_refused_and_nothing_is_remembered(
    server: SshServer, known_hosts: Path, host_key: paramiko.PKey
) -> None:
    with pytest.raises(fabfile.UnknownHostKey) as e:
        connect(server)
    message = str(e.value)
    assert host_key.fingerprint in message and "ROADLOG_SSH_ACCEPT_NEW_HOST_KEYS" in message
    assert not known_hosts.exists()
    # Fabric alone would have connected: the policy is what refuses.
    assert isinstance(fabfile.Connection("127.0.0.1").client._policy, paramiko.AutoAddPolicy)


def test_a_known_host_connects_and_a_changed_key_is_refused_even_when_accepting_new(
    server: SshServer, known_hosts: Path, host_key: paramiko.PKey, monkeypatch: pytest.MonkeyPatch
) -> None:
    known_hosts.write_text("# ours\n" + entry(server, host_key))
    conn = connect(server)
    assert conn.is_connected
    conn.close()
    known_hosts.write_text(entry(server, paramiko.ECDSAKey.generate()))
    monkeypatch.setenv("ROADLOG_SSH_ACCEPT_NEW_HOST_KEYS", "1")
    with pytest.raises(paramiko.BadHostKeyException):
        connect(server)


def test_accepting_new_keys_says_so_loudly_and_remembers_them(
    server: SshServer,
    known_hosts: Path,
    host_key: paramiko.PKey,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    other = paramiko.ECDSAKey.generate()
    kept = f"other.example {other.get_name()} {other.get_base64()}\n"
    known_hosts.write_text(kept)
    monkeypatch.setenv("ROADLOG_SSH_ACCEPT_NEW_HOST_KEYS", "1")
    connect(server).close()
    err = capsys.readouterr().err
    assert "WITHOUT CHECKING" in err and host_key.fingerprint in err, err
    # Appended; the file's other lines are kept.
    lines = known_hosts.read_text().splitlines(keepends=True)
    assert lines == [kept, entry(server, host_key)]
    # The next run checks the key it remembered, without the opt-out.
    monkeypatch.delenv("ROADLOG_SSH_ACCEPT_NEW_HOST_KEYS")
    conn = connect(server)
    assert conn.is_connected
    conn.close()
    assert "WITHOUT CHECKING" not in capsys.readouterr().err


def test_a_known_hosts_line_paramiko_cannot_read_stops_fab(
    server: SshServer, known_hosts: Path, host_key: paramiko.PKey
) -> None:
    """paramiko knows no @revoked or @cert-authority: fab fails closed."""
    known_hosts.write_text(
        entry(server, host_key) + f"@revoked * {host_key.get_name()} {host_key.get_base64()}\n"
    )
    with pytest.raises(SystemExit, match="cannot read the line"):
        connect(server)
