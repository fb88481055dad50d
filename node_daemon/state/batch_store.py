"""How the state stores a partition's ping batches in LMDB: in pieces that
each take one page.

A batch is stored under its key (topic id, partition, base offset) as two
parts: in ``batches``, its header (count, append ms) and first piece; in
``batchmore``, the rest of its bytes under the key + a piece number (1, 2,
...). Every value is at most ``PIECE`` bytes, which one 4 KiB overflow page
holds.

Why: a value over a page takes a contiguous run of overflow pages, and LMDB
cannot give one from the single pages that commits free while a read
transaction is held (a snapshot copy holds one for seconds). It then scans
and merges its whole free list for every such value and writes it back at
every commit, so each commit costs more than the last
(``bench/lmdb_freelist.py``: 1.2 to 4.1 ms of CPU per commit of 16 batches
of 1000 pings over 12,000 commits, against a flat cost in pieces). A piece
fits any free page.

Invariant (how a reader knows a batch's length): a ``batches`` value
shorter than ``FIRST_FULL`` bytes holds the whole batch; one of exactly
``FIRST_FULL`` bytes may continue in ``batchmore``; a longer one holds the
whole batch (stored before pieces, ``STATE_FORMAT`` 1); one of the header
and a reference (``batch_refs``, ``STATE_FORMAT`` 3) holds no bytes of the
batch but where they lie in the Raft log. So a state written before reads as
it is, with no migration, and a batch is the same bytes whichever way it
lies (``whole_value``, what digests hash).
"""

from __future__ import annotations

import struct
from typing import Any

from node_daemon.state import batch_refs
from node_daemon.state.batch_refs import EntrySource

PIECE = 4096 - 16  # value bytes one overflow page holds (4 KiB pages, 16-byte header)
HEADER = struct.Struct(">Iq")  # count, append ms
FIRST_FULL = PIECE  # a first part this long may continue in ``batchmore``
MORE_NAME = b"batchmore"
_NUMBER = struct.Struct(">I")


def put_batch(
    txn: Any, batches: Any, more: Any, key: bytes, count: int, append_ms: int, data: bytes
) -> None:
    """Store a batch's bytes under ``key``, a piece at most per page."""
    first = PIECE - HEADER.size
    view = memoryview(data)
    txn.put(key, HEADER.pack(count, append_ms) + view[:first], db=batches)
    for number, at in enumerate(range(first, len(data), PIECE), start=1):
        txn.put(key + _NUMBER.pack(number), view[at : at + PIECE], db=more)


def put_ref(txn: Any, batches: Any, key: bytes, count: int, append_ms: int, ref: bytes) -> None:
    """Store a batch as a reference (``batch_refs.encode_ref``) to where its
    bytes lie in the Raft log."""
    txn.put(key, HEADER.pack(count, append_ms) + ref, db=batches)


class NoEntrySource(Exception):
    """A batch stored as a reference was read where no Raft log is open to
    resolve it (a state opened alone)."""


class PiecesNotOpen(Exception):
    """A read transaction met a batch that may go on in ``batchmore`` but
    began before this process opened that database (a read-only view of a
    replica whose writer created it later): read again in a new one."""


def batch_bytes(
    txn: Any, more: Any, key: bytes, value: bytes, source: EntrySource | None = None
) -> bytes:
    """The whole PingBatch bytes of the batch whose ``batches`` value (as
    read under ``key``) is ``value``; ``more``: ``batchmore`` as opened
    before ``txn`` began, None if it was not (PiecesNotOpen if this batch
    may go on there and it exists in ``txn``); ``source``: the log a
    reference is read from (``MissingEntryError`` if it no longer keeps
    the entry, NoEntrySource if there is none)."""
    if batch_refs.is_ref(value, HEADER.size):
        if source is None:
            raise NoEntrySource(key)
        return source.read_slice(*batch_refs.decode_ref(value, HEADER.size))
    if len(value) != FIRST_FULL:
        return bytes(value[HEADER.size :])
    if more is None:
        if txn.get(MORE_NAME) is not None:  # a named database is a key of the main one
            raise PiecesNotOpen(key)
        return bytes(value[HEADER.size :])
    pieces: list[bytes | memoryview] = [memoryview(value)[HEADER.size :]]
    cur = txn.cursor(db=more)
    if cur.set_range(key):
        for k, v in cur:
            if not k.startswith(key):  # every key there is a batch's key + a number
                break
            pieces.append(v)
    return b"".join(pieces)


def whole_value(
    txn: Any, more: Any, key: bytes, value: bytes, source: EntrySource | None = None
) -> bytes:
    """Header + the whole batch: the ``batches`` value a state of format 1
    stored (what the state's digest hashes, so replicas that stored the same
    batch either way agree)."""
    if len(value) != FIRST_FULL and not batch_refs.is_ref(value, HEADER.size):
        return bytes(value)
    return bytes(value[: HEADER.size]) + batch_bytes(txn, more, key, value, source)


def delete_batch(txn: Any, batches: Any, more: Any, key: bytes) -> bytes | None:
    """Remove the batch under ``key``, pieces and all; its ``batches`` value
    (None: there was none)."""
    value = txn.get(key, db=batches)
    if value is None:
        return None
    value = bytes(value)
    txn.delete(key, db=batches)
    if len(value) == FIRST_FULL:
        cur = txn.cursor(db=more)
        if cur.set_range(key):
            while cur.key().startswith(key):
                if not cur.delete():
                    break
    return value
