"""Protobuf wire-format pieces for writing a message in parts, and for
finding a field in a message's bytes without parsing it.

A message is the concatenation of its fields in any order, and a bytes or
message field is its tag, its length and its payload; so a message whose
big fields are left as separate parts (the bytes objects they already are)
can go to a socket with one writev and no copy. The receiver parses the
joined bytes as usual.
"""

from __future__ import annotations

# The varint of each n below 0x80: one byte, made once.
SMALL_VARINTS = [bytes((i,)) for i in range(0x80)]


def varint(n: int) -> bytes:
    """``n`` (>= 0) as a protobuf varint."""
    if n < 0x80:
        return SMALL_VARINTS[n]
    if n < 0x4000:  # offsets and counts mostly fit in 2-4 bytes: no loop for them
        return bytes((n & 0x7F | 0x80, n >> 7))
    if n < 0x200000:
        return bytes((n & 0x7F | 0x80, n >> 7 & 0x7F | 0x80, n >> 14))
    if n < 0x10000000:
        return bytes((n & 0x7F | 0x80, n >> 7 & 0x7F | 0x80, n >> 14 & 0x7F | 0x80, n >> 21))
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def length_delimited(field: int, length: int) -> bytes:
    """The tag and length that precede a bytes or message field's payload."""
    return varint(field << 3 | 2) + varint(length)


def leading_varint(data: bytes, field: int) -> int:
    """The value of varint field ``field`` when it is the first field of
    message ``data`` (as a writer that wants it read cheaply puts it:
    fields may come in any order), else 0. Reads at most 11 bytes."""
    tag = field << 3
    head = data[:11]
    if not head or head[0] != tag or tag >= 0x80:
        return 0
    try:
        return read_varint(head, 1, len(head))[0]
    except ValueError:
        return 0  # not a varint within 10 bytes: no hint


def with_leading_varint(data: bytes, field: int, value: int) -> bytes:
    """``data`` (a message) with varint field ``field`` = ``value`` written
    first (``leading_varint`` reads it back); ``value`` 0: ``data``."""
    return varint(field << 3) + varint(value) + data if value else data


def read_varint(data: bytes | memoryview, at: int, end: int) -> tuple[int, int]:
    """The varint at ``data[at]`` (read no further than ``end``) and where
    the next field starts; ValueError if it is cut short or too long."""
    value = shift = 0
    while True:
        if at >= end or shift > 63:
            raise ValueError("truncated varint")
        b = data[at]
        at += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, at
        shift += 7


def field_spans(
    data: bytes | memoryview, number: int, at: int = 0, end: int | None = None
) -> list[tuple[int, int]]:
    """(start, end) of the payload of each length-delimited field ``number``
    of the message in ``data[at:end]`` (all of ``data`` by default), in
    order, every other field skipped; ValueError if the bytes are not a
    well-formed message (groups included: roadlog writes none)."""
    end = len(data) if end is None else end
    out: list[tuple[int, int]] = []
    while at < end:
        tag, at = read_varint(data, at, end)
        wire = tag & 7
        if wire == 0:
            _, at = read_varint(data, at, end)
        elif wire == 1:
            at += 8
        elif wire == 5:
            at += 4
        elif wire == 2:
            size, at = read_varint(data, at, end)
            if at + size > end:
                raise ValueError("truncated field")
            if tag >> 3 == number:
                out.append((at, at + size))
            at += size
        else:
            raise ValueError(f"wire type {wire}")
        if at > end:
            raise ValueError("truncated field")
    return out
