"""Regions and ping validation: clear reasons, nothing silently dropped."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import shapely

from roadlog.columnar import PingColumns
from roadlog.geo import MAX_REGION_BYTES, MAX_VERTICES, RegionError, bbox_region, parse_region
from roadlog.validation import BatchRejected, check_batch, check_topic_name

pytestmark = pytest.mark.unit

MUNICH = bbox_region(11.4, 48.05, 11.75, 48.25)
NOW = 1_800_000_000_000


def poly(*ring: list[float]) -> str:
    return json.dumps({"type": "Polygon", "coordinates": [list(ring)]})


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("not json", "not JSON"),
        ('{"type": "Point", "coordinates": [1, 2]}', "must be a GeoJSON Polygon"),
        (poly([0, 0], [1, 0], [1, 1]), "at least 4 positions"),
        (poly([0, 0], [1, 0], [1, 1], [0, 1]), "closed"),
        (poly([0, 0], [1, 0], [0, 1], [1, 1], [0, 0]), "not a valid polygon"),
        (poly([0, 100], [1, 100], [1, 101], [0, 100]), "out of range"),
        (poly([0, 0], [20, 0], [20, 20], [0, 0]), "at most"),
        (poly([0, 0], ["a", 0], [1, 1], [0, 0]), "bad position"),  # type: ignore[list-item]
    ],
)
def test_bad_regions_are_refused_with_a_reason(text: str, reason: str) -> None:
    with pytest.raises(RegionError, match=reason):
        parse_region(text)


def test_a_feature_wrapping_a_polygon_is_accepted() -> None:
    feat = {"type": "Feature", "geometry": json.loads(MUNICH.geojson), "properties": {}}
    r = parse_region(json.dumps(feat))
    assert r.bbox == pytest.approx((11.4, 48.05, 11.75, 48.25))
    assert 300 < r.area_km2() < 700


def test_contains_is_vectorised() -> None:
    inside = MUNICH.contains(np.array([11.5, 12.0]), np.array([48.1, 48.1]))
    assert inside.tolist() == [True, False]


@pytest.mark.parametrize(
    ("text", "box"),
    [
        (MUNICH.geojson, True),
        ('{"type":"Polygon","coordinates":[[[0,0],[1,0],[1,1],[0,0]]]}', False),
        ('{"type":"Polygon","coordinates":[[[0,0],[2,0],[2,2],[1,2.5],[0,2],[0,0]]]}', False),
        (
            '{"type":"Polygon","coordinates":[[[0,0],[3,0],[3,3],[0,3],[0,0]],'
            "[[1,1],[2,1],[2,2],[1,2],[1,1]]]}",
            False,
        ),
    ],
)
def test_contains_agrees_with_shapely_on_boxes_and_other_shapes(text: str, box: bool) -> None:
    region = parse_region(text)
    assert region.is_box is box
    minx, miny, maxx, maxy = region.bbox
    rng = np.random.default_rng(7)
    lon = rng.uniform(minx - 0.5, maxx + 0.5, 2000)
    lat = rng.uniform(miny - 0.5, maxy + 0.5, 2000)
    lon[:4], lat[:4] = [minx, maxx, minx, maxx], [miny, maxy, maxy, miny]  # the corners
    want = shapely.intersects_xy(region.polygon, lon, lat)
    assert np.array_equal(region.contains(lon, lat), want)
    assert 0 < want.sum() < len(want)


def good(n: int = 4) -> dict[str, list[object]]:
    return {
        "device_id": [f"d{i}" for i in range(n)],
        "ts_ms": [NOW - 1000] * n,
        "lat": [48.1] * n,
        "lon": [11.5] * n,
        "speed_mps": [10.0] * n,
    }


def test_a_good_batch_passes() -> None:
    check_batch(PingColumns.from_columns(**good()), MUNICH, NOW)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("lat", float("nan"), "latitude"),
        ("lat", 91.0, "latitude"),
        ("lon", -181.0, "longitude"),
        ("ts_ms", 5, "timestamp"),
        ("ts_ms", NOW + 10**10, "timestamp"),
        ("speed_mps", -1.0, "speed"),
        ("lon", 12.5, "outside the topic's region"),
        ("device_id", "x" * 65, "device id"),
        ("device_id", "", "device id"),
    ],
)
def test_each_bad_ping_is_reported_by_index(field: str, value: object, reason: str) -> None:
    rows = good()
    rows[field][2] = value
    with pytest.raises(BatchRejected) as e:
        check_batch(PingColumns.from_columns(**rows), MUNICH, NOW)  # type: ignore[arg-type]
    assert [(b.index, reason in b.reason) for b in e.value.bad] == [(2, True)]


def test_an_empty_batch_is_refused() -> None:
    with pytest.raises(BatchRejected, match="empty"):
        check_batch(PingColumns.from_columns([], [], [], []), MUNICH, NOW)


@pytest.mark.parametrize("name", ["munich", "city.berlin-2", "a"])
def test_good_topic_names(name: str) -> None:
    check_topic_name(name)


@pytest.mark.parametrize("name", ["", "Munich", "-x", "a" * 64, "a b", "ü"])
def test_bad_topic_names(name: str) -> None:
    with pytest.raises(ValueError, match="bad topic name"):
        check_topic_name(name)


def test_an_oversized_region_is_refused_before_it_is_parsed() -> None:
    """Issue 19, finding 9: parse_region walked every vertex of a 28.6 MB
    region before checking the limit."""
    huge = " " * (MAX_REGION_BYTES + 1)  # not even JSON: its size alone refuses it
    with pytest.raises(RegionError, match="bytes of GeoJSON; at most"):
        parse_region(huge)


def test_too_many_vertices_are_refused_before_any_vertex_is_walked() -> None:
    ring: list[Any] = [[11.5 + i * 1e-6, 48.1] for i in range(MAX_VERTICES + 5)]
    ring[-1] = "not a position"  # a walk would report this; the count comes first
    with pytest.raises(RegionError, match=f"vertices; at most {MAX_VERTICES}"):
        parse_region({"type": "Polygon", "coordinates": [ring]})
