"""A sans-I/O Raft core in the manner of etcd-io/raft.

Drive it with ``tick()``, ``step(message)``, ``propose(data)``; collect work
with ``ready()``; persist, send, apply; then ``advance(ready)``. That loop is
``ReadyDriver`` (``driver``), with the I/O injected.
"""

from node_daemon.raft.bootstrap import bootstrap
from node_daemon.raft.core import Config, RaftCore
from node_daemon.raft.driver import ApplyJob, LogWrite, ReadyDriver
from node_daemon.raft.errors import (
    CompactedError,
    CorruptLogError,
    ProposalDropped,
    RaftError,
    StorageError,
    StorageFullError,
    UnavailableError,
)
from node_daemon.raft.proposals import PendingProposals
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
    "ApplyJob",
    "CompactedError",
    "ConfChange",
    "ConfChangeType",
    "ConfState",
    "Config",
    "CorruptLogError",
    "Entry",
    "EntryType",
    "HardState",
    "LogStorage",
    "LogWrite",
    "MemoryStorage",
    "Message",
    "MessageType",
    "PendingProposals",
    "ProposalDropped",
    "RaftCore",
    "RaftError",
    "ReadState",
    "Ready",
    "ReadyDriver",
    "Role",
    "Snapshot",
    "SnapshotMeta",
    "SoftState",
    "StorageError",
    "StorageFullError",
    "UnavailableError",
    "bootstrap",
]
