"""The write path's merge as it was before it became one permutation pass
(commit 7391ce1): ``prepare_appends`` with its own copies of ``columnar``'s
``parse``, ``join`` and ``encode``, ``split_by_partition`` and
``ping_reasons``, kept verbatim as the reference that
``test_appends_equivalence`` compares the current code with, byte for byte.
Not used outside the tests."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from google.protobuf.message import DecodeError

from node_daemon.work.appends import MalformedRequest, PreparedAppend, TopicLookup
from roadlog.columnar import (
    _COLUMNS,
    _OPTIONAL,
    NO_DEVICE,
    BatchDecodeError,
    ColumnBytes,
    PingColumns,
)
from roadlog.geo import Region
from roadlog.v1 import client_pb2, command_pb2, pings_pb2
from roadlog.validation import (
    _REASONS,
    FUTURE_SLACK_MS,
    MAX_ACCURACY_M,
    MAX_DEVICE_ID_BYTES,
    MAX_REPORTED,
    MAX_SPEED_MPS,
    MIN_TS_MS,
    BadPing,
    BatchRejected,
    check_size,
)

MAX_PINGS_PER_OP = 50_000


@dataclass(frozen=True, eq=False)
class _Request:
    position: int
    view: client_pb2.PublishRequestView
    pings: ColumnBytes  # decoded together with the rest of its chunk (columnar.join)


def prepare_appends(
    requests: Sequence[bytes],
    lookup: TopicLookup,
    now_ms: int,
    max_pings_per_op: int = MAX_PINGS_PER_OP,
) -> tuple[list[PreparedAppend], dict[int, Exception]]:
    """Merge serialized PublishRequests into append ops. Returns the ops and,
    by request position, why each refused request was refused. Every
    position is in exactly one of the two."""
    errors: dict[int, Exception] = {}
    by_topic: dict[str, list[_Request]] = {}
    for i, raw in enumerate(requests):
        try:
            view = client_pb2.PublishRequestView.FromString(raw)
            pings = parse(view.batch)
            check_size(pings.n)
        except (DecodeError, BatchDecodeError) as e:
            errors[i] = MalformedRequest(f"malformed request: {e}")
            continue
        except BatchRejected as e:
            errors[i] = e
            continue
        by_topic.setdefault(view.topic, []).append(_Request(i, view, pings))
    out: list[PreparedAppend] = []
    for topic, reqs in by_topic.items():
        try:
            partitions, region = lookup(topic)
        except Exception as e:
            for r in reqs:
                errors[r.position] = e
            continue
        for chunk in _chunks(reqs, max_pings_per_op):
            prepared = _merge(topic, partitions, region, chunk, now_ms, errors)
            if prepared is not None:
                out.append(prepared)
    return out, errors


def _chunks(reqs: list[_Request], max_pings: int) -> list[list[_Request]]:
    chunks: list[list[_Request]] = [[]]
    pings = 0
    for r in reqs:
        if chunks[-1] and pings + r.pings.n > max_pings:
            chunks.append([])
            pings = 0
        chunks[-1].append(r)
        pings += r.pings.n
    return chunks


def _merge(
    topic: str,
    partitions: int,
    region: Region,
    chunk: list[_Request],
    now_ms: int,
    errors: dict[int, Exception],
) -> PreparedAppend | None:
    merged = join([r.pings for r in chunk])
    reasons = ping_reasons(merged, region, now_ms)
    keep: list[_Request] = chunk
    if reasons.any():
        keep = []
        lo = 0
        for r in chunk:
            hi = lo + r.pings.n
            try:
                raise_if_bad(reasons[lo:hi])
                keep.append(r)
            except BatchRejected as e:
                errors[r.position] = e
            lo = hi
    if not keep:
        return None
    lengths = np.array([r.pings.n for r in keep], dtype=np.int64)
    if len(keep) < len(chunk):
        kept_at = {r.position for r in keep}
        kept = np.repeat([r.position in kept_at for r in chunk], [r.pings.n for r in chunk])
        merged = merged.take(np.flatnonzero(kept))
    per_device = device_partitions(merged, partitions)
    row_span = np.repeat(np.arange(len(keep)), lengths)
    cells = row_span * partitions + per_device[merged.device_index]
    counts = np.bincount(cells, minlength=len(keep) * partitions).reshape(len(keep), partitions)
    parts = split_by_partition(merged, partitions, per_device)
    wrapper = command_pb2.Op()
    op = wrapper.append  # filled in place: wrapping it afterwards would copy the pings
    op.topic = topic
    for p, cols in parts:
        op.parts.add(partition=p, batch=encode(cols), count=len(cols))
    span_counts = counts[:, [p for p, _ in parts]].tolist()
    for r, row in zip(keep, span_counts, strict=True):
        op.spans.add(
            client_id=r.view.client_id,
            producer_id=r.view.producer_id,
            sequence=r.view.sequence,
            counts=row,
        )
    return PreparedAppend(wrapper, [r.position for r in keep])


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


def parse(data: bytes) -> ColumnBytes:
    """Check PingBatch wire bytes and keep their columns as bytes (no array
    yet). Raises BatchDecodeError for anything that is not a PingBatch."""
    try:
        view = pings_pb2.PingBatchView.FromString(data)
    except DecodeError:
        return _column_bytes(_decode_slow(data))
    if view.ByteSize() != len(data):
        return _column_bytes(_decode_slow(data))
    raw = {attr: getattr(view, attr) for _, attr in _COLUMNS}
    n, rem = divmod(len(raw["ts_ms"]), 8)
    for (_, attr), size in zip(_COLUMNS, _ITEMSIZES, strict=True):
        b = raw[attr]
        if len(b) != n * size or rem:
            if not b and attr in _OPTIONAL:
                del raw[attr]
                continue
            return _column_bytes(_decode_slow(data))  # it decides, or names the column
    return ColumnBytes(n, list(view.device_ids), raw)


def join(parts: Sequence[ColumnBytes]) -> PingColumns:
    """All pings of ``parts`` in order, as one batch whose dictionary holds
    each device id once; one array per column is made, from the joined
    bytes. Python work is per part and per distinct device id, never per
    ping. A device index out of its part's dictionary stays out of range
    (``NO_DEVICE``), so validation still reports it."""
    n = sum(p.n for p in parts)
    cols: dict[str, np.ndarray] = {}
    for dtype, attr in _COLUMNS:
        if attr in _OPTIONAL:
            if not any(attr in p.columns for p in parts):
                cols[attr] = np.full(n, np.nan, dtype=np.float32)
                continue
            chunks = [p.columns.get(attr) or _NAN32 * p.n for p in parts]
        else:
            chunks = [p.columns[attr] for p in parts]
        buf = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        cols[attr] = np.frombuffer(buf, dtype=dtype)
    if len(parts) == 1:
        return _assemble(parts[0].device_ids, cols)
    all_ids = [d for p in parts for d in p.device_ids]
    ids = {d: i for i, d in enumerate(dict.fromkeys(all_ids))}
    # Global dictionary position of every part's every id, then one sentinel.
    remap = np.fromiter(map(ids.__getitem__, all_ids), dtype=np.uint32, count=len(all_ids))
    remap = np.append(remap, NO_DEVICE)
    ndev = np.array([len(p.device_ids) for p in parts], dtype=np.int64)
    sizes = np.array([p.n for p in parts], dtype=np.int64)
    first = np.repeat(np.cumsum(ndev) - ndev, sizes)  # each ping's part's first id
    local = cols["device_index"].astype(np.int64)
    glob = np.where(local < np.repeat(ndev, sizes), first + local, len(all_ids))
    cols["device_index"] = remap[glob]
    return _assemble(list(ids), cols)


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


_ITEMSIZES = tuple(np.dtype(dtype).itemsize for dtype, _ in _COLUMNS)
_NAN32 = np.float32(np.nan).tobytes()


def partition_of(device_id: str, partitions: int) -> int:
    return zlib.crc32(device_id.encode()) % partitions


def device_partitions(cols: PingColumns, partitions: int) -> npt.NDArray[np.int64]:
    """The partition of each device in the batch's dictionary."""
    ndev = len(cols.device_ids)
    return np.fromiter(
        (partition_of(d, partitions) for d in cols.device_ids), dtype=np.int64, count=ndev
    )


def split_by_partition(
    cols: PingColumns, partitions: int, per_device: npt.NDArray[np.int64] | None = None
) -> list[tuple[int, PingColumns]]:
    """The batch's pings grouped by partition in ascending partition order,
    each group in sending order, each with the dictionary of just its own
    devices (all computed at once). Device indexes must be in range."""
    if per_device is None:
        per_device = device_partitions(cols, partitions)
    ndev = len(per_device)
    if ndev and (per_device == per_device[0]).all():
        return [(int(per_device[0]), cols)] if len(cols) else []
    # Each device's index within its own partition's dictionary.
    dev_order = np.argsort(per_device, kind="stable")
    sorted_parts = per_device[dev_order]
    rank = np.empty(ndev, dtype=np.uint32)
    rank[dev_order] = np.arange(ndev) - np.searchsorted(sorted_parts, sorted_parts, side="left")
    part = per_device[cols.device_index]
    order: npt.NDArray[np.intp] = np.argsort(part, kind="stable")
    bounds = np.flatnonzero(np.diff(part[order])) + 1
    out = []
    for idx in np.split(order, bounds):
        if not len(idx):
            continue
        p = int(part[idx[0]])
        devices = dev_order[sorted_parts == p]
        out.append(
            (
                p,
                PingColumns(
                    [cols.device_ids[int(i)] for i in devices],
                    rank[cols.device_index[idx]],
                    cols.ts_ms[idx],
                    cols.lat[idx],
                    cols.lon[idx],
                    cols.speed_mps[idx],
                    cols.heading_deg[idx],
                    cols.accuracy_m[idx],
                ),
            )
        )
    return out


def raise_if_bad(reasons: npt.NDArray[np.int8]) -> None:
    """Raise BatchRejected for a batch whose ``ping_reasons`` are these."""
    bad = np.flatnonzero(reasons)
    if len(bad):
        shown = [BadPing(int(i), _REASONS[int(reasons[i])]) for i in bad[:MAX_REPORTED]]
        raise BatchRejected(shown, len(bad))


def ping_reasons(cols: PingColumns, region: Region, now_ms: int) -> npt.NDArray[np.int8]:
    """Per ping, 0 if it is plausible and inside ``region``, else the code of
    the first rule it breaks (vectorised; also over several requests' pings
    concatenated, whose results the caller slices back per request)."""
    n = len(cols)
    reasons = np.zeros(n, dtype=np.int8)

    def flag(mask: npt.NDArray[np.bool_], code: int) -> None:
        reasons[(reasons == 0) & mask] = code

    ndev = len(cols.device_ids)
    flag(cols.device_index >= ndev, 1)
    bad_ids = np.array(
        [not (1 <= len(d.encode()) <= MAX_DEVICE_ID_BYTES) for d in cols.device_ids] + [False],
        dtype=bool,
    )
    if bad_ids.any():
        flag(bad_ids[np.minimum(cols.device_index, ndev)], 2)
    lat, lon = cols.lat, cols.lon
    flag(~np.isfinite(lat) | (lat < -90) | (lat > 90), 3)
    flag(~np.isfinite(lon) | (lon < -180) | (lon > 180), 4)
    flag((cols.ts_ms < MIN_TS_MS) | (cols.ts_ms > now_ms + FUTURE_SLACK_MS), 5)
    # NaN (unknown) passes: comparisons with NaN are False.
    sp, hd, ac = cols.speed_mps, cols.heading_deg, cols.accuracy_m
    flag(np.isinf(sp) | (sp < 0) | (sp > MAX_SPEED_MPS), 6)
    flag(np.isinf(hd) | (hd < 0) | (hd >= 360), 7)
    flag(np.isinf(ac) | (ac < 0) | (ac > MAX_ACCURACY_M), 8)
    ok = reasons == 0
    if ok.all():
        flag(~region.contains(lon, lat), 9)
    elif ok.any():
        inside = np.ones(n, dtype=bool)
        inside[ok] = region.contains(lon[ok], lat[ok])
        flag(~inside, 9)
    return reasons
