"""Which partition a device's pings go to: the same one, always.

CRC-32 of the device id's UTF-8 bytes, modulo the partition count. Computed
once per distinct device of a batch, then spread to the pings by index.
A batch is split in one pass (``plan_split``): one stable permutation groups
the pings by partition (a radix sort of small integers), and each column is
gathered once; the partitions are then slices of the permuted columns.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np
import numpy.typing as npt

from roadlog.columnar import PingColumns, device_id_field, is_unknown


def partition_of(device_id: str, partitions: int) -> int:
    return zlib.crc32(device_id.encode()) % partitions


def device_partitions(cols: PingColumns, partitions: int) -> npt.NDArray[np.int64]:
    """The partition of each device in the batch's dictionary."""
    return partitions_of_utf8([d.encode() for d in cols.device_ids], partitions)


def ping_groups(cols: PingColumns, partition_groups: Sequence[int]) -> npt.NDArray[np.int64]:
    """The Raft group of each ping's partition, for a topic placed in data
    groups (``Topic.partition_groups``, one per partition), as the cluster
    computes it: so a publisher can send each group's pings to that group
    (multi-raft's fast path)."""
    per_device = device_partitions(cols, len(partition_groups))
    return np.asarray(partition_groups, dtype=np.int64)[per_device][cols.device_index]


def partitions_of_utf8(ids: Sequence[bytes], partitions: int) -> npt.NDArray[np.int64]:
    """``partition_of`` of each id, given as its UTF-8 bytes."""
    crc = np.fromiter(map(zlib.crc32, ids), dtype=np.int64, count=len(ids))
    return crc % partitions


@dataclass(frozen=True, eq=False)
class DeviceFacts:
    """What the write path derives from a dictionary's ids, one per id in
    dictionary order: ``crc`` (CRC-32 of the UTF-8 bytes: the partition is
    it modulo the count) and ``fields`` (the id as a ``device_ids`` entry of
    PingBatch wire bytes); and the shortest and longest id in UTF-8 bytes
    (0 and 0 for no ids)."""

    crc: npt.NDArray[np.int64]
    fields: tuple[bytes, ...]
    shortest: int
    longest: int

    def partitions(self, partitions: int) -> npt.NDArray[np.int64]:
        return self.crc % partitions


def device_facts(ids: Sequence[str]) -> DeviceFacts:
    """``DeviceFacts`` of ``ids``, each id's remembered in this process (the
    first ``MEMO_IDS`` ids seen; a fleet's ids recur batch after batch): a
    dictionary lookup per known id instead of encoding, hashing and framing
    it."""
    facts = list(map(_FACTS.get, ids))
    if None in facts:
        new = {}
        for d in {d for d, f in zip(ids, facts, strict=True) if f is None}:
            utf8 = d.encode()
            new[d] = (zlib.crc32(utf8), device_id_field(utf8), len(utf8))
        if len(_FACTS) + len(new) <= MEMO_IDS:
            _FACTS.update(new)
        facts = [new[d] if f is None else f for d, f in zip(ids, facts, strict=True)]
    if not facts:
        return DeviceFacts(np.zeros(0, dtype=np.int64), (), 0, 0)
    crc, fields, sizes = zip(*facts, strict=True)
    return DeviceFacts(np.array(crc, dtype=np.int64), fields, min(sizes), max(sizes))


MEMO_IDS = 1 << 17  # at most about 35 MB: 24 for the facts, the rest the ids kept
_FACTS: dict[str, tuple[int, bytes, int]] = {}


@dataclass(frozen=True, eq=False)
class Split:
    """How a batch's pings divide into partitions (``plan_split``).

    Group ``k`` is partition ``partitions[k]``: its pings are
    ``order[bounds[k]:bounds[k + 1]]`` in sending order (``order`` is None
    when there is one group: the batch order itself), and its dictionary is
    the batch's dictionary positions ``devices[lo:hi]`` for
    ``(lo, hi) = device_ranges[k]``, in dictionary order. Per ping (in batch
    order), ``local_index`` is its device's index within its partition's
    dictionary and ``ping_partition`` its partition; ``sizes`` is the pings
    of each group, ``counts`` of every partition."""

    partitions: list[int]
    order: npt.NDArray[np.intp] | None
    bounds: list[int]
    sizes: list[int]
    devices: npt.NDArray[np.intp]
    device_ranges: list[tuple[int, int]]
    local_index: npt.NDArray[np.uint32]
    ping_partition: npt.NDArray[np.integer[Any]]
    counts: npt.NDArray[np.intp]


def plan_split(
    per_device: npt.NDArray[np.int64], device_index: npt.NDArray[np.uint32], partitions: int
) -> Split:
    """The split of pings whose devices (indexes into a dictionary, all in
    range) have the partitions ``per_device``. A few numpy calls per batch,
    none per partition or per ping; the pings are sorted with a stable radix
    sort of small integers."""
    small = np.uint8 if partitions <= 256 else np.intp
    part_dev: npt.NDArray[np.integer[Any]] = per_device.astype(small)
    ndev = len(part_dev)
    dev_counts = np.bincount(part_dev, minlength=partitions)
    dev_starts = np.cumsum(dev_counts) - dev_counts
    if ndev and int(dev_counts.max()) == ndev:  # one partition has every device
        devices: npt.NDArray[np.intp] = np.arange(ndev)
        local = device_index
    else:
        devices = np.argsort(part_dev, kind="stable")
        position = np.empty(ndev, dtype=np.uint32)
        position[devices] = np.arange(ndev, dtype=np.uint32)
        rank = position - dev_starts[part_dev].astype(np.uint32)
        local = rank[device_index]
    ping_part = part_dev[device_index]
    counts = np.bincount(ping_part, minlength=partitions)
    present = np.flatnonzero(counts)
    order: npt.NDArray[np.intp] | None = None
    if len(present) > 1:
        order = np.argsort(ping_part, kind="stable")
    dev_lo = dev_starts[present].tolist()
    dev_n = dev_counts[present].tolist()
    sizes = counts[present].tolist()
    return Split(
        partitions=present.tolist(),
        order=order,
        bounds=[0, *accumulate(sizes)],
        sizes=sizes,
        devices=devices,
        device_ranges=[(lo, lo + k) for lo, k in zip(dev_lo, dev_n, strict=True)],
        local_index=local,
        ping_partition=ping_part,
        counts=counts,
    )


def permuted(cols: PingColumns, split: Split) -> PingColumns:
    """The batch's columns in ``split`` order (each gathered once, an
    all-unknown one not at all), device indexes local to each partition's
    dictionary; ``device_ids`` is kept."""
    idx = split.order
    if idx is None:
        return PingColumns(
            cols.device_ids,
            split.local_index,
            cols.ts_ms,
            cols.lat,
            cols.lon,
            cols.speed_mps,
            cols.heading_deg,
            cols.accuracy_m,
        )
    sp, hd, ac = cols.speed_mps, cols.heading_deg, cols.accuracy_m
    return PingColumns(
        cols.device_ids,
        split.local_index[idx],
        cols.ts_ms[idx],
        cols.lat[idx],
        cols.lon[idx],
        sp if is_unknown(sp) else sp[idx],
        hd if is_unknown(hd) else hd[idx],
        ac if is_unknown(ac) else ac[idx],
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
    split = plan_split(per_device, cols.device_index, partitions)
    sorted_cols = permuted(cols, split)
    ids = cols.device_ids
    out = []
    for k, p in enumerate(split.partitions):
        lo, hi = split.bounds[k], split.bounds[k + 1]
        dlo, dhi = split.device_ranges[k]
        out.append(
            (
                p,
                PingColumns(
                    [ids[i] for i in split.devices[dlo:dhi].tolist()],
                    sorted_cols.device_index[lo:hi],
                    sorted_cols.ts_ms[lo:hi],
                    sorted_cols.lat[lo:hi],
                    sorted_cols.lon[lo:hi],
                    sorted_cols.speed_mps[lo:hi],
                    sorted_cols.heading_deg[lo:hi],
                    sorted_cols.accuracy_m[lo:hi],
                ),
            )
        )
    return out
