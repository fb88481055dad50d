"""A node's id when none is configured: made once, kept in the data dir.

Invariant: once ``node_id`` is written, this node is that id forever (a
restarted node rejoins as itself); the file is written atomically and
fsynced before the id is used.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from node_daemon.storage.disk import write_durably

MAX_ID = (1 << 53) - 1  # exact in JSON and in every language's numbers


def node_id_for(data_dir: Path, configured: int = 0) -> int:
    path = data_dir / "node_id"
    if path.exists():
        stored = int(path.read_text().strip())
        if configured and configured != stored:
            raise ValueError(f"{path} says node {stored}, the configuration says {configured}")
        return stored
    node_id = configured or secrets.randbelow(MAX_ID) + 1
    write_durably(path, f"{node_id}\n")
    return node_id
