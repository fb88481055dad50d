"""Vectorised checks of ping batches and topic specs.

Policy: a batch with any bad ping is refused whole, with the index and the
reason of each bad ping (up to ``MAX_REPORTED``); nothing of it is stored.
So a producer's retry after fixing its data keeps its order and its
sequence numbers, and no ping is ever dropped silently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from roadlog.columnar import PingColumns, is_unknown
from roadlog.geo import Region

MAX_REPORTED = 100
MAX_BATCH_PINGS = 100_000
MIN_TS_MS = 946_684_800_000  # 2000-01-01
FUTURE_SLACK_MS = 24 * 3600 * 1000
MAX_SPEED_MPS = 150.0
MAX_ACCURACY_M = 100_000.0
MAX_DEVICE_ID_BYTES = 64
TOPIC_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
MAX_PARTITIONS = 256
H3_RESOLUTIONS = range(0, 16)


@dataclass(frozen=True)
class BadPing:
    index: int
    reason: str


class BatchRejected(ValueError):
    """The batch was refused whole; ``bad`` lists the pings at fault."""

    def __init__(self, bad: list[BadPing], total_bad: int) -> None:
        shown = ", ".join(f"#{b.index}: {b.reason}" for b in bad[:5])
        more = f" (and {total_bad - 5} more)" if total_bad > 5 else ""
        super().__init__(f"{total_bad} bad ping(s), batch refused: {shown}{more}")
        self.bad = bad
        self.total_bad = total_bad


def check_batch(cols: PingColumns, region: Region, now_ms: int) -> None:
    """Raise BatchRejected unless every ping is plausible and in ``region``."""
    check_size(len(cols))
    raise_if_bad(ping_reasons(cols, region, now_ms))


def check_size(n: int) -> None:
    if n == 0:
        raise BatchRejected([BadPing(0, "the batch is empty")], 1)
    if n > MAX_BATCH_PINGS:
        raise BatchRejected([BadPing(MAX_BATCH_PINGS, f"more than {MAX_BATCH_PINGS} pings")], 1)


def raise_if_bad(reasons: npt.NDArray[np.int8]) -> None:
    """Raise BatchRejected for a batch whose ``ping_reasons`` are these."""
    bad = np.flatnonzero(reasons)
    if len(bad):
        shown = [BadPing(int(i), _REASONS[int(reasons[i])]) for i in bad[:MAX_REPORTED]]
        raise BatchRejected(shown, len(bad))


def ping_reasons(
    cols: PingColumns, region: Region, now_ms: int, ids_ok: bool | None = None
) -> npt.NDArray[np.int8]:
    """Per ping, 0 if it is plausible and inside ``region``, else the code of
    the first rule it breaks (vectorised; also over several requests' pings
    concatenated, whose results the caller slices back per request).
    ``ids_ok``: whether every dictionary id is known to be 1..64 bytes of
    UTF-8 (None: checked here). A batch that breaks none of the rules before
    the region's (the usual case) is recognised from a few reductions per
    column; only one that may break some is looked at ping by ping."""
    if ids_ok is None:
        ids_ok = all(1 <= len(d.encode()) <= MAX_DEVICE_ID_BYTES for d in cols.device_ids)
    if ids_ok and len(cols):
        reasons = _plausible(cols, region, now_ms)
        if reasons is not None:
            return reasons
    return _reasons(cols, region, now_ms)


def _plausible(cols: PingColumns, region: Region, now_ms: int) -> npt.NDArray[np.int8] | None:
    """The reasons of a non-empty batch none of whose pings breaks rules 1
    and 3..8, or None if some may. A few min/max reductions per column: NaN
    fails a required column's range (the comparisons with a NaN minimum or
    maximum are False) and is unknown, so fine, in an optional one."""
    if not cols.device_index.max() < len(cols.device_ids):
        return None
    lat, lon, ts = cols.lat, cols.lon, cols.ts_ms
    lat_lo, lat_hi, lon_lo, lon_hi = lat.min(), lat.max(), lon.min(), lon.max()
    if not (lat_lo >= -90 and lat_hi <= 90 and lon_lo >= -180 and lon_hi <= 180):
        return None
    if not (ts.min() >= MIN_TS_MS and ts.max() <= now_ms + FUTURE_SLACK_MS):
        return None
    for arr, top in (
        (cols.speed_mps, MAX_SPEED_MPS),
        (cols.heading_deg, None),
        (cols.accuracy_m, MAX_ACCURACY_M),
    ):
        if is_unknown(arr):
            continue
        lo, hi = arr.min(), arr.max()
        if lo != lo:  # NaN: some unknown, so the known ones' range
            lo, hi = np.fmin.reduce(arr), np.fmax.reduce(arr)
        if lo < 0 or (hi >= 360 if top is None else hi > top):
            return None
    if region.is_box:
        minx, miny, maxx, maxy = region.bbox
        if minx <= lon_lo and lon_hi <= maxx and miny <= lat_lo and lat_hi <= maxy:
            return np.zeros(len(ts), dtype=np.int8)
    return np.where(region.contains(lon, lat), 0, 9).astype(np.int8)


def _reasons(cols: PingColumns, region: Region, now_ms: int) -> npt.NDArray[np.int8]:
    """``ping_reasons`` ping by ping."""
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


_REASONS = [
    "",
    "device index out of range",
    f"device id must be 1..{MAX_DEVICE_ID_BYTES} bytes",
    "latitude must be a number in [-90, 90]",
    "longitude must be a number in [-180, 180]",
    "timestamp is before 2000 or more than a day in the future",
    f"speed must be in [0, {MAX_SPEED_MPS:g}] m/s",
    "heading must be in [0, 360) degrees",
    f"accuracy must be in [0, {MAX_ACCURACY_M:g}] m",
    "outside the topic's region",
]


def check_topic_name(name: str) -> None:
    if not TOPIC_NAME.match(name):
        raise ValueError(
            f"bad topic name {name!r}: lower-case letters, digits, '.', '_' or '-', "
            "1..63 characters, starting with a letter or digit"
        )
