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


def device_partitions(cols: PingColumns, partitions: int) -> npt.NDArray[np.int64]:
    """The partition of each device in the batch's dictionary."""
    ndev = len(cols.device_ids)
    return np.fromiter(
        (partition_of(d, partitions) for d in cols.device_ids), dtype=np.int64, count=ndev
    )


def split_by_partition(
    cols: PingColumns, partitions: int, per_device: npt.NDArray[np.int64] | None = None
) -> list[tuple[int, PingColumns]]:
    """The batch's pings grouped by partition in ascending partition order,
    each group in sending order, each with the dictionary of just its own
    devices (all computed at once). Device indexes must be in range."""
    if per_device is None:
        per_device = device_partitions(cols, partitions)
    ndev = len(per_device)
    if ndev and (per_device == per_device[0]).all():
        return [(int(per_device[0]), cols)] if len(cols) else []
    # Each device's index within its own partition's dictionary.
    dev_order = np.argsort(per_device, kind="stable")
    sorted_parts = per_device[dev_order]
    rank = np.empty(ndev, dtype=np.uint32)
    rank[dev_order] = np.arange(ndev) - np.searchsorted(sorted_parts, sorted_parts, side="left")
    part = per_device[cols.device_index]
    order: npt.NDArray[np.intp] = np.argsort(part, kind="stable")
    bounds = np.flatnonzero(np.diff(part[order])) + 1
    out = []
    for idx in np.split(order, bounds):
        if not len(idx):
            continue
        p = int(part[idx[0]])
        devices = dev_order[sorted_parts == p]
        out.append(
            (
                p,
                PingColumns(
                    [cols.device_ids[int(i)] for i in devices],
                    rank[cols.device_index[idx]],
                    cols.ts_ms[idx],
                    cols.lat[idx],
                    cols.lon[idx],
                    cols.speed_mps[idx],
                    cols.heading_deg[idx],
                    cols.accuracy_m[idx],
                ),
            )
        )
    return out
