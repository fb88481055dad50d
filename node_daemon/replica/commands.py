"""What a leader proposes: operations that waited for the driver, past
their deadline or not, packed into entries, each entry a ``Command`` whose
bytes are framed by hand from the ops' own serializations.
"""

from __future__ import annotations

import asyncio

from node_daemon.state.responses import OpResult
from roadlog.errors import Code, RoadlogError
from roadlog.limits import ENTRY_BYTES, chunk_by_bytes
from roadlog.protowire import varint
from roadlog.v1 import command_pb2

PAST_DEADLINE = (
    "not stored: its deadline passed before the leader could put it in the log "
    "(the client has stopped waiting, and may have sent its next request)"
)

Proposal = tuple[command_pb2.Op, "asyncio.Future[OpResult]", float | None]  # op, answer, deadline


def in_time(ops: list[Proposal], now: float) -> list[Proposal]:
    """The proposals whose deadline has not passed at ``now``; the others
    are answered DEADLINE_EXCEEDED and never enter the log."""
    kept = []
    for p in ops:
        deadline, fut = p[2], p[1]
        if deadline is not None and deadline <= now:
            if not fut.done():
                fut.set_exception(RoadlogError(Code.DEADLINE_EXCEEDED, PAST_DEADLINE))
        else:
            kept.append(p)
    return kept


def command_bytes(leader_ms: int, ops: list[bytes]) -> bytes:
    """``Command(leader_ms=leader_ms, ops=...).SerializeToString()`` from the
    ops' own serializations, byte for byte: field 1 (a varint, left out when
    0), then each op as field 2 (tag, length, bytes)."""
    pieces = [b"\x08", varint(leader_ms % (1 << 64))] if leader_ms else []
    for op in ops:
        pieces += (b"\x12", varint(len(op)), op)
    return b"".join(pieces)


def packed(
    ops: list[Proposal], leader_ms: int, max_ops_per_entry: int
) -> tuple[list[list[Proposal]], list[bytes]]:
    """``ops`` as entries: at most ``max_ops_per_entry`` ops and ENTRY_BYTES
    bytes each (a bigger op alone), stamped ``leader_ms``. Each op is
    serialized once and framed as a Command's ops field by hand: no copy of
    the ops into a Command message, no sizing pass. The ops of each entry,
    and each entry's data."""
    serialized = [op.SerializeToString() for op, _, _ in ops]
    runs = chunk_by_bytes([len(s) for s in serialized], max_ops_per_entry, ENTRY_BYTES)
    return (
        [ops[r.start : r.stop] for r in runs],
        [command_bytes(leader_ms, serialized[r.start : r.stop]) for r in runs],
    )
