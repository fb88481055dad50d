"""Some columns of a stored PingBatch, for a reader that needs only those
(the Spark source's column pruning: ``ReadRange`` with ``columns``).

``prune`` (the node) cuts a stored batch down to the named columns: the
columns' fields as PingBatch wire bytes (packed fixed-width, so the bytes
are the little-endian arrays), and the batch's device dictionary as its own
``device_ids`` fields, the stored bytes unchanged where the batch was
written ids first (``columnar.encode``), so no id becomes a Python string
there. ``parse_subset`` (the reader) reads that back: one C parse, the
columns still bytes. No Python object is made per ping on either side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from roadlog import columnar
from roadlog.protowire import varint
from roadlog.v1 import pings_pb2

# A column of the reader's schema -> the PingBatch field that holds it
# (device_id: the dictionary ``device_ids`` and the per-ping ``device_index``).
FIELDS = {
    "device_id": "device_index",
    "ts_ms": "ts_ms",
    "lat": "lat",
    "lon": "lon",
    "speed_mps": "speed_mps",
    "heading_deg": "heading_deg",
    "accuracy_m": "accuracy_m",
}
WIDTH = {"device_index": 4, "ts_ms": 8, "lat": 8, "lon": 8, "speed_mps": 4,
         "heading_deg": 4, "accuracy_m": 4}  # fmt: skip
_TAG = {a: bytes((((2 + i) << 3) | 2,)) for i, a in enumerate(WIDTH)}  # fields 2..8
OPTIONAL = frozenset(("speed_mps", "heading_deg", "accuracy_m"))


def fields_for(columns: Sequence[str]) -> list[str]:
    """The PingBatch fields that hold ``columns`` (ValueError: one no batch has)."""
    bad = [c for c in columns if c not in FIELDS]
    if bad:
        raise ValueError(f"no stored column {', '.join(bad)} (stored: {', '.join(FIELDS)})")
    return list(dict.fromkeys(FIELDS[c] for c in columns))


def prune(data: bytes, fields: Sequence[str]) -> tuple[bytes, bytes, int]:
    """A stored batch's ``fields`` (PingBatch wire bytes of just those, an
    optional column all unknown left out as ``encode`` does), its device
    dictionary's ``device_ids`` fields (b"" unless ``device_index`` is
    asked for) and its pings."""
    cb = columnar.parse(data)
    out: list[bytes] = []
    for f in fields:
        raw = cb.columns.get(f)
        if raw is None:  # an optional column all unknown: left out, as stored
            continue
        out += (_TAG[f], varint(len(raw)), raw)
    ids = b""
    if "device_index" in fields:
        ids = _ids_bytes(data, cb)
    return b"".join(out), ids, cb.n


def _ids_bytes(data: bytes, cb: columnar.ColumnBytes) -> bytes:
    """The batch's ``device_ids`` fields: its first bytes when it was
    written ids first and canonically (what ``columnar.encode`` writes: the
    columns then take exactly the rest), else written anew."""
    tail = sum(1 + len(varint(len(v))) + len(v) for v in cb.columns.values() if v)
    k = len(data) - tail
    if k >= 0 and (k == 0 or data[0] == 0x0A):
        head = data[:k]
        try:
            only = pings_pb2.PingBatchView.FromString(head)
        except DecodeError:  # not whole fields: written anew below
            only = None
        if (
            only is not None
            and only.ByteSize() == k
            and len(only.device_ids) == len(cb.device_ids)
            and not any(getattr(only, a) for a in WIDTH)
        ):
            return head
    return b"".join(columnar.device_id_field(s.encode()) for s in cb.device_ids)


@dataclass(frozen=True, slots=True)
class Subset:
    """A pruned batch as read back: ``n`` pings, each field present as
    wire bytes (an optional one absent: all unknown), the dictionary's
    wire bytes (``device_ids`` fields)."""

    n: int
    columns: dict[str, bytes]
    ids: bytes


def parse_subset(batch: bytes, ids: bytes, n: int) -> Subset:
    """Read ``prune``'s output back (ValueError: not what it writes)."""
    view = pings_pb2.PingBatchView.FromString(batch)
    cols = {}
    for f, w in WIDTH.items():
        raw = getattr(view, f)
        if raw:
            if len(raw) != w * n:
                raise ValueError(f"column {f}: {len(raw)} bytes for {n} pings")
            cols[f] = raw
    return Subset(n, cols, ids)
