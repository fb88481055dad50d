"""One test CA per session (making keys and certificates costs tens of
milliseconds each): the cluster's CA with certificates for nodes 1..9, a
queue server and an admin client, and a second, foreign CA with the same
names, whose certificates every port must refuse."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from roadlog.runtime.tls import Credentials, Identity, Security
from roadlog.tools.ca import copy_ca, create_ca, create_cert

HOSTS = ["127.0.0.1", "localhost", "::1"]
NODES = range(1, 10)


@dataclass(frozen=True)
class ClusterCA:
    """A CA's directory (``ca.crt``, ``ca.key``) and one certs dir per
    holder: ``node(3)``, ``queue()``, ``client()`` (admin)."""

    root: Path

    @property
    def ca_dir(self) -> Path:
        return self.root / "ca"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca" / "ca.key"

    @property
    def ca_file(self) -> Path:
        return self.root / "ca" / "ca.crt"

    @property
    def signing(self) -> tuple[Path, Path]:
        """What ``LocalCluster.create(ca=...)`` signs with."""
        return self.ca_dir, self.ca_key

    def node(self, node_id: int) -> Path:
        return self.root / f"node{node_id}"

    def queue(self) -> Path:
        return self.root / "queue"

    def client(self) -> Path:
        return self.root / "client"

    def creds(self, kind: str, node_id: int = 1) -> Credentials:
        where = {"node": self.node(node_id), "queue": self.queue(), "client": self.client()}
        return Credentials.load(where[kind], kind, "admin" if kind == "client" else "")

    def security(self, kind: str, node_id: int = 1) -> Security:
        return Security(self.creds(kind, node_id))


def make_test_ca(root: Path) -> ClusterCA:
    ca = ClusterCA(root)
    create_ca(ca.ca_dir, ca.ca_key)
    for i in NODES:
        copy_ca(ca.ca_dir, ca.node(i))
        create_cert(ca.node(i), ca.ca_key, Identity("node", str(i)), HOSTS)
    copy_ca(ca.ca_dir, ca.queue())
    create_cert(ca.queue(), ca.ca_key, Identity("queue", "queue"), HOSTS)
    copy_ca(ca.ca_dir, ca.client())
    create_cert(ca.client(), ca.ca_key, Identity("client", "admin"))
    return ca


def copy_certs(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst
