"""Protobuf wire-format pieces for writing a message in parts.

A message is the concatenation of its fields in any order, and a bytes or
message field is its tag, its length and its payload; so a message whose
big fields are left as separate parts (the bytes objects they already are)
can go to a socket with one writev and no copy. The receiver parses the
joined bytes as usual.
"""

from __future__ import annotations

_ONE_BYTE = [bytes((i,)) for i in range(0x80)]


def varint(n: int) -> bytes:
    """``n`` (>= 0) as a protobuf varint."""
    if n < 0x80:
        return _ONE_BYTE[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def length_delimited(field: int, length: int) -> bytes:
    """The tag and length that precede a bytes or message field's payload."""
    return varint(field << 3 | 2) + varint(length)
