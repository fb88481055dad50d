"""The heat-map transform on small frames (one local[2] SparkSession for the
whole module): counting, distinct devices, speeds, the window, the region,
free-flow and congestion."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import h3
import pandas as pd
import pytest
from pyspark.sql import DataFrame, SparkSession

from roadlog.geo import bbox_region
from spark.jobs.heatmap import session, transform

pytestmark = pytest.mark.integration

REGION = bbox_region(11.4, 48.05, 11.75, 48.25).geojson
RES = 9
T = 1_800_000_000_000
A = (48.137, 11.575)  # Marienplatz
B = (48.150, 11.520)


@pytest.fixture(scope="module")
def spark() -> Iterator[SparkSession]:
    s = session("local[2]", "roadlog-transform-tests")
    yield s
    s.stop()


def frame(spark: SparkSession, rows: list[dict[str, Any]]) -> DataFrame:
    full = [
        {
            "partition": 0,
            "offset": i,
            "device_id": r.get("device_id", "car"),
            "ts_ms": r.get("ts_ms", T),
            "lat": r["lat"],
            "lon": r["lon"],
            "speed_mps": r.get("speed_mps", math.nan),
            "heading_deg": math.nan,
            "accuracy_m": math.nan,
            "append_ms": T,
        }
        for i, r in enumerate(rows)
    ]
    pdf = pd.DataFrame(full).astype(
        {
            "partition": "int32",
            "speed_mps": "float32",
            "heading_deg": "float32",
            "accuracy_m": "float32",
        }
    )
    from spark.roadlog_source import SCHEMA

    return spark.createDataFrame(pdf, schema=SCHEMA)


def result(df: DataFrame, start: int = T, end: int = T + 60_000) -> dict[str, dict[str, Any]]:
    rows = transform(df, RES, start, end, REGION).collect()
    return {h3.int_to_str(int(r["h3"])): r.asDict() for r in rows}


def cell(p: tuple[float, float]) -> str:
    return str(h3.latlng_to_cell(p[0], p[1], RES))


def test_counts_devices_and_mean_speed_per_cell(spark: SparkSession) -> None:
    rows = [
        {"lat": A[0], "lon": A[1], "device_id": "a", "speed_mps": 2.0},
        {"lat": A[0], "lon": A[1], "device_id": "a", "speed_mps": 4.0},
        {"lat": A[0], "lon": A[1], "device_id": "b"},  # speed unknown: a ping, not a speed
        {"lat": B[0], "lon": B[1], "device_id": "c", "speed_mps": 12.0},
    ]
    r = result(frame(spark, rows))
    assert set(r) == {cell(A), cell(B)}
    a = r[cell(A)]
    assert (a["pings"], a["devices"], a["mean_speed_mps"]) == (3, 2, pytest.approx(3.0))
    assert r[cell(B)]["pings"] == 1


def test_only_the_window_is_counted_but_history_sets_free_flow(spark: SparkSession) -> None:
    history = [
        {"lat": A[0], "lon": A[1], "ts_ms": T - 3_600_000 + i, "speed_mps": 10.0} for i in range(20)
    ]
    now = [{"lat": A[0], "lon": A[1], "ts_ms": T + 5, "speed_mps": 2.0}]
    later = [{"lat": A[0], "lon": A[1], "ts_ms": T + 120_000, "speed_mps": 2.0}]
    r = result(frame(spark, history + now + later))
    a = r[cell(A)]
    assert a["pings"] == 1  # neither the history nor the ping after the window
    assert a["free_flow_mps"] == pytest.approx(10.0)
    assert a["congestion"] == pytest.approx(0.8)  # 1 - 2 / 10


def test_pings_outside_the_region_are_not_counted(spark: SparkSession) -> None:
    rows = [
        {"lat": A[0], "lon": A[1]},
        {"lat": 52.52, "lon": 13.40},  # Berlin
    ]
    assert set(result(frame(spark, rows))) == {cell(A)}


def test_congestion_is_clipped_and_empty_input_gives_no_cells(spark: SparkSession) -> None:
    rows = [
        {"lat": A[0], "lon": A[1], "ts_ms": T - 1000, "speed_mps": 5.0},
        {"lat": A[0], "lon": A[1], "ts_ms": T + 1, "speed_mps": 9.0},  # faster than free flow
    ]
    a = result(frame(spark, rows))[cell(A)]
    assert a["congestion"] == pytest.approx(0.0)
    assert result(frame(spark, rows), T + 10**9, T + 10**9 + 1) == {}


EXACT = 1_000_000


def transform_before(df: DataFrame, resolution: int, start: int, end: int, region: str) -> Any:
    """The transform as it was before issue 44: H3 appended to rows of every
    column, the aggregations on those (three passes over ``df``), its
    percentiles made exact; the reference the one-pass transform must equal
    cell by cell."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType, StructField, StructType

    from roadlog.geo import parse_region
    from spark.h3cells import cells_for

    shape = parse_region(region)
    schema = StructType([*df.schema.fields, StructField("h3", LongType())])

    def add(batches: Iterator[Any]) -> Iterator[Any]:
        import numpy as np
        import pyarrow as pa

        for b in batches:
            lat = b.column("lat").to_numpy(zero_copy_only=False)
            lon = b.column("lon").to_numpy(zero_copy_only=False)
            inside = shape.contains(lon, lat)
            b, lat, lon = b.filter(pa.array(inside)), lat[inside], lon[inside]
            if b.num_rows:
                yield b.append_column(
                    "h3", pa.array(cells_for(lat, lon, resolution).astype(np.int64))
                )

    cells = df.mapInArrow(add, schema)
    speed = F.when(~F.isnan("speed_mps"), F.col("speed_mps"))
    now = cells.filter((F.col("ts_ms") >= start) & (F.col("ts_ms") < end))
    current = now.groupBy("h3").agg(
        F.count(F.lit(1)).alias("pings"),
        F.countDistinct("device_id").alias("devices"),
        F.avg(speed).alias("mean_speed_mps"),
    )
    # Accuracy 10^6: exact for fewer speeds than that (the job's was 1000, whose
    # error is up to a thousandth of the ranks: 3.5 of the region's 3,500 here).
    history = cells.groupBy("h3").agg(F.percentile_approx(speed, 0.85, EXACT).alias("cell"))
    regional = cells.agg(F.percentile_approx(speed, 0.85, EXACT).alias("region"))
    history = history.crossJoin(regional).select(
        "h3", F.greatest(F.col("cell"), F.col("region") * 0.8).alias("free_flow_mps")
    )
    return current.join(history, "h3", "left")


def test_the_transform_gives_the_same_cells_as_before(spark: SparkSession) -> None:
    """A fixed set of pings (seeded): 40 devices, speeds in quarter metres a
    second (sums exact in any order), some unknown, some before the window,
    some outside the region: counts, devices and mean speed equal exactly;
    the free-flow speed too (fewer speeds a cell than the percentile's
    accuracy: percentile_approx is then exact), within the stated error of
    the region's histogram (spark/cell_stats.py: under 1/16 m/s, none for
    quarters)."""
    import numpy as np

    rng = np.random.default_rng(44)
    n = 4000
    speeds = rng.integers(0, 80, n) / 4.0
    speeds[rng.random(n) < 0.1] = math.nan
    rows = [
        {
            "lat": float(48.13 + rng.integers(0, 30) * 0.002),
            "lon": float(11.55 + rng.integers(0, 30) * 0.002) if i % 97 else 13.40,  # Berlin
            "device_id": f"dev-{rng.integers(0, 40)}",
            "ts_ms": int(T - 3_600_000 + rng.integers(0, 3_660_000)),  # an hour before to 1 min
            "speed_mps": float(speeds[i]),
        }
        for i in range(n)
    ]
    df = frame(spark, rows)
    end = T + 60_000
    got = result(df, T, end)
    before = {
        h3.int_to_str(int(r["h3"])): r.asDict()
        for r in transform_before(df, RES, T, end, REGION).collect()
    }
    assert len(got) > 50 and set(got) == set(before)
    for c, b in before.items():
        g = got[c]
        assert (g["pings"], g["devices"]) == (b["pings"], b["devices"]), c
        if b["mean_speed_mps"] is None:
            assert g["mean_speed_mps"] is None
        else:
            assert g["mean_speed_mps"] == b["mean_speed_mps"], c  # exact: quarter m/s sums
        assert g["free_flow_mps"] == pytest.approx(b["free_flow_mps"], abs=1 / 16), c
