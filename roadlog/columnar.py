"""Columnar ping batches: numpy arrays in memory, a PingBatch on the wire.

Every PingBatch column is a packed fixed-width field, so its wire bytes are
the array's little-endian bytes behind a tag and a length: ``decode`` reads
them with ``np.frombuffer`` and ``encode`` writes ``ndarray.tobytes()``. No
Python object is made per ping; only the distinct device ids become strings.
Anything a generic protobuf encoder may legally produce that this fast path
does not expect (split or unpacked columns, unknown fields) is decoded by
the generated protobuf class instead, with the same result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from roadlog.v1 import pings_pb2

U32 = npt.NDArray[np.uint32]
I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]
F32 = npt.NDArray[np.float32]

# Field number -> (numpy little-endian dtype, attribute) for the packed columns.
_COLUMNS: dict[int, tuple[str, str]] = {
    2: ("<u4", "device_index"),
    3: ("<i8", "ts_ms"),
    4: ("<f8", "lat"),
    5: ("<f8", "lon"),
    6: ("<f4", "speed_mps"),
    7: ("<f4", "heading_deg"),
    8: ("<f4", "accuracy_m"),
}
_OPTIONAL = ("speed_mps", "heading_deg", "accuracy_m")


class BatchDecodeError(ValueError):
    """The bytes are not a well-formed PingBatch."""


@dataclass(frozen=True, eq=False)
class PingColumns:
    """A batch of pings as columns. Invariant: every column has the same
    length; ``device_index`` values index ``device_ids`` (checked by
    ``validation``, not here); unknown optional values are NaN."""

    device_ids: list[str]
    device_index: U32
    ts_ms: I64
    lat: F64
    lon: F64
    speed_mps: F32
    heading_deg: F32
    accuracy_m: F32

    def __len__(self) -> int:
        return int(self.ts_ms.shape[0])

    @classmethod
    def from_columns(
        cls,
        device_id: Sequence[str],
        ts_ms: Sequence[int] | I64,
        lat: Sequence[float] | F64,
        lon: Sequence[float] | F64,
        speed_mps: Sequence[float] | F32 | None = None,
        heading_deg: Sequence[float] | F32 | None = None,
        accuracy_m: Sequence[float] | F32 | None = None,
    ) -> PingColumns:
        """Build from one device id per ping (dictionary-encoded here)."""
        uniq, inverse = np.unique(np.asarray(device_id, dtype=object), return_inverse=True)
        n = len(device_id)

        def opt(v: Sequence[float] | F32 | None) -> F32:
            if v is None:
                return np.full(n, np.nan, dtype=np.float32)
            return np.asarray(v, dtype=np.float32)

        return cls(
            [str(d) for d in uniq],
            inverse.astype(np.uint32),
            np.asarray(ts_ms, dtype=np.int64),
            np.asarray(lat, dtype=np.float64),
            np.asarray(lon, dtype=np.float64),
            opt(speed_mps),
            opt(heading_deg),
            opt(accuracy_m),
        )

    def take(self, idx: npt.NDArray[np.intp]) -> PingColumns:
        """The pings at ``idx`` (in that order), with a compacted dictionary."""
        used, remap = np.unique(self.device_index[idx], return_inverse=True)
        return PingColumns(
            [self.device_ids[int(i)] for i in used],
            remap.astype(np.uint32),
            self.ts_ms[idx],
            self.lat[idx],
            self.lon[idx],
            self.speed_mps[idx],
            self.heading_deg[idx],
            self.accuracy_m[idx],
        )

    def device_of(self) -> npt.NDArray[np.object_]:
        """One device id per ping (objects: for display and tests, not hot paths)."""
        return np.asarray(self.device_ids, dtype=object)[self.device_index]


NO_DEVICE = np.uint32(0xFFFFFFFF)  # a device index no dictionary reaches


def concat(batches: Sequence[PingColumns]) -> PingColumns:
    """All pings of ``batches`` in order, as one batch whose dictionary holds
    each device id once. A device index out of its batch's dictionary stays
    out of range (``NO_DEVICE``), so validation still reports it."""
    if len(batches) == 1:
        return batches[0]
    ids: dict[str, int] = {}
    index_parts = []
    for b in batches:
        nd = len(b.device_ids)
        remap = np.fromiter(
            (ids.setdefault(d, len(ids)) for d in b.device_ids), dtype=np.uint32, count=nd
        )
        remap = np.append(remap, NO_DEVICE)
        index_parts.append(remap[np.minimum(b.device_index, nd)])
    cat = np.concatenate
    return PingColumns(
        list(ids),
        cat(index_parts),
        cat([b.ts_ms for b in batches]),
        cat([b.lat for b in batches]),
        cat([b.lon for b in batches]),
        cat([b.speed_mps for b in batches]),
        cat([b.heading_deg for b in batches]),
        cat([b.accuracy_m for b in batches]),
    )


PING_FIELDS = (
    "partition",
    "offset",
    "device_id",
    "ts_ms",
    "lat",
    "lon",
    "speed_mps",
    "heading_deg",
    "accuracy_m",
)


def optional(v: Any, digits: int | None = None) -> float | None:
    """An optional value for output: None when unknown (NaN)."""
    x = float(v)
    if math.isnan(x):
        return None
    return round(x, digits) if digits is not None else x


def rows(
    cols: PingColumns, partition: int, base: int, digits: int | None = None
) -> list[tuple[Any, ...]]:
    """One tuple per ping in ``PING_FIELDS`` order, for output formats (CSV,
    JSON); not for hot paths. Optional values are None when unknown, rounded
    to ``digits`` when given."""
    dev = cols.device_of().tolist()
    ts, lat, lon = cols.ts_ms.tolist(), cols.lat.tolist(), cols.lon.tolist()
    sp, hd, ac = cols.speed_mps.tolist(), cols.heading_deg.tolist(), cols.accuracy_m.tolist()
    return [
        (
            partition,
            base + i,
            str(dev[i]),
            ts[i],
            lat[i],
            lon[i],
            optional(sp[i], digits),
            optional(hd[i], digits),
            optional(ac[i], digits),
        )
        for i in range(len(ts))
    ]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise BatchDecodeError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def encode(cols: PingColumns) -> bytes:
    """PingBatch wire bytes. All-NaN optional columns are left out."""
    parts: list[bytes] = []
    for d in cols.device_ids:
        raw = d.encode()
        parts += [b"\x0a", _varint(len(raw)), raw]
    for field, (dtype, attr) in _COLUMNS.items():
        arr = getattr(cols, attr)
        if len(arr) == 0 or (attr in _OPTIONAL and bool(np.isnan(arr).all())):
            continue
        raw = np.ascontiguousarray(arr, dtype=dtype).tobytes()
        parts += [_varint(field << 3 | 2), _varint(len(raw)), raw]
    return b"".join(parts)


def decode(data: bytes) -> PingColumns:
    """Read PingBatch wire bytes as columns (zero-copy for the columns)."""
    buf = memoryview(data)
    pos, end = 0, len(buf)
    devices: list[str] = []
    cols: dict[str, np.ndarray] = {}
    try:
        while pos < end:
            key, pos = _read_varint(buf, pos)
            field, wire = key >> 3, key & 7
            if wire != 2 or (field != 1 and field not in _COLUMNS):
                return _decode_slow(data)
            length, pos = _read_varint(buf, pos)
            if pos + length > end:
                raise BatchDecodeError("truncated field")
            chunk = buf[pos : pos + length]
            pos += length
            if field == 1:
                devices.append(bytes(chunk).decode())
                continue
            dtype, attr = _COLUMNS[field]
            if attr in cols or length % np.dtype(dtype).itemsize:
                return _decode_slow(data)
            cols[attr] = np.frombuffer(chunk, dtype=dtype)
    except UnicodeDecodeError as e:
        raise BatchDecodeError(f"device id is not UTF-8: {e}") from None
    return _assemble(devices, cols)


def _decode_slow(data: bytes) -> PingColumns:
    try:
        msg = pings_pb2.PingBatch.FromString(data)
    except Exception as e:
        raise BatchDecodeError(f"not a PingBatch: {e}") from None
    cols: dict[str, np.ndarray] = {}
    for dtype, attr in _COLUMNS.values():
        values = getattr(msg, attr)
        if len(values):
            cols[attr] = np.asarray(values, dtype=dtype)
    return _assemble(list(msg.device_ids), cols)


def _assemble(devices: list[str], cols: dict[str, np.ndarray]) -> PingColumns:
    n = len(cols.get("ts_ms", ()))
    for attr in ("device_index", "lat", "lon"):
        if len(cols.get(attr, ())) != n:
            raise BatchDecodeError(f"column {attr} has {len(cols.get(attr, ()))} values, not {n}")
    for attr in _OPTIONAL:
        if attr not in cols:
            cols[attr] = np.full(n, np.nan, dtype=np.float32)
        elif len(cols[attr]) != n:
            raise BatchDecodeError(f"column {attr} has {len(cols[attr])} values, not {n}")
    empty = np.empty(0)
    return PingColumns(
        devices,
        cols.get("device_index", empty).astype(np.uint32, copy=False),
        cols.get("ts_ms", empty).astype(np.int64, copy=False),
        cols.get("lat", empty).astype(np.float64, copy=False),
        cols.get("lon", empty).astype(np.float64, copy=False),
        cols["speed_mps"].astype(np.float32, copy=False),
        cols["heading_deg"].astype(np.float32, copy=False),
        cols["accuracy_m"].astype(np.float32, copy=False),
    )
