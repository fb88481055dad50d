"""The heat map's aggregation in Arrow and numpy, in two steps that Spark
runs on either side of one shuffle (spark/jobs/heatmap.py):

1. ``cell_partials``: the mapped pings of some cells, *all* the pings of
   each (the rows were partitioned by cell): per cell with pings in the
   window its count, distinct devices and mean speed, and its free-flow
   percentile over every ping it has (exact: the speed of rank
   ``ceil(q * n)``, as Spark's ``percentile_approx`` gives on small data);
   and one row of the task's speed histogram (``region_hist``), which sums
   across tasks.
2. ``finish``: the rows of every task: the region's percentile from the
   summed histograms, the floor it sets, free-flow and congestion.

The region's percentile is the histogram's: bins of ``1 / BINS_PER_MPS``
m/s from 0 (the bin's lower edge is the answer), speeds at or above
``MAX_MPS`` in the last bin and below 0 in the first. **Its stated error:
less than 1/16 m/s (0.225 km/h) below the exact percentile, and none for
speeds that are multiples of 1/16 m/s**; speeds above 100 m/s count as
100. The histogram merges by addition, so any split of the pings gives the
same answer.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc

QUANTILE = 0.85
BINS_PER_MPS = 16
MAX_MPS = 100
N_BINS = MAX_MPS * BINS_PER_MPS + 1

CELLS_SCHEMA = pa.schema(
    [("h3", pa.int64()), ("device_id", pa.string()), ("now", pa.bool_()), ("speed", pa.float32())]
)
PARTIALS_SCHEMA = pa.schema(
    [
        ("h3", pa.int64()),
        ("pings", pa.int64()),
        ("devices", pa.int64()),
        ("mean_speed_mps", pa.float64()),
        ("cell_free_mps", pa.float32()),
        ("region_hist", pa.list_(pa.int64())),
    ]
)
PARTIALS_DDL = (
    "h3 long, pings long, devices long, mean_speed_mps double, cell_free_mps float, "
    "region_hist array<long>"
)
OUT_SCHEMA = pa.schema(
    [
        ("h3", pa.int64()),
        ("pings", pa.int64()),
        ("devices", pa.int64()),
        ("mean_speed_mps", pa.float64()),
        ("free_flow_mps", pa.float64()),
        ("congestion", pa.float64()),
    ]
)

F64 = npt.NDArray[np.float64]


def speed_histogram(speeds: npt.NDArray[Any]) -> npt.NDArray[np.int64]:
    """Counts of the known (not NaN) speeds in the ``N_BINS`` bins."""
    s = speeds[~np.isnan(speeds)]
    k = np.clip(np.floor(s.astype(np.float64) * BINS_PER_MPS), 0, N_BINS - 1).astype(np.int64)
    return np.bincount(k, minlength=N_BINS).astype(np.int64)


def histogram_quantile(hist: npt.NDArray[np.int64], q: float = QUANTILE) -> float | None:
    """The lower edge of the bin holding the speed of rank ``ceil(q * n)``;
    None for an empty histogram."""
    n = int(hist.sum())
    if n == 0:
        return None
    rank = max(1, math.ceil(q * n))
    return float(np.searchsorted(np.cumsum(hist), rank)) / BINS_PER_MPS


def cell_partials(table: pa.Table, q: float = QUANTILE) -> pa.RecordBatch | None:
    """Step 1 over every ping of some cells (``CELLS_SCHEMA``): a row per
    cell with pings in the window (``region_hist`` null), then one row of
    the speed histogram of all of them (every other column null). None
    for no pings."""
    if table.num_rows == 0:
        return None
    h = table.column("h3").to_numpy()
    sp = table.column("speed").to_numpy(zero_copy_only=False)  # nulls -> NaN
    known = ~np.isnan(sp)
    hk, sk = h[known], sp[known]
    order = np.lexsort((sk, hk))
    hk, sk = hk[order], sk[order]
    free_cells, first, counts = np.unique(hk, return_index=True, return_counts=True)
    ranks = np.maximum(1, np.ceil(q * counts.astype(np.float64)).astype(np.int64))
    free = sk[first + ranks - 1]

    now = table.filter(table.column("now"))
    speed64 = pc.cast(now.column("speed"), pa.float64())
    g = (
        pa.table({"h3": now.column("h3"), "device_id": now.column("device_id"), "s": speed64})
        .group_by("h3")
        .aggregate([("h3", "count"), ("device_id", "count_distinct"), ("s", "sum"), ("s", "count")])
    )
    cells = g.column("h3").to_numpy()
    s_sum = g.column("s_sum").to_numpy(zero_copy_only=False)
    s_n = g.column("s_count").to_numpy()
    mean = np.where(s_n > 0, s_sum / np.maximum(s_n, 1), np.nan)
    at = np.searchsorted(free_cells, cells)
    found = at < len(free_cells)
    found[found] = free_cells[at[found]] == cells[found]
    cell_free = np.full(len(cells), np.nan, dtype=np.float32)
    cell_free[found] = free[at[found]]
    hist = speed_histogram(sp)
    n = len(cells)
    nulls = pa.nulls(1, pa.int64())
    return pa.RecordBatch.from_arrays(
        [
            pa.concat_arrays([pa.array(cells, pa.int64()), nulls]),
            pa.concat_arrays([g.column("h3_count").combine_chunks(), nulls]),
            pa.concat_arrays([g.column("device_id_count_distinct").combine_chunks(), nulls]),
            pa.array(np.append(mean, np.nan), pa.float64(), from_pandas=True),
            pa.array(np.append(cell_free, np.float32(np.nan)), pa.float32(), from_pandas=True),
            pa.array([None] * n + [hist], pa.list_(pa.int64())),
        ],
        schema=PARTIALS_SCHEMA,
    )


def finish(table: pa.Table, floor_share: float, q: float = QUANTILE) -> pa.RecordBatch:
    """Step 2 over the partials of every task: a row per cell
    (``OUT_SCHEMA``). free-flow = max(the cell's percentile, ``floor_share``
    x the region's), either alone where the other is unknown; congestion =
    1 - mean / free-flow clipped to [0, 1] where free-flow > 0 (1 where the
    mean is unknown: as the Spark expressions before, whose ``least`` and
    ``greatest`` skip nulls)."""
    is_region = pc.is_valid(table.column("region_hist"))
    regions = table.filter(is_region).column("region_hist").combine_chunks()
    hist = np.zeros(N_BINS, dtype=np.int64)
    if len(regions):
        hist = regions.flatten().to_numpy().reshape(-1, N_BINS).sum(axis=0)
    region = histogram_quantile(hist, q)
    cells = table.filter(pc.invert(is_region))
    mean = cells.column("mean_speed_mps").to_numpy(zero_copy_only=False)
    cell_free = cells.column("cell_free_mps").to_numpy(zero_copy_only=False).astype(np.float64)
    floor = np.nan if region is None else region * floor_share
    free = np.fmax(cell_free, floor)
    c = np.clip(1 - mean / np.where(free > 0, free, np.nan), 0, 1)
    c = np.where(np.isnan(mean), 1.0, c)
    congestion = np.where(free > 0, c, np.nan)
    return pa.RecordBatch.from_arrays(
        [
            cells.column("h3").combine_chunks(),
            cells.column("pings").combine_chunks(),
            cells.column("devices").combine_chunks(),
            pa.array(mean, pa.float64(), from_pandas=True),
            pa.array(free, pa.float64(), from_pandas=True),
            pa.array(congestion, pa.float64(), from_pandas=True),
        ],
        schema=OUT_SCHEMA,
    )
