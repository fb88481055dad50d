"""The state machine's answers: ``OpResult``, what the proposer tells the
client of one applied operation, and publishes' answers written straight as
protobuf wire bytes.

A call of many publishes gets one answer per publish, each with an offset
range per partition; building them as protobuf message objects (one per
offset range, then serialized) was most of the leader's apply of a merged
append. These write the same bytes directly; tests check them byte for byte
against protobuf's own serialization.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from roadlog.errors import Code
from roadlog.protowire import SMALL_VARINTS, varint


@dataclass(slots=True)
class OpResult:
    """What the proposer tells the client about one operation."""

    code: Code = Code.OK
    message: str = ""
    response: bytes = b""
    # An append op's result per span (publish request), in span order; the
    # op's own code is OK then, and each span says how it went.
    spans: tuple[OpResult, ...] = ()


def publish_responses(
    partitions: list[int],
    bases: list[int],
    rows: list[list[int]],
    applied_index: int,
    group: int = 0,
) -> list[bytes]:
    """``PublishResponse`` bytes for consecutive spans of one append: span
    ``k`` has ``rows[k][i]`` pings in ``partitions[i]``, stored right after
    the spans before it, the first from ``bases[i]`` on. Byte for byte what
    protobuf writes for ``PublishResponse(offsets=[PartitionOffsets(
    partition, base_offset, count) for each non-zero count in order],
    applied_index=applied_index)``, without a message object per offset;
    ``group`` (a data group's answer): ``group_fences=[GroupFence(group,
    applied_index)]`` in place of ``applied_index``."""
    if group:
        fence = (
            b"\x08" + varint(group) + (b"\x10" + varint(applied_index) if applied_index else b"")
        )
        tail = b"\x22" + varint(len(fence)) + fence
    else:
        tail = b"\x10" + varint(applied_index) if applied_index else b""
    heads = [b"\x08" + varint(p) if p else b"" for p in partitions]
    nxt = list(bases)
    out = []
    for row in rows:
        # Each offset range as its pieces (tag, length, fields), joined once
        # per answer: no bytes object per range. Its body is at most 23
        # bytes (three fields and their tags), so its length is one byte.
        pieces: list[bytes] = []
        for i, count in enumerate(row):
            if count:
                base = nxt[i]
                nxt[i] = base + count
                head, vc = heads[i], varint(count)
                if base:
                    vb = varint(base)
                    size = len(head) + len(vb) + len(vc) + 2
                    pieces += (b"\x0a", SMALL_VARINTS[size], head, b"\x10", vb, b"\x18", vc)
                else:
                    size = len(head) + len(vc) + 1
                    pieces += (b"\x0a", SMALL_VARINTS[size], head, b"\x18", vc)
        pieces.append(tail)
        out.append(b"".join(pieces))
    return out


def publish_batch_response(results: Sequence[tuple[int, str, bytes]]) -> bytes:
    """``PublishBatchResponseView(results=[PublishResultView(code, message,
    response), ...])`` bytes, byte for byte as protobuf writes them (a zero
    code, an empty message or response left out); codes are >= 0."""
    pieces = []
    for code, message, response in results:
        body = b"\x08" + varint(code) if code else b""
        if message:
            raw = message.encode()
            body += b"\x12" + varint(len(raw)) + raw
        if response:
            body += b"\x1a" + varint(len(response)) + response
        pieces.append(b"\x0a" + varint(len(body)) + body)
    return b"".join(pieces)
