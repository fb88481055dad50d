"""The state's format on disk, and what a copy of the state records, read
without opening it as a state (a snapshot file just written or received,
a backup).

A state records its format under ``state_format`` in ``meta`` when it is
opened; a release reads every earlier format and refuses a later one
(StateFormatError) rather than misread it.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from pathlib import Path

import lmdb

_U64 = struct.Struct(">Q")

# The state's on-disk layout: 1, batches stored whole; 2, in pieces of a page
# (``batch_store``); 3, as references into the Raft log where the node's log
# is open to it (``batch_refs``); 4, contributions as runs of pings (24-byte
# values, ``heatmaps``) and cluster settings in meta (``settings``), which a
# release of format 3 would misread. Each reads the earlier ones' too. A
# state of a later format (a newer release's) is refused, not misread.
STATE_FORMAT = 4
FORMAT_KEY = b"state_format"  # in meta; local to the replica, not in the digest


class StateFormatError(Exception):
    """The state on disk was written by a newer release of roadlog."""


def stored_meta(directory: str | os.PathLike[str], keys: Sequence[bytes]) -> list[int] | None:
    """The integers under ``keys`` in the ``meta`` of the state environment
    in ``directory`` (0 where absent), opened read-only and without a lock
    file; None if it has no ``meta`` (nothing was ever applied)."""
    env = lmdb.open(str(directory), readonly=True, lock=False, max_dbs=16)
    try:
        try:
            meta = env.open_db(b"meta", create=False)
        except lmdb.NotFoundError:
            return None
        with env.begin() as txn:
            values = [txn.get(k, db=meta) for k in keys]
    finally:
        env.close()
    return [int(_U64.unpack(v)[0]) if v else 0 for v in values]


def refuse_newer(directory: Path, stored: int) -> None:
    """StateFormatError if ``stored`` is a format this release cannot read."""
    if stored > STATE_FORMAT:
        raise StateFormatError(
            f"the state in {directory} has format {stored}, written by a newer release of "
            f"roadlog; this one reads formats up to {STATE_FORMAT}"
        )


def check_format(directory: Path) -> None:
    """StateFormatError if the state environment in ``directory`` has a
    format this release cannot read (one with nothing applied: any reads it)."""
    stored = stored_meta(directory, [FORMAT_KEY])
    if stored is not None:
        refuse_newer(directory, stored[0])


def applied_of(directory: str | os.PathLike[str]) -> tuple[int, int]:
    """The (applied index, applied term) recorded in a state environment's
    copy, opened read-only and without a lock file."""
    values = stored_meta(directory, [b"applied_index", b"applied_term"])
    if values is None:
        raise lmdb.NotFoundError(f"no meta database in the state in {directory}")
    index, term = values
    return index, term
