"""A RaftBatch's wire bytes as a list of parts, for the framed peer link.

``RaftBatch.FromString(b"".join(encode_batch(...)))`` equals the batch
``message_to_pb`` builds, but no entry's data is copied on the way: each
entry's data is a part of its own (the very bytes object of the Entry),
between small parts that protobuf serializes (every field but the
entries, so a field added to ``RaftMessage`` is encoded with the rest) and
the tags and lengths written here. The socket's writev takes the parts as
they are. Before, the leader copied every entry into each follower's
protobuf message and then again when serializing it.

Protobuf's wire format allows this (``roadlog.protowire``): a message is
the concatenation of its fields in any order, and a repeated message field
is one tag, length and message per element.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from node_daemon.raft.types import Message
from node_daemon.transport.wire import beat_of, message_to_pb
from roadlog.protowire import length_delimited
from roadlog.v1 import raft_pb2

_BATCH_MESSAGES = raft_pb2.RaftBatch.MESSAGES_FIELD_NUMBER
_MESSAGE_ENTRIES = raft_pb2.RaftMessage.ENTRIES_FIELD_NUMBER
_ENTRY_DATA = raft_pb2.RaftEntry.DATA_FIELD_NUMBER


def _message_parts(m: Message, group: int) -> list[bytes]:
    if not m.entries:
        return [message_to_pb(m, group).SerializeToString()]
    parts = [message_to_pb(replace(m, entries=()), group).SerializeToString()]
    for e in m.entries:
        head = raft_pb2.RaftEntry(term=e.term, index=e.index, type=int(e.type)).SerializeToString()
        if e.data:
            head += length_delimited(_ENTRY_DATA, len(e.data))
            parts.append(length_delimited(_MESSAGE_ENTRIES, len(head) + len(e.data)) + head)
            parts.append(e.data)
        else:
            parts.append(length_delimited(_MESSAGE_ENTRIES, len(head)) + head)
    return parts


def encode_batch(
    cluster: str,
    node_id: int,
    messages: Sequence[tuple[int, Message]],
    disk_low: bool = False,
    beats: bool = False,
    op_level: int = 0,
) -> list[bytes]:
    """The wire bytes of ``RaftBatch(cluster, from=node_id, messages,
    disk_low, op_level)``, in parts; each message is given with its Raft
    group, ``(group, message)``. ``beats``: heartbeats and their responses
    go as coalesced beats (``RaftBatch.beats``, for a receiver that takes
    them)."""
    head = raft_pb2.RaftBatch(cluster=cluster, disk_low=disk_low, op_level=op_level)
    setattr(head, "from", node_id)
    if beats:
        rest = []
        for group, m in messages:
            beat = beat_of(m, group)
            if beat is None:
                rest.append((group, m))
            else:
                head.beats.append(beat)
        messages = rest
    out = [head.SerializeToString()]
    for group, m in messages:
        parts = _message_parts(m, group)
        out.append(length_delimited(_BATCH_MESSAGES, sum(len(p) for p in parts)))
        out += parts
    return out
