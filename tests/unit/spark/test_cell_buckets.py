"""Mapping pings to cells and cutting them into buckets (spark/cell_buckets.py):
every ping inside the region comes back once, each cell in one bucket."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from roadlog.geo import bbox_region
from spark.cell_buckets import BUCKETS_SCHEMA, CellMapper, bucket_of, join
from spark.h3cells import cells_for

pytestmark = pytest.mark.unit

REGION = bbox_region(11.45, 48.08, 11.70, 48.20).geojson


def pings(n: int, seed: int) -> pa.RecordBatch:
    rng = np.random.default_rng(seed)
    lat = rng.uniform(48.0, 48.2, n)  # some south of the region
    lon = rng.uniform(11.5, 11.6, n)
    sp = rng.uniform(0, 20, n).astype(np.float32)
    sp[::7] = np.nan
    devices = pa.array([f"d{i % 50}" for i in range(n)]).dictionary_encode()
    return pa.RecordBatch.from_arrays(
        [devices, pa.array(1000 + np.arange(n)), pa.array(lat), pa.array(lon), pa.array(sp)],
        names=["device_id", "ts_ms", "lat", "lon", "speed_mps"],
    )


def test_every_ping_in_the_region_comes_back_once_each_cell_in_one_bucket() -> None:
    mapper = CellMapper(9, 1000, 1500, REGION)
    batches = [pings(2000, 1), pings(1000, 2)]
    rows = list(mapper.split(batches, 8))
    assert all(r.schema == BUCKETS_SCHEMA for r in rows)
    buckets = [int(b) for r in rows for b in r.column("bucket").to_pylist()]
    assert len(buckets) == len(set(buckets)) > 4  # one row a bucket
    per_bucket = [join([r.slice(i, 1)]) for r in rows for i in range(r.num_rows)]
    cells = [set(t.column("h3").to_pylist()) for t in per_bucket]
    assert all(not (a & b) for i, a in enumerate(cells) for b in cells[i + 1 :])
    back = join(rows)
    lat = np.concatenate([b.column("lat").to_numpy() for b in batches])
    lon = np.concatenate([b.column("lon").to_numpy() for b in batches])
    inside = (lat >= 48.08) & (lat <= 48.20)
    assert back.num_rows == int(inside.sum()) < len(lat)
    want = sorted(cells_for(lat[inside], lon[inside], 9).astype(np.int64).tolist())
    assert sorted(back.column("h3").to_pylist()) == want
    ts = np.concatenate([b.column("ts_ms").to_numpy() for b in batches])[inside]
    assert back.column("now").to_numpy(zero_copy_only=False).sum() == int(
        ((ts >= 1000) & (ts < 1500)).sum()
    )
    assert back.column("speed").null_count > 0  # unknown speeds are nulls, not NaN
    assert back.column("device_id").type == pa.string()


def test_no_pings_give_no_buckets_and_buckets_spread() -> None:
    assert list(CellMapper(9, 0, 1).split([], 8)) == []
    assert join([]).num_rows == 0
    h = cells_for(np.linspace(48.08, 48.2, 500), np.linspace(11.45, 11.7, 500), 9).astype(np.int64)
    assert len(set(bucket_of(h, 8).tolist())) == 8  # the low bits of H3 indexes are all alike
