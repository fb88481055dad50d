"""Columnar ping batches: our fast codec agrees with protobuf both ways."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roadlog.columnar import (
    NO_DEVICE,
    BatchDecodeError,
    PingColumns,
    decode,
    encode,
    join,
    parse,
)
from roadlog.partitioning import partition_of, split_by_partition
from roadlog.v1 import pings_pb2

pytestmark = pytest.mark.unit


def sample(n: int = 5) -> PingColumns:
    return PingColumns.from_columns(
        [f"car-{i % 3}" for i in range(n)],
        [1_700_000_000_000 + i for i in range(n)],
        [48.1 + i * 1e-4 for i in range(n)],
        [11.5 + i * 1e-4 for i in range(n)],
        speed_mps=[float(i) for i in range(n)],
    )


def same(a: PingColumns, b: PingColumns) -> bool:
    return (
        list(a.device_of()) == list(b.device_of())
        and np.array_equal(a.ts_ms, b.ts_ms)
        and np.array_equal(a.lat, b.lat, equal_nan=True)
        and np.array_equal(a.lon, b.lon, equal_nan=True)
        and np.array_equal(a.speed_mps, b.speed_mps, equal_nan=True)
        and np.array_equal(a.heading_deg, b.heading_deg, equal_nan=True)
        and np.array_equal(a.accuracy_m, b.accuracy_m, equal_nan=True)
    )


def test_round_trip_and_protobuf_agree() -> None:
    cols = sample()
    wire = encode(cols)
    assert same(decode(wire), cols)
    msg = pings_pb2.PingBatch.FromString(wire)
    assert list(msg.lat) == list(cols.lat)
    assert len(msg.heading_deg) == 0  # all unknown: left out
    assert same(decode(msg.SerializeToString()), cols)


def test_decode_accepts_any_legal_encoding() -> None:
    cols = sample()
    msg = pings_pb2.PingBatch.FromString(encode(cols))
    # Unknown fields and a different field order are legal protobuf.
    wire = pings_pb2.PingBatch(lat=msg.lat).SerializeToString()
    rest = pings_pb2.PingBatch(
        device_ids=msg.device_ids, device_index=msg.device_index, ts_ms=msg.ts_ms, lon=msg.lon
    ).SerializeToString()
    assert same(
        decode(wire + rest + b"\xa8\x06\x01"),
        PingColumns(**{**cols.__dict__, "speed_mps": np.full(5, np.nan, np.float32)}),
    )


def test_a_column_in_several_pieces_or_unpacked_is_read_whole() -> None:
    cols = sample(6)
    msg = pings_pb2.PingBatch.FromString(encode(cols))
    # Parsing concatenated messages appends repeated fields: every column
    # comes in two pieces (consistent lengths in each piece, so only a check
    # that every byte was accounted for can tell).
    cut = 2
    head = pings_pb2.PingBatch(
        device_index=msg.device_index[:cut],
        ts_ms=msg.ts_ms[:cut],
        lat=msg.lat[:cut],
        lon=msg.lon[:cut],
        speed_mps=msg.speed_mps[:cut],
    ).SerializeToString()
    tail = pings_pb2.PingBatch(
        device_ids=msg.device_ids,
        device_index=msg.device_index[cut:],
        ts_ms=msg.ts_ms[cut:],
        lat=msg.lat[cut:],
        lon=msg.lon[cut:],
        speed_mps=msg.speed_mps[cut:],
    ).SerializeToString()
    assert same(decode(head + tail), cols)
    # Unpacked: one tag per value (wire type 1, 64 bits each) for ts_ms.
    rest = pings_pb2.PingBatch(
        device_ids=msg.device_ids,
        device_index=msg.device_index,
        lat=msg.lat,
        lon=msg.lon,
        speed_mps=msg.speed_mps,
    ).SerializeToString()
    unpacked = b"".join(b"\x19" + int(t).to_bytes(8, "little", signed=True) for t in cols.ts_ms)
    assert same(decode(rest + unpacked), cols)


def join_of(*batches: PingColumns) -> PingColumns:
    return join([parse(encode(b)) for b in batches])


def test_join_merges_dictionaries_and_keeps_bad_indexes_bad() -> None:
    a, b = sample(4), sample(5)
    broken = PingColumns(**{**b.__dict__, "device_index": b.device_index.copy()})
    broken.device_index[1] = 99  # out of its own dictionary
    both = join_of(a, broken)
    assert both.device_ids == ["car-0", "car-1", "car-2"]
    assert both.device_index[len(a) + 1] == NO_DEVICE
    ok = np.flatnonzero(both.device_index != NO_DEVICE)
    expect = list(a.device_of()) + list(b.device_of())
    assert [str(x) for x in both.take(ok).device_of()] == [expect[i] for i in ok]
    assert np.array_equal(both.ts_ms, np.concatenate([a.ts_ms, b.ts_ms]))


def test_join_fills_an_optional_column_only_some_parts_have() -> None:
    with_speed = sample(3)
    without = PingColumns.from_columns(["bus"] * 2, [1, 2], [48.0, 48.1], [11.0, 11.1])
    both = join_of(with_speed, without, with_speed)
    assert both.speed_mps[:3].tolist() == [0.0, 1.0, 2.0]
    assert np.isnan(both.speed_mps[3:5]).all() and both.speed_mps[5:].tolist() == [0.0, 1.0, 2.0]
    assert np.isnan(both.heading_deg).all() and len(both) == 8
    twice = list(with_speed.device_of())
    assert both.device_of().tolist() == [*twice, "bus", "bus", *twice]


def test_join_reads_a_non_canonical_part_like_the_rest() -> None:
    cols = sample(6)
    msg = pings_pb2.PingBatch.FromString(encode(cols))
    head = pings_pb2.PingBatch(device_ids=msg.device_ids, ts_ms=msg.ts_ms[:2])
    rest = pings_pb2.PingBatch(
        ts_ms=msg.ts_ms[2:],
        device_index=msg.device_index,
        lat=msg.lat,
        lon=msg.lon,
        speed_mps=msg.speed_mps,
    )
    split = head.SerializeToString() + rest.SerializeToString()  # ts_ms in two pieces
    merged = join([parse(encode(cols)), parse(split)])
    assert same(merged, join_of(cols, cols))


@given(
    st.lists(
        st.lists(
            st.tuples(
                st.sampled_from(["a", "b", "c", "d"]),
                st.integers(0, 2**40),
                st.floats(-90, 90),
                st.floats(-180, 180),
                st.one_of(st.none(), st.floats(0, 80, width=32)),
            ),
            min_size=0,
            max_size=6,
        ),
        min_size=1,
        max_size=5,
    )
)
@settings(max_examples=60, deadline=None)
def test_join_is_the_batches_one_after_another(
    batches: list[list[tuple[str, int, float, float, float | None]]],
) -> None:
    cols = [
        PingColumns.from_columns(
            [r[0] for r in rows],
            [r[1] for r in rows],
            [r[2] for r in rows],
            [r[3] for r in rows],
            speed_mps=[np.nan if r[4] is None else r[4] for r in rows]
            if any(r[4] is not None for r in rows)
            else None,
        )
        for rows in batches
    ]
    merged = join_of(*cols)
    rows = [r for b in batches for r in b]
    assert merged.device_of().tolist() == [r[0] for r in rows]
    assert merged.ts_ms.tolist() == [r[1] for r in rows]
    assert merged.lat.tolist() == [r[2] for r in rows] and merged.lon.tolist() == [
        r[3] for r in rows
    ]
    speeds = [np.nan if r[4] is None else np.float32(r[4]) for r in rows]
    assert np.array_equal(merged.speed_mps, np.array(speeds, dtype=np.float32), equal_nan=True)
    assert len(set(merged.device_ids)) == len(merged.device_ids)


@pytest.mark.parametrize(
    "junk",
    [
        b"\xff",
        b"\x22\x10abc",
        b"\x0a\x02\xff\xfe",
        pings_pb2.PingBatch(lat=[1.0]).SerializeToString(),
    ],
)
def test_garbage_is_a_clear_error(junk: bytes) -> None:
    with pytest.raises(BatchDecodeError):
        decode(junk)


floats = st.floats(allow_nan=True, allow_infinity=True, width=32)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.text(min_size=1, max_size=8),
            st.integers(-(2**63), 2**63 - 1),
            st.floats(allow_nan=True),
            st.floats(allow_nan=True),
            floats,
        ),
        max_size=40,
    )
)
def test_round_trip_property(rows: list[tuple[str, int, float, float, float]]) -> None:
    if not rows:
        return
    dev, ts, lat, lon, sp = zip(*rows, strict=True)
    cols = PingColumns.from_columns(list(dev), list(ts), list(lat), list(lon), speed_mps=list(sp))
    back = decode(encode(cols))
    assert same(back, cols)


def test_split_keeps_each_partitions_order_and_every_ping() -> None:
    n = 1000
    cols = PingColumns.from_columns(
        [f"dev-{i % 37}" for i in range(n)], list(range(n)), [1.0] * n, [2.0] * n
    )
    parts = split_by_partition(cols, 8)
    assert sum(len(c) for _, c in parts) == n
    for p, c in parts:
        assert np.all(np.diff(c.ts_ms) > 0)  # the order sent
        assert {partition_of(d, 8) for d in c.device_ids} == {p}


def test_split_pings_keep_their_device_and_values() -> None:
    n = 500
    cols = PingColumns.from_columns(
        [f"dev-{(i * 7) % 23}" for i in range(n)],
        list(range(n)),
        [float(i) / 10 for i in range(n)],
        [2.0] * n,
    )
    want = {
        int(t): (d, float(la))
        for d, t, la in zip(cols.device_of(), cols.ts_ms, cols.lat, strict=True)
    }
    got = {}
    for _, c in split_by_partition(cols, 8):
        assert len(c.device_ids) == len(set(c.device_ids))
        assert int(c.device_index.max()) < len(c.device_ids)
        for d, t, la in zip(c.device_of(), c.ts_ms, c.lat, strict=True):
            got[int(t)] = (d, float(la))
    assert got == want
