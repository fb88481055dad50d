"""Synthetic traffic: vehicles driving a street grid inside a region, slow
around hot spots. Generated faster than real time, as columnar batches."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from roadlog.columnar import PingColumns
from roadlog.geo import Region

M_PER_DEG_LAT = 111_320.0


@dataclass(frozen=True)
class TrafficSpec:
    vehicles: int
    duration_s: int
    end_ms: int  # the last ping's time
    hotspots: tuple[tuple[float, float], ...] = ()  # (lon, lat)
    block_m: float = 250.0
    free_speed_mps: float = 14.0
    jam_speed_mps: float = 1.5
    jam_radius_m: float = 600.0
    ping_every_s: int = 1
    seed: int = 1
    # Traffic gathers where the jams are: this share of the vehicles starts
    # within two jam radii of a hot spot (the rest anywhere in the region).
    hot_share: float = 0.4


def simulate(region: Region, spec: TrafficSpec, chunk_s: int = 10) -> Iterator[PingColumns]:
    """Yield the pings of ``chunk_s`` simulated seconds at a time."""
    rng = np.random.default_rng(spec.seed)
    min_lon, min_lat, max_lon, max_lat = region.bbox
    lat0 = (min_lat + max_lat) / 2
    m_per_deg_lon = M_PER_DEG_LAT * math.cos(math.radians(lat0))
    width = (max_lon - min_lon) * m_per_deg_lon
    height = (max_lat - min_lat) * M_PER_DEG_LAT
    block = spec.block_m
    nx, ny = max(int(width // block), 1), max(int(height // block), 1)
    n = spec.vehicles
    # Start on random intersections, heading along a random street.
    gx = rng.integers(0, nx + 1, n).astype(float)
    gy = rng.integers(0, ny + 1, n).astype(float)
    hs = np.array(
        [
            ((lon - min_lon) * m_per_deg_lon, (lat - min_lat) * M_PER_DEG_LAT)
            for lon, lat in spec.hotspots
        ]
    ).reshape(-1, 2)
    if len(hs):
        near = rng.random(n) < spec.hot_share
        k = int(near.sum())
        which = hs[rng.integers(0, len(hs), k)]
        reach = 2 * spec.jam_radius_m / block
        gx[near] = np.clip(np.round(which[:, 0] / block + rng.uniform(-reach, reach, k)), 0, nx)
        gy[near] = np.clip(np.round(which[:, 1] / block + rng.uniform(-reach, reach, k)), 0, ny)
    x, y = gx * block, gy * block
    dirs = np.array([[1, 0], [-1, 0], [0, 1], [0, -1]], dtype=float)
    d = rng.integers(0, 4, n)
    left = np.full(n, block)  # metres to the next intersection
    devices = [f"veh-{i:05d}" for i in range(n)]
    start_ms = spec.end_ms - (spec.duration_s - 1) * 1000
    buf: list[tuple[np.ndarray, ...]] = []
    for t in range(spec.duration_s):
        speed = spec.free_speed_mps * rng.uniform(0.8, 1.1, n)
        if len(hs):
            dist = np.min(np.hypot(x[:, None] - hs[:, 0], y[:, None] - hs[:, 1]), axis=1)
            jam = np.sqrt(
                np.clip(1 - dist / spec.jam_radius_m, 0, 1)
            )  # slow well before the centre
            speed = speed * (1 - jam) + spec.jam_speed_mps * rng.uniform(0.5, 1.5, n) * jam
        step = speed.copy()
        while True:  # move, turning at intersections
            cross = step >= left
            move = np.where(cross, left, step)
            x += dirs[d, 0] * move
            y += dirs[d, 1] * move
            step -= move
            left -= move
            if not cross.any():
                break
            turn = rng.integers(0, 4, n)
            nxt = np.where(cross, turn, d)
            # Stay inside: turn back at the edges of the grid.
            out_x = ((nxt == 0) & (x >= nx * block - 1e-6)) | ((nxt == 1) & (x <= 1e-6))
            out_y = ((nxt == 2) & (y >= ny * block - 1e-6)) | ((nxt == 3) & (y <= 1e-6))
            nxt = np.where(out_x, nxt ^ 1, nxt)
            nxt = np.where(out_y, nxt ^ 1, nxt)
            d = nxt
            left = np.where(cross, block, left)
            if not (step > 1e-9).any():
                break
        x = np.clip(x, 0, nx * block)
        y = np.clip(y, 0, ny * block)
        if t % spec.ping_every_s == 0:
            heading = np.array([90.0, 270.0, 0.0, 180.0])[d]
            buf.append(
                (
                    np.full(n, start_ms + t * 1000, dtype=np.int64),
                    y.copy(),
                    x.copy(),
                    speed,
                    heading,
                )
            )
        if len(buf) * spec.ping_every_s >= chunk_s or t == spec.duration_s - 1:
            yield _columns(buf, devices, region, min_lon, min_lat, m_per_deg_lon, rng)
            buf = []


def _columns(
    buf: list[tuple[np.ndarray, ...]],
    devices: list[str],
    region: Region,
    min_lon: float,
    min_lat: float,
    m_per_deg_lon: float,
    rng: np.random.Generator,
) -> PingColumns:
    ts = np.concatenate([b[0] for b in buf])
    lat = min_lat + np.concatenate([b[1] for b in buf]) / M_PER_DEG_LAT
    lon = min_lon + np.concatenate([b[2] for b in buf]) / m_per_deg_lon
    speed = np.concatenate([b[3] for b in buf]).astype(np.float32)
    heading = np.concatenate([b[4] for b in buf]).astype(np.float32)
    n = len(devices)
    idx = np.tile(np.arange(n, dtype=np.uint32), len(buf))
    lat = lat + rng.normal(0, 3, len(lat)) / M_PER_DEG_LAT  # GPS noise, ~3 m
    lon = lon + rng.normal(0, 3, len(lon)) / m_per_deg_lon
    inside = region.contains(lon, lat)
    keep = np.flatnonzero(inside)
    cols = PingColumns(
        devices,
        idx,
        ts,
        lat,
        lon,
        speed,
        heading,
        np.full(len(ts), 5.0, dtype=np.float32),
    )
    return cols.take(keep) if len(keep) < len(ts) else cols
