"""Errors of the Raft core and of the log storage contract."""

from __future__ import annotations


class RaftError(Exception):
    """Base of every error the Raft core raises."""


class CompactedError(RaftError):
    """The requested index is at or below the compaction point."""


class UnavailableError(RaftError):
    """The requested index is beyond the last entry in storage."""


class ProposalDropped(RaftError):
    """The proposal was not appended: this node is not the leader, a
    leadership transfer is under way, or the change is not allowed now.
    ``leader`` is the known leader (0 when unknown), a hint for routing."""

    def __init__(self, reason: str, leader: int = 0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.leader = leader


class StorageError(RaftError):
    """The storage could not persist a write; nothing of it was stored."""


class StorageFullError(StorageError):
    """The storage is out of space (LMDB map full or disk full). Everything
    persisted before this write is intact."""


class CorruptLogError(StorageError):
    """An entry read from the log is not what was written (its checksum
    differs) or is missing between the first and the last index: the disk
    corrupted it. ``index`` is the first bad one."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index


class MissingEntryError(StorageError):
    """An entry the state machine refers to is no longer kept in the log
    (retention released it, or the log was replaced by a snapshot)."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index
