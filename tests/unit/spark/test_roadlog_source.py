"""The Spark data source's pieces that need no Spark: stored batches cut to
some columns and joined into Arrow record batches, tasks sized by bytes,
and finding the node on this host."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pytest

from roadlog import columnar
from roadlog.column_subset import fields_for, parse_subset, prune
from roadlog.columnar import PingColumns
from spark.arrow_batches import Dictionaries, Part, from_stored, record_batch
from spark.roadlog_source import ALL_COLUMNS, ARROW_SCHEMA, RangeTask, bundle, is_local

pytestmark = pytest.mark.unit


def stored(devices: list[str], ts: list[int], speed: list[float] | None = None) -> bytes:
    n = len(ts)
    return columnar.encode(
        PingColumns.from_columns(
            devices, ts, [48.1 + i / 100 for i in range(n)], [11.5 + i / 100 for i in range(n)],
            speed_mps=speed,
        )
    )  # fmt: skip


def part(data: bytes, base: int, columns: tuple[str, ...], d: Dictionaries) -> Part:
    """A stored batch as the node prunes it and the reader reads it back."""
    cols, ids, n = prune(data, fields_for([c for c in columns if c in ("device_id", "ts_ms",
        "lat", "lon", "speed_mps", "heading_deg", "accuracy_m")] or ["ts_ms"]))  # fmt: skip
    return Part(base, 999, parse_subset(cols, ids, n), d.of(ids) if ids else None)


def test_stored_batches_become_one_arrow_batch_with_offsets_and_devices() -> None:
    a = stored(["b", "a", "b"], [10, 20, 30], [1.0, float("nan"), 3.0])
    b = stored(["c", "a"], [40, 50])  # no speeds: the column is left out, all unknown
    d = Dictionaries()
    rb = record_batch([part(a, 100, ALL_COLUMNS, d), part(b, 103, ALL_COLUMNS, d)], 3,
                      ALL_COLUMNS, (None, None))  # fmt: skip
    assert rb is not None and rb.schema == ARROW_SCHEMA
    assert rb.column("offset").to_pylist() == [100, 101, 102, 103, 104]
    assert rb.column("device_id").to_pylist() == ["b", "a", "b", "c", "a"]
    assert rb.column("partition").to_pylist() == [3] * 5
    assert rb.column("append_ms").to_pylist() == [999] * 5
    speed = rb.column("speed_mps").to_numpy(zero_copy_only=False)
    assert speed[0] == 1.0 and speed[2] == 3.0 and np.isnan(speed[[1, 3, 4]]).all()
    # the same as a whole stored batch gives (a node that does not prune)
    whole = [Part(100, 999, *from_stored(a, d)), Part(103, 999, *from_stored(b, d))]
    again = record_batch(whole, 3, ALL_COLUMNS, (None, None))
    assert again is not None and repr(again.to_pydict()) == repr(rb.to_pydict())  # NaN as NaN


def test_only_the_columns_asked_for_are_sent_and_built_and_the_window_filters() -> None:
    a = stored(["b", "a", "b"], [10, 20, 30], [1.0, 2.0, 3.0])
    cols, ids, n = prune(a, fields_for(["speed_mps", "ts_ms"]))
    assert ids == b"" and n == 3 and len(cols) == 2 * 2 + 3 * 4 + 3 * 8  # two fields, no ids
    d = Dictionaries()
    only = ("speed_mps",)
    rb = record_batch([part(a, 100, (*only, "ts_ms"), d)], 0, only, (15, 30))
    assert rb is not None and rb.schema == pa.schema([("speed_mps", pa.float32())])
    assert rb.column("speed_mps").to_pylist() == [2.0]  # ts 20 only
    assert record_batch([part(a, 100, (*only, "ts_ms"), d)], 0, only, (31, None)) is None
    devices = ("offset", "device_id")
    rb = record_batch([part(a, 7, (*devices, "ts_ms"), d)], 0, devices, (20, None))
    assert rb is not None and rb.to_pylist() == [
        {"offset": 8, "device_id": "a"}, {"offset": 9, "device_id": "b"}
    ]  # fmt: skip
    with pytest.raises(ValueError, match="no stored column"):
        fields_for(["nope"])


def test_a_batch_written_anew_keeps_its_dictionary() -> None:
    """A stored batch not written ids first still gives its ids."""
    from roadlog.v1 import pings_pb2

    view = pings_pb2.PingBatchView.FromString(stored(["x", "y"], [1, 2]))
    reordered = view.SerializeToString()  # same fields, canonical order: ids first again
    odd = reordered[reordered.index(b"\x12") :] + b"".join(
        columnar.device_id_field(s.encode()) for s in ("x", "y")
    )  # the ids after the columns
    _cols, ids, n = prune(odd, fields_for(["device_id"]))
    assert list(pings_pb2.PingBatchView.FromString(ids).device_ids) == ["x", "y"] and n == 2


def task(partition: int, start: int, end: int, columns: tuple[str, ...] = ALL_COLUMNS) -> RangeTask:
    return RangeTask("t", partition, start, end, 0, ("n:1",), "", (None, None), 0, columns)


def test_tasks_are_sized_by_the_bytes_of_the_columns_read() -> None:
    ranges = [task(p, 0, 1_000_000) for p in range(8)]
    every = bundle(ranges, {})
    narrow = bundle([task(p, 0, 1_000_000, ("speed_mps",)) for p in range(8)], {})
    assert len(every) > len(narrow) >= 2  # fewer, larger tasks for fewer bytes a ping
    for tasks in (every, narrow):
        got = sorted((r.partition, r.start, r.end) for t in tasks for r in t)
        flat: dict[int, list[tuple[int, int]]] = {}
        for p, lo, hi in got:
            flat.setdefault(p, []).append((lo, hi))
        for p in range(8):  # every offset once, in order
            spans = flat[p]
            assert spans[0][0] == 0 and spans[-1][1] == 1_000_000
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        sizes = [sum(r.end - r.start for r in t) for t in tasks]
        assert max(sizes) - min(sizes) <= 1 * len(tasks)  # equal tasks
    small = bundle([task(p, 0, 100) for p in range(8)], {})
    assert len(small) == 2  # small ranges of several partitions share a task
    capped = bundle(ranges, {"max_pings_per_task": "500000"})
    assert len(capped) == 16
    assert bundle([], {}) == []


def test_the_node_on_this_host_is_found_by_its_address() -> None:
    assert is_local("127.0.0.1:7400")
    assert not is_local("192.0.2.123:7400")  # a documentation address: not this host
    assert not is_local("no-such-host.invalid:7400")
