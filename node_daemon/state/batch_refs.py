"""Ping batches stored as a reference into the Raft log entry that carried
them, not as a second copy (docs/one-copy.md).

A replicated ping batch is written to every node's Raft log (fsynced before
the ack) as part of an entry's command. The state machine used to store the
same bytes again; now it stores where they lie: the entry's index and the
batch's offset and length within the entry's data. The log keeps the entries
the state refers to past its compaction point (``LmdbLogStorage.compact``'s
``retain_from``), so each ping is written once per node.

A reference is told from stored bytes by its first byte: a PingBatch starts
with a field's tag, never 0 (protobuf has no field 0), and a reference
starts with 0.

``append_batch_spans`` finds where each append op's batches lie in an
entry's data by walking the protobuf wire format as protobuf parses it (an
op's ``append`` fields merge, a part's last ``batch`` field wins); callers
still check that the bytes there are the parsed batch's before they refer to
them, so a command this misreads is stored as bytes, never misreferenced.
"""

from __future__ import annotations

import struct
from typing import Protocol

from roadlog.protowire import field_spans
from roadlog.v1 import command_pb2

REF_MARK = 0  # the first byte of a reference (a PingBatch's never is)
_REF = struct.Struct(">BQII")  # mark, entry index, offset, length
REF_SIZE = _REF.size


class EntrySource(Protocol):
    """Where the state reads the batches it refers to: the node's Raft log."""

    def read_slice(self, index: int, offset: int, length: int) -> bytes:
        """``length`` bytes of entry ``index``'s data from ``offset``;
        ``MissingEntryError`` if the entry is not kept."""
        ...


def encode_ref(index: int, offset: int, length: int) -> bytes:
    return _REF.pack(REF_MARK, index, offset, length)


def is_ref(value: bytes | memoryview, at: int) -> bool:
    """Whether the stored batch value holds a reference from ``at`` on."""
    return len(value) == at + REF_SIZE and value[at] == REF_MARK


def decode_ref(value: bytes | memoryview, at: int) -> tuple[int, int, int]:
    """(entry index, offset, length) of a reference stored from ``at`` on."""
    _, index, offset, length = _REF.unpack_from(value, at)
    return index, offset, length


# ------------------------------------------------------------ wire walking

# Field numbers (proto/roadlog/v1/command.proto).
_COMMAND_OPS = command_pb2.Command.OPS_FIELD_NUMBER
_OP_APPEND = command_pb2.Op.APPEND_FIELD_NUMBER
_APPEND_PARTS = command_pb2.AppendOp.PARTS_FIELD_NUMBER
_PART_BATCH = command_pb2.PartitionBatch.BATCH_FIELD_NUMBER


def append_batch_spans(data: bytes) -> list[list[tuple[int, int]]] | None:
    """For each op of the Command in ``data``, in order: the (offset, length)
    of each of its append parts' batch (empty for an op that is not an
    append, or a part without a batch: length 0); None if ``data`` is not
    well-formed protobuf."""
    try:
        out: list[list[tuple[int, int]]] = []
        for op_at, op_end in field_spans(data, _COMMAND_OPS):
            spans: list[tuple[int, int]] = []
            for ap_at, ap_end in field_spans(data, _OP_APPEND, op_at, op_end):
                for pt_at, pt_end in field_spans(data, _APPEND_PARTS, ap_at, ap_end):
                    batches = field_spans(data, _PART_BATCH, pt_at, pt_end)
                    if batches:
                        start, end = batches[-1]
                        spans.append((start, end - start))
                    else:
                        spans.append((pt_at, 0))
            out.append(spans)
        return out
    except ValueError:
        return None
