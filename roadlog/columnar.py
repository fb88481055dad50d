"""Columnar ping batches: numpy arrays in memory, a PingBatch on the wire.

Every PingBatch column is a packed fixed-width field, so its wire bytes are
the array's little-endian bytes behind a tag and a length, which is exactly
how a bytes field is written. ``decode`` parses through ``PingBatchView``
(columns as bytes: one C parse) and wraps each with ``np.frombuffer``;
``encode`` sets ``ndarray.tobytes()`` and serializes in C. No Python object
is made per ping; only the distinct device ids become strings. Anything a
generic protobuf encoder may legally produce that the view cannot hold
(split or unpacked columns) is decoded by the generated PingBatch class
instead, with the same result.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, pairwise
from typing import Any

import numpy as np
import numpy.typing as npt
from google.protobuf.message import DecodeError

from roadlog.protowire import varint
from roadlog.v1 import pings_pb2

U32 = npt.NDArray[np.uint32]
I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]
F32 = npt.NDArray[np.float32]

# (numpy little-endian dtype, attribute) of each packed column, in field
# order (PingBatch fields 2..8; the names are those of PingBatchView too).
_COLUMNS: tuple[tuple[str, str], ...] = (
    ("<u4", "device_index"),
    ("<i8", "ts_ms"),
    ("<f8", "lat"),
    ("<f8", "lon"),
    ("<f4", "speed_mps"),
    ("<f4", "heading_deg"),
    ("<f4", "accuracy_m"),
)
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


def encode(cols: PingColumns) -> bytes:
    """PingBatch wire bytes (written through ``PingBatchView``: one
    serialization in C). All-NaN optional columns are left out."""
    view = pings_pb2.PingBatchView(device_ids=cols.device_ids)
    for dtype, attr in _COLUMNS:
        arr = getattr(cols, attr)
        if len(arr) == 0 or (attr in _OPTIONAL and bool(np.isnan(arr).all())):
            continue
        setattr(view, attr, np.ascontiguousarray(arr, dtype=dtype).tobytes())
    return view.SerializeToString()


def device_id_field(utf8: bytes) -> bytes:
    """One ``device_ids`` entry of PingBatch wire bytes (tag, length, UTF-8)."""
    return b"\n" + varint(len(utf8)) + utf8


def encode_runs(
    cols: PingColumns, bounds: Sequence[int], dictionaries: Sequence[Sequence[bytes]]
) -> list[bytes]:
    """PingBatch wire bytes of consecutive runs of ``cols``, byte for byte
    what ``encode`` writes for each run on its own: run ``k`` is rows
    ``bounds[k]`` to ``bounds[k + 1]`` (at least one), its device indexes
    already relative to its own dictionary, whose ``device_ids`` entries
    (``device_id_field``) are ``dictionaries[k]``; ``cols.device_ids`` is not
    read. Each column is made contiguous once and sliced per run; an
    optional column is left out of a run where all its values are unknown."""
    runs = list(pairwise(bounds))
    by_width = {
        size: (
            [varint(size * (hi - lo)) for lo, hi in runs],
            [(size * lo, size * hi) for lo, hi in runs],
        )
        for size in (4, 8)
    }
    out: list[list[bytes | memoryview]] = [[*d] for d in dictionaries]
    for (dtype, attr), tag in zip(_COLUMNS, _TAGS, strict=True):
        arr = getattr(cols, attr)
        present: list[bool] | None = None
        if attr in _OPTIONAL:
            if is_unknown(arr):
                continue
            nan = np.isnan(arr)
            if nan.any():
                present = (~np.logical_and.reduceat(nan, bounds[:-1])).tolist()
        arr = np.ascontiguousarray(arr, dtype=dtype)
        raw = arr.view(np.uint8).data
        heads, ranges = by_width[arr.itemsize]
        if present is None:
            for pieces, head, (a, b) in zip(out, heads, ranges, strict=True):
                pieces += (tag, head, raw[a:b])
        else:
            for pieces, head, (a, b), keep in zip(out, heads, ranges, present, strict=True):
                if keep:
                    pieces += (tag, head, raw[a:b])
    return [b"".join(pieces) for pieces in out]


# The tag of each packed column (field 2..8, wire type 2: length-delimited).
_TAGS = tuple(bytes(((field << 3) | 2,)) for field in range(2, 2 + len(_COLUMNS)))


def decode(data: bytes) -> PingColumns:
    """Read PingBatch wire bytes as columns: one C parse through
    ``PingBatchView``, then ``np.frombuffer`` per column. If the view did not
    account for every byte (a column split in pieces or not packed), or the
    columns disagree, the generated PingBatch class decides instead."""
    return join([parse(data)])


@dataclass(eq=False, slots=True)
class ColumnBytes:
    """A parsed PingBatch whose columns are still wire bytes (little-endian,
    ``_COLUMNS`` dtypes): what ``join`` needs to merge many batches with one
    ``np.frombuffer`` per column. Invariant: every column present holds
    exactly ``n`` values; an absent column is an optional one, all unknown.
    Never changed once made (not frozen only because a frozen dataclass is
    dearer to make, and one is made per publish)."""

    n: int
    device_ids: list[str]
    columns: dict[str, bytes]


def _field_size(size: int) -> int:
    """Wire bytes of a bytes field of ``size`` bytes written canonically (a
    one-byte tag, the length as a varint, the payload); 0: left out."""
    return 1 + len(varint(size)) + size if size else 0


def parse(data: bytes) -> ColumnBytes:
    """Check PingBatch wire bytes and keep their columns as bytes (no array
    yet). Raises BatchDecodeError for anything that is not a PingBatch."""
    try:
        view = pings_pb2.PingBatchView.FromString(data)
    except DecodeError:
        return _column_bytes(_decode_slow(data))
    ts = view.ts_ms
    n, rem = divmod(len(ts), 8)
    index, lat, lon = view.device_index, view.lat, view.lon
    if rem or len(index) != 4 * n or len(lat) != 8 * n or len(lon) != 8 * n:
        return _column_bytes(_decode_slow(data))  # it decides, or names the column
    raw = {"device_index": index, "ts_ms": ts, "lat": lat, "lon": lon}
    four = _field_size(4 * n)
    tail = four + 3 * _field_size(8 * n)  # the columns' bytes, written canonically
    for attr in _OPTIONAL:
        b = getattr(view, attr)
        if len(b) == 4 * n:
            raw[attr] = b
            tail += four
        elif b:
            return _column_bytes(_decode_slow(data))
    ids = _known_dictionary(data, tail)
    if ids is not None:
        # The batch is a remembered dictionary and then exactly its columns,
        # each once (see _known_dictionary): the view accounted for every byte.
        return ColumnBytes(n, ids, raw)
    if view.ByteSize() != len(data):
        return _column_bytes(_decode_slow(data))
    return ColumnBytes(n, _dictionary(data, view, tail), raw)


def _known_dictionary(data: bytes, tail: int) -> list[str] | None:
    """The ids of the remembered dictionary that ``data`` starts with, where
    ``tail`` (the canonical size of the columns the batch's view shows) is
    all that follows it; else None.

    Such a batch needs no check that its view accounted for every byte: the
    prefix is whole fields, none of them a column, so every column field
    lies in the ``tail`` bytes after it, where each takes at least its
    canonical size; as those sizes add up to ``tail``, the rest is each
    column once, canonically written, and no other field or id."""
    k = _ids_end(data, tail)
    return _DICTIONARIES.get(data[:k]) if k else None


def _ids_end(data: bytes, tail: int) -> int:
    """Where the ids of a batch written ids first end (its length less the
    columns' ``tail``); 0 when it does not start with an id or has none."""
    k = len(data) - tail
    return k if k > 0 and data[0] == 0x0A else 0


def _dictionary(data: bytes, view: Any, tail: int) -> list[str]:
    """The device ids of a parsed batch whose fields the view accounted for
    byte for byte, none remembered for it (``_known_dictionary``);
    ``tail``: the canonical size of its columns. A producer's batches
    mostly repeat one dictionary, and ``encode`` writes it first: its wire
    bytes are then the batch's prefix up to the columns, so the ids decoded
    once for those bytes are shared by every batch that starts with them
    (``MEMO_DICTIONARY_BYTES`` in all). A prefix is remembered only once it
    parsed as nothing but whole ``device_ids`` fields; then a batch with
    that prefix and columns of the rest's length has exactly those ids. The
    list returned is shared: it is never to be changed."""
    global _memo_bytes
    ids = list(view.device_ids)
    k = _ids_end(data, tail)
    if not k:  # no ids, or not written ids first
        return ids
    prefix = data[:k]
    if _memo_bytes + k <= MEMO_DICTIONARY_BYTES:
        try:
            only = pings_pb2.PingBatchView.FromString(prefix)
        except DecodeError:  # the prefix cuts a field: not a dictionary
            return ids
        pure = not any(getattr(only, attr) for _, attr in _COLUMNS)
        if pure and only.ByteSize() == k and list(only.device_ids) == ids:
            _DICTIONARIES[prefix] = ids
            _memo_bytes += k
    return ids


MEMO_DICTIONARY_BYTES = 8 << 20  # the first dictionaries seen, up to this many wire bytes
_DICTIONARIES: dict[bytes, list[str]] = {}
_memo_bytes = 0


def join(parts: Sequence[ColumnBytes]) -> PingColumns:
    """All pings of ``parts`` in order, as one batch whose dictionary holds
    each device id once; one array per column is made, from the joined
    bytes. Python work is per part and per distinct device id, never per
    ping. A device index out of its part's dictionary stays out of range
    (``NO_DEVICE``), so validation still reports it. An optional column
    that no part has is the shared all-unknown column (``is_unknown``)."""
    n = sum(p.n for p in parts)
    arrays: list[np.ndarray] = []
    for dtype, attr in _COLUMNS:
        if attr in _OPTIONAL:
            if not any(attr in p.columns for p in parts):
                arrays.append(unknown_column(n))
                continue
            chunks = [p.columns.get(attr) or _NAN32 * p.n for p in parts]
        else:
            chunks = [p.columns[attr] for p in parts]
        buf = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        arrays.append(np.frombuffer(buf, dtype=dtype))
    ids0 = parts[0].device_ids
    if len(parts) > 1:
        index = arrays[0]
        if all(p.device_ids == ids0 for p in parts) and len(set(ids0)) == len(ids0):
            # One dictionary for all (a producer's batches often share
            # theirs): every index already means the same id.
            if n and int(index.max()) >= len(ids0):
                arrays[0] = np.where(index < len(ids0), index, NO_DEVICE)
        else:
            ids0, arrays[0] = _merge_dictionaries(parts, index)
    if not _LITTLE_ENDIAN:
        return _assemble(ids0, {attr: a for (_, attr), a in zip(_COLUMNS, arrays, strict=True)})
    return PingColumns(ids0, *arrays)


def _merge_dictionaries(
    parts: Sequence[ColumnBytes], index: npt.NDArray[np.uint32]
) -> tuple[list[str], npt.NDArray[np.uint32]]:
    """One dictionary for ``parts`` (first occurrences in order), and their
    joined device indexes ``index`` moved onto it."""
    all_ids = list(chain.from_iterable(p.device_ids for p in parts))
    unique = dict.fromkeys(all_ids)
    ndev = np.array([len(p.device_ids) for p in parts], dtype=np.int64)
    sizes = np.array([p.n for p in parts], dtype=np.int64)
    first = np.repeat(np.cumsum(ndev) - ndev, sizes)  # each ping's part's first id
    local = index.astype(np.int64)
    glob = np.where(local < np.repeat(ndev, sizes), first + local, len(all_ids))
    if len(unique) == len(all_ids):  # no id in two parts: the parts' ids one after another
        return all_ids, np.where(glob < len(all_ids), glob, NO_DEVICE).astype(np.uint32)
    ids = dict(zip(unique, range(len(unique)), strict=True))
    # Global dictionary position of every part's every id, then one sentinel.
    remap = np.fromiter(map(ids.__getitem__, all_ids), dtype=np.uint32, count=len(all_ids))
    remap = np.append(remap, NO_DEVICE)
    return list(ids), remap[glob]


def unknown_column(n: int) -> F32:
    """``n`` unknown values (NaN, read-only): a view of one shared column
    when it is long enough, so that ``is_unknown`` knows it without looking."""
    if n <= len(_UNKNOWN):
        return _UNKNOWN[:n]
    out = np.full(n, np.nan, dtype=np.float32)
    out.flags.writeable = False
    return out


def is_unknown(arr: npt.NDArray[Any]) -> bool:
    """True if ``arr`` is (a view of) the shared all-unknown column; False
    says nothing (an all-NaN column may come from anywhere)."""
    return arr.base is _UNKNOWN


_UNKNOWN = np.full(1 << 16, np.nan, dtype=np.float32)
_UNKNOWN.flags.writeable = False
_LITTLE_ENDIAN = sys.byteorder == "little"  # the wire's order is the arrays' own


_NAN32 = np.float32(np.nan).tobytes()


def _column_bytes(cols: PingColumns) -> ColumnBytes:
    """A batch decoded the slow way, as column bytes again (a rare path)."""
    raw = {
        attr: np.ascontiguousarray(getattr(cols, attr), dtype=dtype).tobytes()
        for dtype, attr in _COLUMNS
    }
    return ColumnBytes(len(cols), cols.device_ids, raw)


def _decode_slow(data: bytes) -> PingColumns:
    try:
        msg = pings_pb2.PingBatch.FromString(data)
    except Exception as e:
        raise BatchDecodeError(f"not a PingBatch: {e}") from None
    cols: dict[str, np.ndarray] = {}
    for dtype, attr in _COLUMNS:
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
            cols[attr] = unknown_column(n)
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
