"""A local federation on loopback (issue 43, docs/federation.md): a
directory, which is a ``LocalCluster`` of its own marked by
DD/directory.json, and member clusters founded against it.

A member (``member_founding``) is a ``LocalCluster`` whose certificates are
signed by the directory's CA, whose first admin identity has the
directory's admin token, and whose queue servers register with the
directory (``--directory-servers``, ``--directory-token-file``): one CA
and one admin token across the local federation, the first slice's stand-in
for the one trust root (docs/federation.md, step 5).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from roadlog.federation.directory import Directory
from roadlog.tools.localcluster import LocalCluster

DIRECTORY_FILE = "directory.json"
DIRECTORY_NAME = "directory"  # the directory's own cluster_name
REPORT_S = 2.0  # a local member's load reports (seconds)


def is_local_directory(path: Path) -> bool:
    return (path / DIRECTORY_FILE).exists()


def directory_create(dd: Path, nodes: int = 1) -> LocalCluster:
    """The directory's cluster in DD (not started), marked as a directory."""
    lc = LocalCluster.create(dd, nodes, 1, cluster_name=DIRECTORY_NAME)
    (lc.dir / DIRECTORY_FILE).write_text(json.dumps({"directory": True}) + "\n")
    return lc


def load_directory(dd: Path) -> LocalCluster:
    if not is_local_directory(dd):
        raise FileNotFoundError(f"no directory at {dd} (no {DIRECTORY_FILE}): `directory up`")
    return LocalCluster.load(dd)


def directory_down(dd: Path) -> None:
    load_directory(dd).down()
    (dd / DIRECTORY_FILE).unlink(missing_ok=True)


@dataclass
class MemberFounding:
    """What ``LocalCluster.create`` and ``wait_ready`` are given for a member."""

    name: str
    ca: tuple[Path, Path]
    queue_args: list[str]
    admin_token: str | None
    tags: list[str] = field(default_factory=list)


def member_founding(dd: Path, name: str, tags: list[str]) -> MemberFounding:
    """A member named ``name`` of the local directory in DD."""
    d = load_directory(dd)
    if not d.certs_dir or not d.token_file:
        raise ValueError(f"the directory at {dd} runs without TLS or has no admin token yet")
    args = [
        "--directory-servers",
        ",".join(d.servers),
        "--directory-token-file",
        d.token_file,
        "--directory-report-s",
        str(REPORT_S),
    ]
    if tags:
        args += ["--cluster-tags", ",".join(tags)]
    ca_dir = d.dir / "ca"
    return MemberFounding(name, (ca_dir, ca_dir / "ca.key"), args, d.admin_token, tags)


def directory_of(dd_or_servers: str) -> Directory:
    """The directory a ``--directory`` value names: a local one's folder
    (its servers, CA and admin token), else ``HOST:PORT,...`` (the
    environment's TLS and token)."""
    path = Path(dd_or_servers)
    if path.exists():
        d = load_directory(path)
        return Directory(d.servers, tls=d.tls())
    servers = [s.strip() for s in dd_or_servers.split(",") if s.strip()]
    if not servers:
        raise ValueError("--directory: a local directory's folder, or HOST:PORT,...")
    return Directory(servers)


def wait_registered(dd: Path, name: str, timeout: float = 30.0) -> None:
    """Until the directory lists ``name`` as a healthy member."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    with directory_of(str(dd)) as d:
        while time.monotonic() < deadline:
            try:
                fed = d.federation()
                if any(m.name == name and m.healthy for m in fed.members):
                    return
                last = f"members: {[(m.name, m.healthy) for m in fed.members]}"
            except Exception as e:  # the directory electing: asked again
                last = str(e)
            time.sleep(0.2)
    raise TimeoutError(f"{name} not registered with the directory at {dd} in time: {last}")
