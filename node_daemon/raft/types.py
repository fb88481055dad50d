"""Values the Raft core takes in and hands out. All are immutable.

Node ids are positive integers; 0 means "none" (no vote, no known leader).
Log indexes start at 1; index 0 with term 0 is the empty log's sentinel.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum

NONE = 0


class EntryType(IntEnum):
    NORMAL = 0
    CONFIG = 1  # data is an encoded ConfState: the whole new configuration


@dataclass(frozen=True, slots=True)
class Entry:
    term: int
    index: int
    type: EntryType = EntryType.NORMAL
    data: bytes = b""

    def size(self) -> int:
        """Bytes this entry counts for in message and apply limits."""
        return len(self.data) + 17


@dataclass(frozen=True, slots=True)
class ConfState:
    """A cluster configuration: voters decide, learners only receive the log.

    Invariant: voters and learners are disjoint.
    """

    voters: frozenset[int] = frozenset()
    learners: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.voters & self.learners:
            raise ValueError("a node cannot be both voter and learner")

    @property
    def members(self) -> frozenset[int]:
        return self.voters | self.learners

    def encode(self) -> bytes:
        v, lr = sorted(self.voters), sorted(self.learners)
        return struct.pack(f">HH{len(v)}Q{len(lr)}Q", len(v), len(lr), *v, *lr)

    @classmethod
    def decode(cls, data: bytes) -> ConfState:
        """``encode``'s bytes back; ValueError for anything else (a length
        that does not match its counts, a node both voter and learner)."""
        if len(data) < 4:
            raise ValueError(f"a configuration of {len(data)} bytes")
        nv, nl = struct.unpack_from(">HH", data)
        if len(data) != 4 + 8 * (nv + nl):
            raise ValueError(f"a configuration of {nv + nl} ids in {len(data)} bytes")
        ids = struct.unpack_from(f">{nv + nl}Q", data, 4)
        return cls(frozenset(ids[:nv]), frozenset(ids[nv:]))

    @classmethod
    def decodes(cls, data: bytes) -> bool:
        """Whether ``data`` is a configuration ``decode`` takes."""
        try:
            cls.decode(data)
        except ValueError:
            return False
        return True


class ConfChangeType(IntEnum):
    ADD_LEARNER = 0  # a new node that receives the log without voting
    ADD_VOTER = 1  # a new node, or a learner promoted to voter
    REMOVE_NODE = 2  # a voter or a learner leaves


@dataclass(frozen=True, slots=True)
class ConfChange:
    type: ConfChangeType
    node_id: int


@dataclass(frozen=True, slots=True)
class HardState:
    """What must be on disk before any message that depends on it is sent."""

    term: int = 0
    vote: int = NONE
    commit: int = 0


@dataclass(frozen=True, slots=True)
class SnapshotMeta:
    index: int = 0
    term: int = 0
    conf: ConfState = field(default_factory=ConfState)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The state machine at ``meta.index``. ``data`` is opaque to the core."""

    meta: SnapshotMeta = field(default_factory=SnapshotMeta)
    data: bytes = b""

    @property
    def is_empty(self) -> bool:
        return self.meta.index == 0


class MessageType(IntEnum):
    APPEND = 0
    APPEND_RESP = 1
    VOTE = 2
    VOTE_RESP = 3
    PRE_VOTE = 4
    PRE_VOTE_RESP = 5
    HEARTBEAT = 6
    HEARTBEAT_RESP = 7
    SNAPSHOT = 8
    TIMEOUT_NOW = 9
    READ_INDEX = 10
    READ_INDEX_RESP = 11
    TRANSFER_LEADER = 12


@dataclass(frozen=True, slots=True)
class Message:
    """One Raft message. Which fields matter depends on ``type``:

    APPEND: index/log_term locate the entry before ``entries``; commit is the
    leader's commit. APPEND_RESP: index is the follower's last matching index,
    or, when reject, the rejected index with reject_hint/log_term as a hint
    for fast backtracking. VOTE/PRE_VOTE: index/log_term describe the
    candidate's last entry; force bypasses the leader lease (leadership
    transfer). HEARTBEAT(_RESP) and READ_INDEX(_RESP): context carries a
    read request id. APPEND_RESP and HEARTBEAT_RESP: catching_up says the
    sender is catching up after losing its storage (``Config.catching_up``):
    the leader replicates to it but counts it in no quorum (commit,
    ReadIndex). APPEND and HEARTBEAT to such a follower: caught_up is the
    index of the entry the leader appended once it heard so (its catch-up
    mark) once enough voters hold it; holding it ends the catching up.
    """

    type: MessageType
    to: int
    frm: int
    term: int = 0
    log_term: int = 0
    index: int = 0
    entries: tuple[Entry, ...] = ()
    commit: int = 0
    reject: bool = False
    reject_hint: int = 0
    snapshot: Snapshot | None = None
    context: bytes = b""
    force: bool = False
    catching_up: bool = False
    caught_up: int = 0


class Role(IntEnum):
    FOLLOWER = 0
    PRE_CANDIDATE = 1
    CANDIDATE = 2
    LEADER = 3


@dataclass(frozen=True, slots=True)
class SoftState:
    """Volatile state the application may want to watch; never persisted."""

    leader: int
    role: Role


@dataclass(frozen=True, slots=True)
class ReadState:
    """A linearizable read may be served once ``index`` is applied."""

    index: int
    context: bytes


LEADER_STREAM = frozenset({MessageType.APPEND, MessageType.HEARTBEAT, MessageType.SNAPSHOT})


@dataclass(slots=True)
class Ready:
    """Work for the caller, in this order: persist ``hard_state``, ``entries``
    and ``snapshot`` in one durable write (fsync when ``must_sync``); send
    ``messages``; install ``snapshot`` then apply ``committed_entries`` to the
    state machine; then call ``advance(ready)``.

    ``split_messages()`` tells which messages may go out while the write is
    still running (a leader's appends: the leader counts its own entries only
    in ``advance``), which lets the leader's fsync overlap its followers'.
    """

    soft_state: SoftState | None = None
    hard_state: HardState | None = None
    entries: list[Entry] = field(default_factory=list)
    snapshot: Snapshot | None = None
    committed_entries: list[Entry] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    read_states: list[ReadState] = field(default_factory=list)
    must_sync: bool = False
    term_or_vote_changed: bool = False

    def split_messages(self) -> tuple[list[Message], list[Message]]:
        """(messages that may be sent before the write is durable, the rest).

        Nothing goes early when the term or vote changes: a node must never
        speak for a term it could forget. Responses (acknowledging entries or
        votes) always wait for the write."""
        if self.term_or_vote_changed:
            return [], list(self.messages)
        early = [m for m in self.messages if m.type in LEADER_STREAM]
        late = [m for m in self.messages if m.type not in LEADER_STREAM]
        return early, late

    def is_empty(self) -> bool:
        return not (
            self.soft_state
            or self.hard_state
            or self.entries
            or self.snapshot
            or self.committed_entries
            or self.messages
            or self.read_states
        )
