"""Topic regions: GeoJSON Polygons (lon/lat order), validated and prepared
for vectorised point-in-polygon tests."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt
import shapely
from shapely.geometry import Polygon, shape

MAX_VERTICES = 10_000
# The GeoJSON text of a region, at most: 10,000 vertices at full precision
# are about 0.4 MB; more than this is refused before it is parsed.
MAX_REGION_BYTES = 2 << 20
MAX_AREA_KM2 = 250_000.0  # a metro region, generously; not a continent
KM_PER_DEGREE = 111.32


class RegionError(ValueError):
    """The region is not an acceptable GeoJSON Polygon; the message says why."""


@dataclass(frozen=True)
class Region:
    polygon: Polygon
    geojson: str  # normalised GeoJSON text

    @cached_property
    def bbox(self) -> tuple[float, float, float, float]:
        minx, miny, maxx, maxy = self.polygon.bounds
        return (float(minx), float(miny), float(maxx), float(maxy))

    @cached_property
    def is_box(self) -> bool:
        """Is the polygon an axis-aligned rectangle (a ``--bbox`` region)?"""
        minx, miny, maxx, maxy = self.bbox
        ring = [(float(x), float(y)) for x, y, *_ in self.polygon.exterior.coords[:-1]]
        corners = {(minx, miny), (maxx, miny), (maxx, maxy), (minx, maxy)}
        return not self.polygon.interiors and len(ring) == 4 and set(ring) == corners

    def contains(
        self, lon: npt.NDArray[np.float64], lat: npt.NDArray[np.float64]
    ) -> npt.NDArray[np.bool_]:
        """Vectorised: is each (lon, lat) inside or on the boundary? A
        rectangle is four comparisons (about 100 times faster than shapely);
        any other polygon asks shapely."""
        if self.is_box:
            minx, miny, maxx, maxy = self.bbox
            return (lon >= minx) & (lon <= maxx) & (lat >= miny) & (lat <= maxy)
        return np.asarray(shapely.intersects_xy(self.polygon, lon, lat), dtype=bool)

    def area_km2(self) -> float:
        return approx_area_km2(self.polygon)


def approx_area_km2(poly: Polygon) -> float:
    """Area on a local equirectangular projection: good to a few percent
    for city-sized regions."""
    lat0 = math.radians((poly.bounds[1] + poly.bounds[3]) / 2)
    return float(poly.area) * KM_PER_DEGREE**2 * math.cos(lat0)


def parse_region(text: str | dict[str, Any]) -> Region:
    """Validate a GeoJSON Polygon (or a Feature holding one). Cheap checks
    come first: the text's size before parsing it, the vertex count before
    walking the vertices."""
    if isinstance(text, str) and len(text) > MAX_REGION_BYTES:
        raise RegionError(f"region is {len(text)} bytes of GeoJSON; at most {MAX_REGION_BYTES}")
    try:
        obj = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError as e:
        raise RegionError(f"region is not JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(obj, dict):
        raise RegionError("region must be a GeoJSON object")
    if obj.get("type") == "Feature":
        obj = obj.get("geometry") or {}
    if obj.get("type") == "FeatureCollection":
        feats = obj.get("features") or []
        if len(feats) != 1:
            raise RegionError("a FeatureCollection region must hold exactly one Polygon feature")
        obj = feats[0].get("geometry") or {}
    if obj.get("type") != "Polygon":
        raise RegionError(f"region must be a GeoJSON Polygon, not {obj.get('type')!r}")
    rings = obj.get("coordinates")
    if not isinstance(rings, list) or not rings:
        raise RegionError("a Polygon needs a list of linear rings")
    vertices = sum(len(ring) if isinstance(ring, list) else 0 for ring in rings)
    if vertices > MAX_VERTICES:
        raise RegionError(f"region has {vertices} vertices; at most {MAX_VERTICES}")
    for ring in rings:
        if not isinstance(ring, list) or len(ring) < 4:
            raise RegionError("each ring needs at least 4 positions (closed)")
        for pos in ring:
            if (
                not isinstance(pos, list | tuple)
                or len(pos) < 2
                or not all(isinstance(c, int | float) and math.isfinite(c) for c in pos[:2])
            ):
                raise RegionError(f"bad position {pos!r}: need [lon, lat] numbers")
            lon, lat = pos[0], pos[1]
            if not (-180 <= lon <= 180 and -90 <= lat <= 90):
                raise RegionError(
                    f"position {pos!r} is out of range (lon/lat order: lon in [-180, 180])"
                )
        if list(ring[0][:2]) != list(ring[-1][:2]):
            raise RegionError("each ring must be closed: first and last positions equal")
    try:
        poly = shape(obj)
    except Exception as e:
        raise RegionError(f"region is not a polygon: {e}") from None
    if not poly.is_valid:
        reason = shapely.is_valid_reason(poly)
        raise RegionError(f"region is not a valid polygon: {reason}")
    if poly.area <= 0:
        raise RegionError("region has no area")
    area = approx_area_km2(poly)
    if area > MAX_AREA_KM2:
        raise RegionError(f"region covers about {area:,.0f} km²; at most {MAX_AREA_KM2:,.0f}")
    shapely.prepare(poly)
    return Region(
        poly, json.dumps({"type": "Polygon", "coordinates": rings}, separators=(",", ":"))
    )


def bbox_region(min_lon: float, min_lat: float, max_lon: float, max_lat: float) -> Region:
    """A rectangular region from a bounding box."""
    if not (min_lon < max_lon and min_lat < max_lat):
        raise RegionError("bbox must be MINLON,MINLAT,MAXLON,MAXLAT with min < max")
    ring = [
        [min_lon, min_lat],
        [max_lon, min_lat],
        [max_lon, max_lat],
        [min_lon, max_lat],
        [min_lon, min_lat],
    ]
    return parse_region({"type": "Polygon", "coordinates": [ring]})
