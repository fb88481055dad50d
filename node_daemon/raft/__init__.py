"""A sans-I/O Raft core in the manner of etcd-io/raft.

Drive it with ``tick()``, ``step(message)``, ``propose(data)``; collect work
with ``ready()``; persist, send, apply; then ``advance(ready)``.
"""

from node_daemon.raft.bootstrap import bootstrap
from node_daemon.raft.core import Config, RaftCore
from node_daemon.raft.errors import (
    CompactedError,
    ProposalDropped,
    RaftError,
    StorageError,
    StorageFullError,
    UnavailableError,
)
from node_daemon.raft.storage import LogStorage, MemoryStorage
from node_daemon.raft.types import (
    NONE,
    ConfChange,
    ConfChangeType,
    ConfState,
    Entry,
    EntryType,
    HardState,
    Message,
    MessageType,
    ReadState,
    Ready,
    Role,
    Snapshot,
    SnapshotMeta,
    SoftState,
)

__all__ = [
    "NONE",
    "CompactedError",
    "ConfChange",
    "ConfChangeType",
    "ConfState",
    "Config",
    "Entry",
    "EntryType",
    "HardState",
    "LogStorage",
    "MemoryStorage",
    "Message",
    "MessageType",
    "ProposalDropped",
    "RaftCore",
    "RaftError",
    "ReadState",
    "Ready",
    "Role",
    "Snapshot",
    "SnapshotMeta",
    "SoftState",
    "StorageError",
    "StorageFullError",
    "UnavailableError",
    "bootstrap",
]
