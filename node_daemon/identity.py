"""A node's id when none is configured: made once, kept in the data dir.

Invariant: once ``node_id`` is written, this node is that id forever (a
restarted node rejoins as itself); the file is written atomically and
fsynced before the id is used.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

MAX_ID = (1 << 53) - 1  # exact in JSON and in every language's numbers


def node_id_for(data_dir: Path, configured: int = 0) -> int:
    path = data_dir / "node_id"
    if path.exists():
        stored = int(path.read_text().strip())
        if configured and configured != stored:
            raise ValueError(f"{path} says node {stored}, the configuration says {configured}")
        return stored
    node_id = configured or secrets.randbelow(MAX_ID) + 1
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(f"{node_id}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(data_dir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return node_id
