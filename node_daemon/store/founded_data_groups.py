"""How many data groups a node runs when ``data_groups`` is 0 (the default):
one per voter, decided once, at the node's first start, and kept in the data
directory.

Invariants: a node runs the same number of data groups at every start (the
number is written, atomically and fsynced, before any group is made); a data
directory made before this default (a Raft log and no record) keeps the one
group it was founded with, so an upgraded cluster behaves as before; a node
that joins a running cluster by discovery asks its leader how many groups it
runs; a configured number (1..64) is the operator's and is used as it is. A node
whose decided number differs from the one the cluster's first topic
recorded (a node that joined with other voters in its configuration) takes
the cluster's: ``to_adopt`` says so, and the node records it and restarts.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc

from discovery.core import Join
from node_daemon.config import NodeConfig
from node_daemon.storage.disk import write_durably
from roadlog.placement import DATA_GROUPS_RECORD, MAX_DATA_GROUPS
from roadlog.runtime import tls
from roadlog.runtime.auth import token_metadata
from roadlog.v1 import admin_pb2_grpc, client_pb2

log = logging.getLogger("roadlog.node")

# How many times, a second apart, a joining node asks the cluster's leader for its data groups.
ASK_ATTEMPTS = 10


def founded_data_groups(cfg: NodeConfig) -> int:
    """``kept_data_groups``, else (a first start that asked no cluster)
    ``voters_at_founding``, recorded now."""
    kept = kept_data_groups(cfg)
    return kept if kept is not None else decide_data_groups(cfg, cfg.voters_at_founding)


def kept_data_groups(cfg: NodeConfig) -> int | None:
    """``cfg.data_groups`` if set; else the number recorded at this data
    directory's first start; else, for a data directory from before the
    record, the highest data group it holds, or 1 when it holds a Raft log
    and no data group (recorded now); None for a first start."""
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
        return decide_data_groups(cfg, made)
    if (data / "raft").exists():
        return decide_data_groups(cfg, 1)  # founded before this default: group 0, as then
    return None


def decide_data_groups(cfg: NodeConfig, count: int) -> int:
    """Record ``count`` (at most MAX_DATA_GROUPS) as this node's data groups,
    durably, before any group is made; returns it."""
    count = max(1, min(count, MAX_DATA_GROUPS))
    write_durably(Path(cfg.data_dir) / DATA_GROUPS_RECORD, f"{count}\n")
    return count


async def cluster_data_groups(join: Join, token: str, attempts: int = ASK_ATTEMPTS) -> int | None:
    """The data groups the running cluster's leader (``join``, as discovery
    heard it) runs, for a node joining it: the groups its Admin.Status names
    beside group 0 (1 when it names none: one group). None when it cannot be
    asked within ``attempts`` tries a second apart."""
    for attempt in range(attempts):
        try:
            async with tls.current().channel(join.leader_address) as ch:
                status = await admin_pb2_grpc.AdminStub(ch).Status(
                    client_pb2.StatusRequest(), metadata=token_metadata(token), timeout=5
                )
        except grpc.aio.AioRpcError as e:
            log.info(
                "asking the cluster's data groups, retrying",
                extra={"at": join.leader_address, "reason": e.details(), "attempt": attempt},
            )
            await asyncio.sleep(1.0)
            continue
        if not status.nodes:
            return None
        own = status.nodes[0]  # the node that answered tells its own figures first
        return max(1, len({g.id for g in own.groups if g.id}))
    return None


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
    decided its own (``decided_here``: ``data_groups`` was left at 0 and
    topics are placed in the data groups; without ``place_topics`` the
    first topic records 1 by design). A configured number is never
    overridden."""
    if not decided_here or founded is None or founded == running:
        return None
    return founded
