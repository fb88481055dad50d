"""Arrow record batches from a range's stored batches: many stored batches
joined into one record batch of only the columns the reader's schema asks
for, each column one buffer made from the wire bytes (``np.frombuffer`` on
the joined bytes, zero-copy into Arrow). The device ids stay a dictionary
(one Arrow string array per distinct stored dictionary, kept across
batches) up to one ``take`` in C++ at the end, since Spark's Python data
source takes plain strings only (the batch's schema must equal the
declared one). No Python object is made per ping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from roadlog import columnar
from roadlog.column_subset import WIDTH, Subset
from roadlog.v1 import pings_pb2

# Per column of the source's schema: its Arrow type, and the stored field
# it comes from (None: made here: partition, offset and append_ms).
ARROW_TYPES: dict[str, pa.DataType] = {
    "partition": pa.int32(),
    "offset": pa.int64(),
    "device_id": pa.string(),
    "ts_ms": pa.int64(),
    "lat": pa.float64(),
    "lon": pa.float64(),
    "speed_mps": pa.float32(),
    "heading_deg": pa.float32(),
    "accuracy_m": pa.float32(),
    "append_ms": pa.int64(),
}
_DTYPE = {"device_index": "<u4", "ts_ms": "<i8", "lat": "<f8", "lon": "<f8",
          "speed_mps": "<f4", "heading_deg": "<f4", "accuracy_m": "<f4"}  # fmt: skip
# About the bytes per ping of each column in Arrow (device_id: its index
# and a share of the decoded strings): what tasks are sized by.
ARROW_BYTES = {"partition": 4, "offset": 8, "device_id": 16, "ts_ms": 8, "lat": 8, "lon": 8,
               "speed_mps": 4, "heading_deg": 4, "accuracy_m": 4, "append_ms": 8}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Part:
    """One stored batch of a range: where it starts, when it was appended,
    its columns (``Subset``) and its device dictionary as Arrow strings
    (None unless device_id is read)."""

    base: int
    append_ms: int
    sub: Subset
    ids: pa.Array | None


class Dictionaries:
    """Device dictionaries as Arrow string arrays, one per distinct wire
    form (a producer's batches mostly repeat theirs), up to ``max_bytes``
    of wire bytes remembered; the same array object for the same bytes."""

    def __init__(self, max_bytes: int = 8 << 20) -> None:
        self.known: dict[bytes, pa.Array] = {}
        self.size = 0
        self.max_bytes = max_bytes

    def of(self, ids: bytes) -> pa.Array:
        got = self.known.get(ids)
        if got is None:
            got = pa.array(list(pings_pb2.PingBatchView.FromString(ids).device_ids), pa.string())
            if self.size + len(ids) <= self.max_bytes:
                self.known[ids] = got
                self.size += len(ids)
        return got


def from_stored(data: bytes, dictionaries: Dictionaries | None) -> tuple[Subset, pa.Array | None]:
    """A whole stored batch (a node that does not prune) as a ``Subset``."""
    cb = columnar.parse(data)
    ids = pa.array(cb.device_ids, pa.string()) if dictionaries is not None else None
    return Subset(cb.n, dict(cb.columns), b""), ids


def _joined(parts: list[Part], field: str) -> np.ndarray[Any, Any]:
    """One array of a stored field over ``parts`` (an optional column a
    part lacks: unknown, NaN)."""
    chunks = []
    for p in parts:
        raw = p.sub.columns.get(field)
        if raw is None:
            if field not in ("speed_mps", "heading_deg", "accuracy_m"):
                raise ValueError(f"a stored batch without its {field} column")
            raw = np.full(p.sub.n, np.nan, dtype="<f4").tobytes()
        chunks.append(raw)
    buf = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    return np.frombuffer(buf, dtype=_DTYPE[field])


def _devices(parts: list[Part]) -> pa.Array:
    index = _joined(parts, "device_index")
    dicts = [p.ids for p in parts]
    assert all(d is not None for d in dicts)
    first = dicts[0]
    if all(d is first for d in dicts):
        dictionary = first
        idx = index
    else:
        sizes = np.array([len(d) for d in dicts], dtype=np.int64)  # type: ignore[arg-type]
        starts = np.cumsum(sizes) - sizes
        counts = np.array([p.sub.n for p in parts], dtype=np.int64)
        idx = index.astype(np.int64) + np.repeat(starts, counts)
        dictionary = pa.concat_arrays(dicts)
    return pc.take(dictionary, pa.array(idx))


def record_batch(
    parts: list[Part],
    partition: int,
    columns: tuple[str, ...],
    window: tuple[int | None, int | None],
) -> pa.RecordBatch | None:
    """``parts`` as one record batch of ``columns`` (in that order), only
    the pings with ``ts_ms`` in the window; None when none is."""
    counts = np.array([p.sub.n for p in parts], dtype=np.int64)
    total = int(counts.sum())
    lo, hi = window
    keep = None
    ts = None
    if lo is not None or hi is not None or "ts_ms" in columns:
        ts = _joined(parts, "ts_ms")
    if lo is not None or hi is not None:
        assert ts is not None
        keep = np.ones(total, dtype=bool)
        if lo is not None:
            keep &= ts >= lo
        if hi is not None:
            keep &= ts < hi
        if not keep.any():
            return None
        if keep.all():
            keep = None
    arrays = []
    for c in columns:
        if c == "partition":
            arrays.append(pa.array(np.full(total, partition, dtype=np.int32)))
        elif c == "offset":
            bases = np.array([p.base for p in parts], dtype=np.int64)
            starts = np.cumsum(counts) - counts
            arrays.append(pa.array(np.repeat(bases - starts, counts) + np.arange(total)))
        elif c == "append_ms":
            ms = np.array([p.append_ms for p in parts], dtype=np.int64)
            arrays.append(pa.array(np.repeat(ms, counts)))
        elif c == "device_id":
            arrays.append(_devices(parts))
        elif c == "ts_ms":
            arrays.append(pa.array(ts))
        else:
            arrays.append(pa.array(_joined(parts, c)))
    schema = pa.schema([(c, ARROW_TYPES[c]) for c in columns])
    rb = pa.RecordBatch.from_arrays(arrays, schema=schema)
    return rb.filter(pa.array(keep)) if keep is not None else rb


def stored_fields(columns: tuple[str, ...], window: tuple[int | None, int | None]) -> list[str]:
    """The stored columns to ask a node for: those of ``columns`` it holds,
    and ts_ms where a window filters on it."""
    from roadlog.column_subset import FIELDS

    want = [c for c in columns if c in FIELDS]
    windowed = window[0] is not None or window[1] is not None
    if (windowed or not want) and "ts_ms" not in want:
        want.append("ts_ms")  # none at all would mean every column
    return want


assert set(WIDTH) == set(_DTYPE)
