"""How many data groups a node runs when ``data_groups`` is 0 (the default):
one per voter, decided once, at the node's first start, and kept in the data
directory.

Invariants: a node runs the same number of data groups at every start (the
number is written, atomically and fsynced, before any group is made); a data
directory made before this default (a Raft log and no record) keeps the one
group it was founded with, so an upgraded cluster behaves as before; a
configured number (1..64) is the operator's and is used as it is. A node
whose decided number differs from the one the cluster's first topic
recorded (a node that joined with other voters in its configuration) takes
the cluster's: ``to_adopt`` says so, and the node records it and restarts.
"""

from __future__ import annotations

from pathlib import Path

from node_daemon.config import NodeConfig
from node_daemon.disk import write_durably
from roadlog.placement import DATA_GROUPS_RECORD, MAX_DATA_GROUPS


def founded_data_groups(cfg: NodeConfig) -> int:
    """``cfg.data_groups`` if set; else the number recorded at this data
    directory's first start; else (a first start) ``voters_at_founding``,
    recorded now. A data directory from before the record: the highest data
    group it holds, or 1 when it holds a Raft log and no data group."""
    if cfg.data_groups:
        return cfg.data_groups
    data = Path(cfg.data_dir)
    record = data / DATA_GROUPS_RECORD
    if record.exists():
        recorded = int(record.read_text().strip())
        if not 1 <= recorded <= MAX_DATA_GROUPS:
            raise ValueError(f"{record}: {recorded} is not a number of data groups")
        return recorded
    made = _data_groups_made(data)
    if made:
        count = made
    elif (data / "raft").exists():
        count = 1  # founded before this default: all in group 0, as then
    else:
        count = min(cfg.voters_at_founding, MAX_DATA_GROUPS)
    write_durably(record, f"{count}\n")
    return count


def _data_groups_made(data: Path) -> int:
    """The highest data group with a directory under ``data/groups``, 0 if none."""
    groups = data / "groups"
    if not groups.is_dir():
        return 0
    return max((int(p.name) for p in groups.iterdir() if p.name.isdigit()), default=0)


def to_adopt(decided_here: bool, running: int, founded: int | None) -> int | None:
    """The number of data groups this node should record and restart with:
    the cluster's (``founded``, from group 0's state; None while no topic
    decided it) where it differs from the ``running`` one and this node
    decided its own (``decided_here``: ``data_groups`` was left at 0). A
    configured number is never overridden."""
    if not decided_here or founded is None or founded == running:
        return None
    return founded


def record_data_groups(cfg: NodeConfig, count: int) -> None:
    """Write ``count`` as the data groups this node runs from its next start."""
    write_durably(Path(cfg.data_dir) / DATA_GROUPS_RECORD, f"{count}\n")
