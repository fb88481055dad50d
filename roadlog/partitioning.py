"""Which partition a device's pings go to: the same one, always.

CRC-32 of the device id's UTF-8 bytes, modulo the partition count. Computed
once per distinct device of a batch, then spread to the pings by index.
"""

from __future__ import annotations

import zlib

import numpy as np
import numpy.typing as npt

from roadlog.columnar import PingColumns


def partition_of(device_id: str, partitions: int) -> int:
    return zlib.crc32(device_id.encode()) % partitions


def split_by_partition(cols: PingColumns, partitions: int) -> list[tuple[int, PingColumns]]:
    """The batch's pings grouped by partition, each group in sending order."""
    per_device = np.fromiter(
        (partition_of(d, partitions) for d in cols.device_ids),
        dtype=np.int64,
        count=len(cols.device_ids),
    )
    part = per_device[cols.device_index]
    order: npt.NDArray[np.intp] = np.argsort(part, kind="stable")
    bounds = np.flatnonzero(np.diff(part[order])) + 1
    out = []
    for idx in np.split(order, bounds):
        if len(idx):
            out.append((int(part[idx[0]]), cols.take(idx)))
    return out
