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
