"""The heat map's Arrow aggregation (spark/cell_stats.py) against a plain
Python reference: cell figures exact, the region's percentile within its
stated error, and any split of the cells over tasks the same answer."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from spark.cell_stats import (
    BINS_PER_MPS,
    CELLS_SCHEMA,
    N_BINS,
    PARTIALS_SCHEMA,
    cell_partials,
    finish,
    histogram_quantile,
    speed_histogram,
)

pytestmark = pytest.mark.unit


def exact_quantile(xs: list[float], q: float = 0.85) -> float:
    s = sorted(xs)
    return s[max(1, math.ceil(q * len(s))) - 1]


def test_histogram_quantile_is_exact_on_sixteenths_and_within_a_bin_otherwise() -> None:
    rng = np.random.default_rng(5)
    quarters = rng.integers(0, 120, 5000) / 4.0
    hist = speed_histogram(quarters)
    assert hist.sum() == 5000 and len(hist) == N_BINS
    assert histogram_quantile(hist) == exact_quantile(list(quarters))
    floats = rng.uniform(0, 40, 5001)
    got = histogram_quantile(speed_histogram(floats))
    want = exact_quantile(list(floats))
    assert got is not None and 0 <= want - got < 1 / BINS_PER_MPS


def test_histogram_ignores_unknown_speeds_and_clips() -> None:
    hist = speed_histogram(np.array([np.nan, -3.0, 250.0, 1.0], dtype=np.float32))
    assert hist.sum() == 3 and hist[0] == 1 and hist[-1] == 1
    assert histogram_quantile(speed_histogram(np.array([np.nan]))) is None


def pings(seed: int, n: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    speed = rng.integers(0, 80, n) / 4.0
    unknown = rng.random(n) < 0.1
    return pa.Table.from_arrays(
        [
            pa.array(rng.integers(1, 40, n), pa.int64()),
            pa.array([f"d{x}" for x in rng.integers(0, 12, n)]),
            pa.array(rng.random(n) < 0.6),
            pa.array(speed.astype(np.float32), pa.float32(), mask=unknown),
        ],
        schema=CELLS_SCHEMA,
    )


def reference(t: pa.Table) -> dict[int, dict[str, Any]]:
    rows = t.to_pylist()
    known = [r["speed"] for r in rows if r["speed"] is not None]
    region = exact_quantile(known) * 0.8
    out = {}
    for c in {r["h3"] for r in rows if r["now"]}:
        mine = [r for r in rows if r["h3"] == c]
        now = [r for r in mine if r["now"]]
        sp = [r["speed"] for r in now if r["speed"] is not None]
        hist = [r["speed"] for r in mine if r["speed"] is not None]
        free = max(exact_quantile(hist), region) if hist else region
        mean = sum(sp) / len(sp) if sp else None
        cong = 1.0 if mean is None else min(1.0, max(0.0, 1 - mean / free))
        out[c] = {"pings": len(now), "devices": len({r["device_id"] for r in now}),
                  "mean_speed_mps": mean, "free_flow_mps": free, "congestion": cong}  # fmt: skip
    return out


@pytest.mark.parametrize("tasks", [1, 3])
def test_partials_then_finish_equal_the_reference_for_any_split_by_cell(tasks: int) -> None:
    t = pings(44, 3000)
    h = t.column("h3").to_numpy()
    parts = [cell_partials(t.filter(pa.array(h % tasks == k))) for k in range(tasks)]
    merged = pa.Table.from_batches([p for p in parts if p is not None], schema=PARTIALS_SCHEMA)
    got = {r["h3"]: r for r in finish(merged, 0.8).to_pylist()}
    want = reference(t)
    assert set(got) == set(want) and len(want) > 30
    for c, w in want.items():
        g = got[c]
        assert (g["pings"], g["devices"]) == (w["pings"], w["devices"]), c
        assert g["mean_speed_mps"] == w["mean_speed_mps"], c  # exact: quarter sums
        assert g["free_flow_mps"] == pytest.approx(w["free_flow_mps"], abs=1 / BINS_PER_MPS), c
        assert g["congestion"] == pytest.approx(w["congestion"], abs=1e-9), c


def test_no_pings_give_no_partials_and_no_cells() -> None:
    assert cell_partials(CELLS_SCHEMA.empty_table()) is None
    assert finish(PARTIALS_SCHEMA.empty_table(), 0.8).num_rows == 0
