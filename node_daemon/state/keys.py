"""Small LMDB key helpers the state's tables share."""

from __future__ import annotations

import struct
from typing import Any

_U64 = struct.Struct(">Q")


def meta_int(txn: Any, meta: Any, key: bytes) -> int:
    """The integer stored under ``key`` in ``meta`` (0: none)."""
    raw = txn.get(key, db=meta)
    return int(_U64.unpack(raw)[0]) if raw else 0


def count_prefix(txn: Any, db: Any, prefix: bytes, limit: int) -> int:
    """Keys of ``db`` that start with ``prefix``, counted up to ``limit``
    (a quota check needs no more, so a big count costs no more than that)."""
    n = 0
    cur = txn.cursor(db=db)
    if cur.set_range(prefix):
        for key in cur.iternext(keys=True, values=False):
            if not key.startswith(prefix) or n >= limit:
                break
            n += 1
    return n


def delete_prefix(txn: Any, db: Any, prefix: bytes) -> None:
    """Delete every key of ``db`` that starts with ``prefix``."""
    cur = txn.cursor(db=db)
    if not cur.set_range(prefix):
        return
    while cur.key().startswith(prefix):
        if not cur.delete():
            break
