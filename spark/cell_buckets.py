"""Pings to mapped cells, and mapped cells to buckets that Spark shuffles
as a few opaque rows: the heat-map job's first step (spark/jobs/heatmap.py).

A task maps every ping it reads once, in Arrow (``CellMapper.map``: the
region's filter, the H3 cell, whether it lies in the window, the speed as
null when unknown), and cuts the mapped rows into ``buckets`` by a hash of
the cell (``split``): one row ``(bucket, Arrow IPC bytes)`` each. Spark
moves those rows, not a row a ping, so no ping is turned into a JVM row;
the task of a bucket reads its rows back (``join``) holding every ping of
each of its cells.

Invariant: a cell's pings all fall in one bucket, whichever task mapped
them (the bucket is a function of the cell alone).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from roadlog.geo import parse_region
from spark.cell_stats import CELLS_SCHEMA
from spark.h3cells import cells_for

BUCKETS_DDL = "bucket int, cells binary"
BUCKETS_SCHEMA = pa.schema([("bucket", pa.int32()), ("cells", pa.binary())])
# What ``map`` reads of a ping.
PING_COLUMNS = ("device_id", "ts_ms", "lat", "lon", "speed_mps")
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: an H3 index's low bits are constant


def bucket_of(h3: np.ndarray[Any, Any], buckets: int) -> np.ndarray[Any, Any]:
    """Each cell's bucket in [0, buckets)."""
    mixed = (h3.astype(np.uint64) * _MIX) >> np.uint64(32)
    return (mixed % np.uint64(buckets)).astype(np.int32)


@dataclass(frozen=True)
class CellMapper:
    """What mapping a ping needs: the resolution, the window, the region."""

    resolution: int
    window_start_ms: int
    window_end_ms: int
    region_geojson: str | None = None

    def map(self, b: pa.RecordBatch) -> pa.RecordBatch | None:
        """The batch's pings inside the region as ``CELLS_SCHEMA`` rows;
        None when none is."""
        region = _region(self.region_geojson)
        lat = b.column("lat").to_numpy(zero_copy_only=False)
        lon = b.column("lon").to_numpy(zero_copy_only=False)
        if region is not None:
            inside = region.contains(lon, lat)
            if not inside.all():
                b = b.filter(pa.array(inside))
                lat, lon = lat[inside], lon[inside]
        if b.num_rows == 0:
            return None
        h = cells_for(lat, lon, self.resolution).astype(np.int64)
        ts = b.column("ts_ms").to_numpy(zero_copy_only=False)
        now = (ts >= self.window_start_ms) & (ts < self.window_end_ms)
        sp = b.column("speed_mps").to_numpy(zero_copy_only=False)
        speed = pa.array(sp, type=pa.float32(), mask=np.isnan(sp))
        device = b.column("device_id")
        if pa.types.is_dictionary(device.type):
            device = device.dictionary_decode()
        return pa.RecordBatch.from_arrays(
            [pa.array(h), device, pa.array(now), speed], schema=CELLS_SCHEMA
        )

    def split(self, pings: Iterable[pa.RecordBatch], buckets: int) -> Iterator[pa.RecordBatch]:
        """Every ping of ``pings`` mapped, cut into ``buckets``: one
        ``BUCKETS_SCHEMA`` row per bucket that got any."""
        mapped = [m for m in (self.map(b) for b in pings if b.num_rows) if m is not None]
        if not mapped:
            return
        table = pa.Table.from_batches(mapped, schema=CELLS_SCHEMA).combine_chunks()
        which = bucket_of(table.column("h3").to_numpy(), buckets)
        # A stable sort of small integers: numpy's radix sort (linear).
        order = np.argsort(which.astype(np.uint8 if buckets <= 256 else np.int32), kind="stable")
        sorted_table = table.take(pa.array(order))
        ws = which[order]
        edges = np.flatnonzero(np.diff(ws)) + 1
        starts = np.concatenate([[0], edges])
        ends = np.concatenate([edges, [len(ws)]])
        ids, blobs = [], []
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            ids.append(int(ws[s]))
            blobs.append(_ipc(sorted_table.slice(s, e - s)))
        yield pa.RecordBatch.from_arrays(
            [pa.array(ids, pa.int32()), pa.array(blobs, pa.binary())], schema=BUCKETS_SCHEMA
        )


@functools.lru_cache(maxsize=8)
def _region(geojson: str | None) -> Any:
    return parse_region(geojson) if geojson else None


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, CELLS_SCHEMA) as w:
        w.write_table(table)
    data: bytes = sink.getvalue().to_pybytes()
    return data


def join(rows: Iterable[pa.RecordBatch]) -> pa.Table:
    """The mapped pings of ``BUCKETS_SCHEMA`` rows, as one table."""
    parts = []
    for b in rows:
        for blob in b.column("cells").to_pylist():
            parts.append(pa.ipc.open_stream(pa.py_buffer(blob)).read_all())
    if not parts:
        return CELLS_SCHEMA.empty_table()
    return pa.concat_tables(parts)
