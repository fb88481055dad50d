"""A replica that starts empty catches up before it votes.

Starting with an empty log (a new node, or one whose disk was wiped or
replaced: the two look the same) the node bootstraps the static peers'
configuration as entry 1, as every founding node does, but it neither
votes nor campaigns (``raft.Config.catching_up``) until either

- every other static peer answers that it was never past its bootstrap
  either (term <= 1, commit <= 1): the cluster is brand new, nothing was
  ever acknowledged, there is nothing this node could have forgotten; or
- a leader has caught it up: it holds the leader's catch-up mark, an
  entry that enough of the other voters hold too (``RaftCore._caught_up``).

So a wiped voter can never help elect a leader that lacks an entry it had
acknowledged, nor vote twice in a term. A brand-new cluster with static
peers therefore forms once every peer has been up at the same time. The
state survives restarts as the file ``raft/catching-up`` (written before the
bootstrap, removed once the vote that ended it is on disk). A node that
joins by discovery starts the same way (and, a learner, counts nowhere
anyway); one that founds a cluster alone, or a one-node cluster, does not.
A log the disk damaged and that was set aside (``storage.damage``) starts
catching up too, keeping the term and vote it had.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from node_daemon.raft import HardState, RaftCore, bootstrap
from node_daemon.storage.disk import fsync_dir
from node_daemon.storage.raft_log import LmdbLogStorage
from roadlog.runtime import tls
from roadlog.v1 import admin_pb2_grpc, client_pb2

log = logging.getLogger("roadlog.node")

# Kept in the Raft log's directory while the node catches up after starting
# empty (see the module docstring); a wipe or a restore takes it along.
CATCHING_UP_FILE = "catching-up"
ASK_PEERS_EVERY_S = 0.5


def durable_touch(path: Path) -> None:
    """Create ``path`` (empty) and make it, and its name, durable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)


def start(
    log_store: LmdbLogStorage,
    peers: dict[int, str],
    node_id: int,
    group: int,
    marker: Path,
    set_aside: HardState | None,
) -> bool:
    """Before the core starts on ``log_store``: bootstrap an empty log with
    the static ``peers``, write ``marker`` where this node must catch up
    first, and, for a log that was set aside (``set_aside``: the term and
    vote it held), keep its term and vote. Whether the node catches up."""
    others = sorted(set(peers) - {node_id})
    empty = log_store.last_index() == 0 and log_store.initial_state().term == 0
    if empty and (others or not peers):
        # Maybe a wiped member of a cluster that ran: not a voter until
        # it knows (first on disk, so that a crash cannot forget it).
        durable_touch(marker)
    if empty and peers:
        bootstrap(log_store, sorted(peers))
        log.info(
            "bootstrapped the static peers' cluster",
            extra={"voters": sorted(peers), "group": group},
        )
    if set_aside is not None:
        # It held a copy: it keeps the term and vote it had (so no peer
        # takes it for a new cluster's, and it votes twice in no term),
        # and it catches up before it votes again.
        durable_touch(marker)
        term = max(set_aside.term, 2, log_store.initial_state().term)
        vote = set_aside.vote if set_aside.term == term else 0
        commit = log_store.initial_state().commit
        log_store.save(HardState(term=term, vote=vote, commit=commit), [])
    catching_up = marker.exists()
    if catching_up:
        log.info(
            "started empty: neither voting nor campaigning until the cluster is known "
            "new or a leader has caught this node up",
            extra={"ask": others, "group": group},
        )
    return catching_up


async def ask_if_new(
    core: RaftCore,
    peers: dict[int, str],
    others: list[int],
    group: int,
    submit: Callable[[Callable[[RaftCore], None]], None],
) -> None:
    """Started empty with static peers: ask the ``others`` (Admin.Status),
    while ``core`` is catching up, whether they ever got past their
    bootstrap. Once every one answers that it did not, the cluster is new
    (or every copy of it is gone): nothing was acknowledged that any node
    still holds, so this node may vote. As long as one did, a leader
    catches this node up."""
    ran = False
    while core.catching_up:
        answers = await asyncio.gather(*(peer_is_new(peers[p], p, group) for p in others))
        if all(answers):
            log.info("every peer is new: a new cluster", extra={"peers": others})
            submit(lambda core: core.known_new_cluster())
            return
        if False in answers and not ran:
            ran = True
            log.info("the cluster ran before this node started empty: catching up first")
        await asyncio.sleep(ASK_PEERS_EVERY_S)


async def peer_is_new(address: str, peer: int, group: int) -> bool | None:
    """True: ``peer`` (at ``address``) never got past its bootstrap of
    ``group``; False: it did; None: no answer."""
    try:
        async with tls.current().channel(address) as ch:
            st = await admin_pb2_grpc.AdminStub(ch).Status(client_pb2.StatusRequest(), timeout=1.0)
    except grpc.aio.AioRpcError:
        return None
    if not st.nodes or st.nodes[0].id != peer:
        return None  # someone else answers there
    own: Any = st.nodes[0]
    if group != 0:  # this group's figures there (none yet: no answer)
        own = next((g for g in st.nodes[0].groups if g.id == group), None)
        if own is None:
            return None
    return bool(own.term <= 1 and own.commit_index <= 1)


def caught_up(marker: Path, term: int) -> None:
    """Catching up ended and is on disk: forget it for good."""
    if marker.exists():
        marker.unlink()
        fsync_dir(marker.parent)
        log.info("no longer catching up: voting again", extra={"term": term})
