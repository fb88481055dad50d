"""Creating the first configuration of a brand-new cluster."""

from __future__ import annotations

from collections.abc import Iterable

from node_daemon.raft.storage import LogStorage
from node_daemon.raft.types import ConfState, Entry, EntryType, HardState


def bootstrap(storage: LogStorage, voters: Iterable[int]) -> None:
    """Write the initial configuration as entry 1 (term 1), committed.

    Every founding node must be bootstrapped with the same voters; nodes that
    join later start empty and learn the configuration from the log. Raises
    ValueError if the storage already holds a log or state.
    """
    conf = ConfState(frozenset(voters))
    if not conf.voters:
        raise ValueError("bootstrap needs at least one voter")
    if storage.last_index() != 0 or storage.initial_state() != HardState():
        raise ValueError("storage is not empty: refusing to bootstrap over existing state")
    storage.save(
        HardState(term=1, vote=0, commit=1), [Entry(1, 1, EntryType.CONFIG, conf.encode())]
    )
