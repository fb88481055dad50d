"""The one-pass merge (``prepare_appends``) against the code it replaced
(``appends_reference``, kept verbatim): on random and adversarial inputs the
ops are byte-identical (same parts in the same order, same PingBatch bytes,
same spans) and every refused request is refused with the same error, ping
indexes and reasons included. Also ``split_by_partition``, ``join``,
``parse`` and ``ping_reasons`` against their old selves."""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node_daemon.work.appends import prepare_appends
from roadlog import columnar
from roadlog.columnar import PingColumns
from roadlog.errors import Code, RoadlogError
from roadlog.geo import Region, bbox_region, parse_region
from roadlog.partitioning import split_by_partition
from roadlog.v1 import client_pb2, pings_pb2
from roadlog.validation import BatchRejected, ping_reasons
from tests.unit.node_daemon.work import appends_reference as ref

pytestmark = pytest.mark.unit

T0 = 1_800_000_000_000
BOX = bbox_region(11.4, 48.05, 11.75, 48.25)
TRIANGLE = parse_region(
    json.dumps(
        {
            "type": "Polygon",
            "coordinates": [[[11.4, 48.05], [11.75, 48.05], [11.5, 48.25], [11.4, 48.05]]],
        }
    )
)
TOPICS: dict[str, tuple[int, Region]] = {
    "munich": (8, BOX),
    "one": (1, BOX),
    "three": (3, TRIANGLE),
    "wide": (256, BOX),
}
ODD_IDS = ["", "x" * 64, "y" * 65, "z" * 200, "äöü-ß", "🚗" * 16, "🚗" * 17, "car 1"]


def lookup(name: str) -> tuple[int, Region]:
    if name not in TOPICS:
        raise RoadlogError(Code.NOT_FOUND, f"no topic {name!r}")
    return TOPICS[name]


def random_batch(rng: np.random.Generator, shared: list[str]) -> bytes:
    """PingBatch wire bytes: mostly good pings, sometimes every kind of bad."""
    n = int(rng.choice([0, 1, 2, 5, 17, 100, 333])) if rng.random() < 0.9 else 1000
    ndev = int(rng.integers(1, 12))
    pool = [*shared, *(f"car-{int(rng.integers(0, 10_000))}" for _ in range(ndev))]
    if rng.random() < 0.2:
        pool.append(ODD_IDS[int(rng.integers(0, len(ODD_IDS)))])
    ids = [pool[int(i)] for i in rng.integers(0, len(pool), size=ndev)]  # may repeat
    if rng.random() < 0.6:
        ids = list(dict.fromkeys(ids))
    used = len(ids) if rng.random() < 0.7 else max(1, len(ids) - 2)  # some ids unused
    index = rng.integers(0, used, size=n).astype(np.uint32)
    ts = T0 + rng.integers(-10, 10, size=n) * 1000
    lat = 48.06 + rng.random(n) * 0.18
    lon = 11.41 + rng.random(n) * 0.33
    sp = rng.random(n).astype(np.float32) * 40
    hd = rng.random(n).astype(np.float32) * 359
    ac = rng.random(n).astype(np.float32) * 20
    bad = rng.random() < 0.25
    if bad and n:
        k = int(rng.integers(1, 4))
        at = rng.integers(0, n, size=k)
        kind = int(rng.integers(0, 12))
        if kind == 0:
            index[at] = len(ids) + int(rng.integers(0, 3))
        elif kind == 1:
            lat[at] = [np.nan, np.inf, 91.0][int(rng.integers(0, 3))]
        elif kind == 2:
            lon[at] = [-np.inf, 181.0, np.nan][int(rng.integers(0, 3))]
        elif kind == 3:
            ts[at] = [0, T0 + 10**10][int(rng.integers(0, 2))]
        elif kind == 4:
            sp[at] = [-1.0, np.inf, 151.0][int(rng.integers(0, 3))]
        elif kind == 5:
            hd[at] = [360.0, -0.5, -np.inf][int(rng.integers(0, 3))]
        elif kind == 6:
            ac[at] = [1e6, -2.0, np.inf][int(rng.integers(0, 3))]
        elif kind == 7:
            lat[at] = 40.0  # outside the region
        elif kind == 8:
            lon[at] = 11.74  # inside the box, outside the triangle
            lat[at] = 48.24
        elif kind == 9:
            ids[0] = "y" * 65
        elif kind == 10:
            ids[0] = ""
        else:
            lat[:] = np.nan  # every ping bad
    for col in (sp, hd, ac):
        r = rng.random()
        if r < 0.3:
            col[:] = np.nan  # all unknown: left out
        elif r < 0.45 and n:
            col[rng.integers(0, n, size=max(1, n // 3))] = np.nan
    view = pings_pb2.PingBatchView(device_ids=ids)
    for attr, arr, dtype in (
        ("device_index", index, "<u4"),
        ("ts_ms", ts, "<i8"),
        ("lat", lat, "<f8"),
        ("lon", lon, "<f8"),
        ("speed_mps", sp, "<f4"),
        ("heading_deg", hd, "<f4"),
        ("accuracy_m", ac, "<f4"),
    ):
        if n and not (attr in ("speed_mps", "heading_deg", "accuracy_m") and np.isnan(arr).all()):
            setattr(view, attr, np.asarray(arr, dtype=dtype).tobytes())
    data = view.SerializeToString()
    r = rng.random()
    if r < 0.03:
        data = data + data  # split columns: a legal encoding that takes the slow path
    elif r < 0.05:
        data = data[: max(0, len(data) - 3)]  # truncated
    elif r < 0.06 and n:
        # Unpacked timestamps (legal protobuf, the slow path decides).
        msg = pings_pb2.PingBatch.FromString(view.SerializeToString())
        data = msg.SerializeToString()
        unpacked = b"".join(b"\x19" + int(t).to_bytes(8, "little", signed=True) for t in msg.ts_ms)
        msg.ClearField("ts_ms")
        data = msg.SerializeToString() + unpacked
    return data


def random_requests(rng: np.random.Generator) -> list[bytes]:
    shared = [f"shared-{i}" for i in range(int(rng.integers(0, 40)))]
    out: list[bytes] = []
    for _ in range(int(rng.choice([1, 2, 3, 10, 30]))):
        r = rng.random()
        if r < 0.02:
            out.append(b"\xff\xff\xff")  # not a PublishRequest
            continue
        topic = "munich"
        if rng.random() < 0.3:
            topic = str(rng.choice(["one", "three", "wide", "nope", "munich"]))
        req = client_pb2.PublishRequestView(
            topic=topic,
            client_id=f"client-{int(rng.integers(0, 4))}",
            producer_id=int(rng.integers(0, 3)),
            sequence=int(rng.integers(0, 1 << 40)),
            batch=random_batch(rng, shared) if r > 0.04 else b"\x0a\xff",
        )
        out.append(req.SerializeToString())
        if rng.random() < 0.1:
            out.append(out[-1])  # the same request twice
    return out


def describe(e: Exception) -> tuple[Any, ...]:
    if isinstance(e, BatchRejected):
        return (type(e), str(e), e.bad, e.total_bad)
    return (type(e), str(e))


def check_same(requests: list[bytes], max_pings: int = ref.MAX_PINGS_PER_OP) -> None:
    old_ops, old_err = ref.prepare_appends(requests, lookup, T0, max_pings)
    new_ops, new_err = prepare_appends(requests, lookup, T0, max_pings)
    assert [(p.op.SerializeToString(), p.members) for p in new_ops] == [
        (p.op.SerializeToString(), p.members) for p in old_ops
    ]
    assert {i: describe(e) for i, e in new_err.items()} == {
        i: describe(e) for i, e in old_err.items()
    }


@pytest.mark.parametrize("seed", range(300))
def test_prepare_appends_matches_the_old_merge(seed: int) -> None:
    rng = np.random.default_rng(seed)
    requests = random_requests(rng)
    check_same(requests, int(rng.choice([50_000, 50_000, 150, 1000])))


def test_bench_like_requests_match() -> None:
    """The same request many times (what bench/ingest sends), and one big."""
    rng = np.random.default_rng(7)
    one = client_pb2.PublishRequestView(
        topic="munich", batch=random_batch(np.random.default_rng(1), [])
    ).SerializeToString()
    check_same([one] * 10)
    for seed in range(20):
        reqs = random_requests(np.random.default_rng(seed))
        check_same(reqs * 3)
    big = [b for b in random_requests(rng) for _ in range(2)]
    check_same(big, 40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.lists(st.text(max_size=70), min_size=0, max_size=6),  # dictionary
            st.lists(
                st.tuples(
                    st.integers(0, 7),  # device index (may be out of range)
                    st.floats(allow_nan=True, allow_infinity=True),  # lat
                    st.sampled_from([11.5, 11.41, 200.0, float("nan")]),  # lon
                    st.floats(width=32, allow_nan=True),  # speed
                ),
                min_size=0,
                max_size=30,
            ),
            st.sampled_from(["munich", "one", "three", "wide"]),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_prepare_appends_matches_on_any_batch(
    reqs: list[tuple[list[str], list[tuple[int, float, float, float]], str]],
) -> None:
    requests = []
    for ids, pings, topic in reqs:
        view = pings_pb2.PingBatchView(device_ids=ids)
        if pings:
            idx, lat, lon, sp = zip(*pings, strict=True)
            view.device_index = np.asarray(idx, dtype="<u4").tobytes()
            view.ts_ms = np.full(len(pings), T0, dtype="<i8").tobytes()
            view.lat = np.asarray(lat, dtype="<f8").tobytes()
            view.lon = np.asarray(lon, dtype="<f8").tobytes()
            if not all(math.isnan(s) for s in sp):
                view.speed_mps = np.asarray(sp, dtype="<f4").tobytes()
        requests.append(
            client_pb2.PublishRequestView(
                topic=topic, batch=view.SerializeToString()
            ).SerializeToString()
        )
    check_same(requests)
    check_same(requests, 7)


@pytest.mark.parametrize("seed", range(60))
def test_pieces_match_their_old_selves(seed: int) -> None:
    rng = np.random.default_rng(1000 + seed)
    batches = [random_batch(rng, ["a", "b"]) for _ in range(int(rng.integers(1, 6)))]
    parsed = []
    for b in batches:
        try:
            new, old = columnar.parse(b), ref.parse(b)
        except columnar.BatchDecodeError as e:
            with pytest.raises(columnar.BatchDecodeError, match=str(e)):
                ref.parse(b)
            continue
        assert (new.n, new.device_ids, new.columns) == (old.n, old.device_ids, old.columns)
        parsed.append(new)
    if not parsed:
        return
    joined, old_joined = columnar.join(parsed), ref.join(parsed)
    assert joined.device_ids == old_joined.device_ids
    ok = old_joined.device_index < len(old_joined.device_ids)
    assert np.array_equal(joined.device_index[ok], old_joined.device_index[ok])
    assert (joined.device_index[~ok] >= len(joined.device_ids)).all()
    for attr in ("ts_ms", "lat", "lon", "speed_mps", "heading_deg", "accuracy_m"):
        assert getattr(joined, attr).tobytes() == getattr(old_joined, attr).tobytes()
    for region in (BOX, TRIANGLE):
        assert np.array_equal(
            ping_reasons(joined, region, T0), ref.ping_reasons(old_joined, region, T0)
        )
    good = np.flatnonzero(ok)
    cols = old_joined.take(good)
    for partitions in (1, 2, 8, 256):
        new_parts = split_by_partition(cols, partitions)
        old_parts = ref.split_by_partition(cols, partitions)
        assert [(p, columnar.encode(c)) for p, c in new_parts] == [
            (p, ref.encode(c)) for p, c in old_parts
        ]


def test_encode_matches_on_columns_built_from_scratch() -> None:
    cols = PingColumns.from_columns(["a", "b", "a"], [T0, T0 + 1, T0 + 2], [48.1] * 3, [11.5] * 3)
    assert columnar.encode(cols) == ref.encode(cols)


@pytest.mark.parametrize("seed", range(40))
def test_encode_runs_writes_what_encode_writes(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    ids = [f"d{i}" * int(rng.integers(1, 40)) for i in range(int(rng.integers(1, 9)))]
    cols = PingColumns.from_columns(
        [ids[int(i)] for i in rng.integers(0, len(ids), size=n)],
        T0 + rng.integers(0, 1000, size=n),
        rng.random(n),
        rng.random(n),
        speed_mps=np.where(rng.random(n) < 0.5, np.nan, 1.0),
        heading_deg=None if seed % 2 else np.full(n, np.nan),
        accuracy_m=np.where(np.arange(n) < n // 2, np.nan, 3.0),
    )
    cuts = sorted({0, n, *rng.integers(1, n + 1, size=int(rng.integers(0, 5))).tolist()})
    runs = [cols.take(np.arange(lo, hi)) for lo, hi in itertools.pairwise(cuts)]
    joined = PingColumns(
        [],
        np.concatenate([r.device_index for r in runs]),
        *(np.concatenate([getattr(r, a) for r in runs]) for a in ("ts_ms", "lat", "lon")),
        *(
            np.concatenate([getattr(r, a) for r in runs])
            for a in ("speed_mps", "heading_deg", "accuracy_m")
        ),
    )
    dictionaries = [[columnar.device_id_field(d.encode()) for d in r.device_ids] for r in runs]
    assert columnar.encode_runs(joined, cuts, dictionaries) == [columnar.encode(r) for r in runs]


def test_device_facts_agree_with_partition_of_also_past_the_memo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from roadlog import partitioning

    ids = ["a", "ß" * 40, "", "car-7", "a", "🚗"]
    for memo in (1 << 17, 2):
        monkeypatch.setattr(partitioning, "MEMO_IDS", memo)
        monkeypatch.setattr(partitioning, "_FACTS", {})
        for _ in range(2):
            facts = partitioning.device_facts(ids)
            assert facts.partitions(7).tolist() == [partitioning.partition_of(d, 7) for d in ids]
            assert list(facts.fields) == [columnar.device_id_field(d.encode()) for d in ids]
            assert (facts.shortest, facts.longest) == (0, 80)
        assert len(partitioning._FACTS) <= memo
    empty = partitioning.device_facts([])
    assert (len(empty.crc), empty.fields, empty.shortest, empty.longest) == (0, (), 0, 0)


def test_unknown_columns_are_read_only_and_recognised() -> None:
    for n in (0, 5, 1 << 17):
        col = columnar.unknown_column(n)
        assert len(col) == n and np.isnan(col).all() and not col.flags.writeable
    assert columnar.is_unknown(columnar.unknown_column(5))
    assert not columnar.is_unknown(np.full(5, np.nan, dtype=np.float32))
