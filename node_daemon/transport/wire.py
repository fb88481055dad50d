"""Raft core values <-> their protobuf form on the peer wire."""

from __future__ import annotations

from node_daemon.raft import (
    ConfState,
    Entry,
    EntryType,
    Message,
    MessageType,
    Snapshot,
    SnapshotMeta,
)
from roadlog.v1 import raft_pb2


def conf_to_pb(c: ConfState) -> raft_pb2.RaftConfState:
    return raft_pb2.RaftConfState(voters=sorted(c.voters), learners=sorted(c.learners))


def conf_from_pb(c: raft_pb2.RaftConfState) -> ConfState:
    return ConfState(frozenset(c.voters), frozenset(c.learners))


def message_to_pb(m: Message, group: int = 0) -> raft_pb2.RaftMessage:
    """``m`` on the wire, as a message of Raft group ``group``."""
    pb = raft_pb2.RaftMessage(
        type=int(m.type),
        to=m.to,
        term=m.term,
        log_term=m.log_term,
        index=m.index,
        commit=m.commit,
        reject=m.reject,
        reject_hint=m.reject_hint,
        context=m.context,
        force=m.force,
        catching_up=m.catching_up,
        caught_up=m.caught_up,
        group=group,
    )
    setattr(pb, "from", m.frm)
    if m.entries:
        pb.entries.extend(
            raft_pb2.RaftEntry(term=e.term, index=e.index, type=int(e.type), data=e.data)
            for e in m.entries
        )
    if m.snapshot is not None:
        meta = m.snapshot.meta
        pb.has_snapshot = True
        pb.snapshot.CopyFrom(
            raft_pb2.RaftSnapshotMeta(index=meta.index, term=meta.term, conf=conf_to_pb(meta.conf))
        )
    return pb


def message_from_pb(pb: raft_pb2.RaftMessage, snapshot_data: bytes = b"") -> Message:
    """Raises ValueError on values the core has no name for."""
    snap = None
    if pb.has_snapshot:
        s = pb.snapshot
        snap = Snapshot(SnapshotMeta(s.index, s.term, conf_from_pb(s.conf)), snapshot_data)
    return Message(
        MessageType(pb.type),
        pb.to,
        getattr(pb, "from"),
        pb.term,
        pb.log_term,
        pb.index,
        tuple(Entry(e.term, e.index, EntryType(e.type), e.data) for e in pb.entries),
        pb.commit,
        pb.reject,
        pb.reject_hint,
        snap,
        pb.context,
        pb.force,
        pb.catching_up,
        pb.caught_up,
    )


_BEATS = (MessageType.HEARTBEAT, MessageType.HEARTBEAT_RESP)


def beat_of(m: Message, group: int) -> raft_pb2.GroupBeat | None:
    """``m`` as a coalesced heartbeat of ``group`` (``RaftBatch.beats``), or
    None when it is no heartbeat or carries what a beat does not."""
    if m.type not in _BEATS or (
        m.log_term or m.reject or m.reject_hint or m.force or m.entries or m.snapshot is not None
    ):
        return None
    return raft_pb2.GroupBeat(
        group=group,
        response=m.type == MessageType.HEARTBEAT_RESP,
        term=m.term,
        index=m.index,
        commit=m.commit,
        context=m.context,
        catching_up=m.catching_up,
        caught_up=m.caught_up,
    )


def message_of_beat(b: raft_pb2.GroupBeat, to: int, frm: int) -> Message:
    """The heartbeat (or its response) a coalesced beat from ``frm`` to
    ``to`` stands for (``beat_of``'s inverse)."""
    return Message(
        MessageType.HEARTBEAT_RESP if b.response else MessageType.HEARTBEAT,
        to,
        frm,
        b.term,
        index=b.index,
        commit=b.commit,
        context=b.context,
        catching_up=b.catching_up,
        caught_up=b.caught_up,
    )
