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

from roadlog.columnar import PingColumns
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
    n = len(cols)
    if n == 0:
        raise BatchRejected([BadPing(0, "the batch is empty")], 1)
    if n > MAX_BATCH_PINGS:
        raise BatchRejected([BadPing(MAX_BATCH_PINGS, f"more than {MAX_BATCH_PINGS} pings")], 1)
    reasons = np.zeros(n, dtype=np.int8)  # 0: fine; else an index into _REASONS

    def flag(mask: np.ndarray, code: int) -> None:
        reasons[(reasons == 0) & mask] = code

    ndev = len(cols.device_ids)
    flag(cols.device_index >= ndev, 1)
    bad_ids = np.array(
        [not (1 <= len(d.encode()) <= MAX_DEVICE_ID_BYTES) for d in cols.device_ids] + [False],
        dtype=bool,
    )
    flag(bad_ids[np.minimum(cols.device_index, ndev)], 2)
    lat, lon = cols.lat, cols.lon
    flag(~np.isfinite(lat) | (lat < -90) | (lat > 90), 3)
    flag(~np.isfinite(lon) | (lon < -180) | (lon > 180), 4)
    flag((cols.ts_ms < MIN_TS_MS) | (cols.ts_ms > now_ms + FUTURE_SLACK_MS), 5)
    sp = cols.speed_mps
    flag(~np.isnan(sp) & ((sp < 0) | (sp > MAX_SPEED_MPS) | ~np.isfinite(sp)), 6)
    hd = cols.heading_deg
    flag(~np.isnan(hd) & ((hd < 0) | (hd >= 360) | ~np.isfinite(hd)), 7)
    ac = cols.accuracy_m
    flag(~np.isnan(ac) & ((ac < 0) | (ac > MAX_ACCURACY_M) | ~np.isfinite(ac)), 8)
    ok = reasons == 0
    if ok.any():
        inside = np.ones(n, dtype=bool)
        inside[ok] = region.contains(lon[ok], lat[ok])
        flag(~inside, 9)
    bad = np.flatnonzero(reasons)
    if len(bad):
        shown = [BadPing(int(i), _REASONS[int(reasons[i])]) for i in bad[:MAX_REPORTED]]
        raise BatchRejected(shown, len(bad))


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
