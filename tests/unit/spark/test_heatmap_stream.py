"""The streaming heat map's bookkeeping, without Spark: which windows a
trigger computes, what counts as late and too late, the history that
survives restarts without losing or doubling a micro-batch, and the
metrics monitoring reads (the last committed window, the interval)."""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pytest
from prometheus_client import CollectorRegistry

import roadlog.client
from roadlog.v1 import topics_pb2
from spark.jobs.heatmap_stream import COLUMNS, TYPES, History, Metrics, StreamJob, Windows

pytestmark = pytest.mark.unit

MIN = 60_000
W = Windows(every_ms=MIN, window_ms=15 * MIN, lateness_ms=10 * MIN)
END = 1_800_000_000_000 // MIN * MIN


def ts(*minutes_before_end: float) -> np.ndarray:
    return np.array([END - int(m * MIN) for m in minutes_before_end], dtype=np.int64)


def test_windows_end_at_multiples_of_every_and_stay_open_for_the_lateness() -> None:
    assert W.end_at(END + 59_999) == END == W.end_at(END)
    assert W.open_ends(END) == [END - k * MIN for k in range(10)]
    assert Windows(MIN, 15 * MIN, 0).open_ends(END) == [END]  # no lateness: the current only
    assert Windows(MIN, 15 * MIN, 90_000).open_ends(END) == [END, END - MIN]
    with pytest.raises(ValueError):
        Windows(0, MIN, 0)


def test_on_time_pings_make_one_window_and_count_nothing_late() -> None:
    plan = W.plan(ts(0.5, 0.1, 0.9), END, first=False)
    assert plan.ends == [END] and plan.late == 0 and plan.too_late == 0


def test_the_current_window_is_computed_even_without_pings() -> None:
    assert W.plan(ts(), END, first=False).ends == [END]


def test_a_late_ping_lands_in_the_windows_of_its_own_time_that_are_still_open() -> None:
    # 3.5 minutes old: in every window ending after it, and the open ones
    # ending 1, 2 and 3 minutes ago are committed again.
    plan = W.plan(ts(3.5), END, first=False)
    assert plan.ends == [END - 3 * MIN, END - 2 * MIN, END - MIN, END]
    assert (plan.late, plan.too_late) == (1, 0)


def test_a_ping_older_than_every_open_window_is_counted_too_late() -> None:
    # The oldest open window ends 9 min ago and starts 24 min ago.
    plan = W.plan(ts(24.5, 23.5, 0.5), END, first=False)
    assert (plan.late, plan.too_late) == (1, 1)
    assert END - 9 * MIN in plan.ends  # the 23.5-minute-old ping is still in it
    assert W.plan(ts(24.5), END, first=False).ends == [END]


def test_the_first_batch_is_history_the_current_window_only_and_nothing_late() -> None:
    plan = W.plan(ts(300, 23.5, 3.5), END, first=True)
    assert (plan.ends, plan.late, plan.too_late) == ([END], 0, 0)
    # later, the same pings would make the open windows holding them computed again
    assert W.plan(ts(300, 23.5, 3.5), END, first=False).ends == [
        END - k * MIN for k in (9, 3, 2, 1, 0)
    ]


def pings(batch: int, n: int, at: int = END) -> pa.Table:
    return pa.table(
        {
            "partition": pa.array(np.zeros(n, dtype=np.int32)),
            "offset": pa.array(np.arange(batch * 1000, batch * 1000 + n, dtype=np.int64)),
            "device_id": pa.array([f"d{i}" for i in range(n)]),
            "ts_ms": pa.array(at - np.arange(n, dtype=np.int64) * 1000),
            "lat": pa.array(np.full(n, 48.1)),
            "lon": pa.array(np.full(n, 11.5)),
            "speed_mps": pa.array(np.full(n, 5.0, dtype=np.float32)),
        }
    ).cast(pa.schema([(c, TYPES[c]) for c in COLUMNS]))


def offsets(h: History) -> list[int]:
    return sorted(h.between(0, 2**62).column("offset").to_pylist())


def test_a_batch_run_again_replaces_its_pings_instead_of_adding_them(tmp_path: Path) -> None:
    h = History(tmp_path)
    h.add(0, pings(0, 5))
    h.add(1, pings(1, 3))
    h.add(1, pings(1, 3))  # the query stopped before Spark committed batch 1
    assert len(offsets(h)) == 8
    again = History(tmp_path)  # a restart reads what is on disk
    assert offsets(again) == offsets(h)
    assert again.record(1) is None
    again.done(1, {"end": END}, 0)
    assert History(tmp_path).record(1) == {"end": END}


def test_compaction_keeps_what_later_windows_need_and_survives_a_restart(
    tmp_path: Path,
) -> None:
    h = History(tmp_path)
    for b in range(12):
        h.add(b, pings(b, 4, at=END + b * MIN))
        h.done(b, {"end": END + b * MIN}, keep_from_ms=END + 5 * MIN)
    # batch 10 compacted: what is older than the cut is gone (batch 5's
    # first ping is exactly at it)
    kept = offsets(h)
    assert kept == [5000] + [o for b in range(6, 12) for o in range(b * 1000, b * 1000 + 4)]
    names = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".parquet")
    assert names == ["b0000000011.parquet", "c0000000010.parquet"]
    restarted = History(tmp_path)
    assert offsets(restarted) == kept
    restarted.add(10, pings(10, 4, at=END + 10 * MIN))  # already in the compaction
    restarted.add(9, pings(9, 4))
    assert offsets(restarted) == kept
    restarted.add(12, pings(12, 2, at=END + 12 * MIN))  # read from disk and new, together
    assert offsets(restarted) == [*kept, 12000, 12001]


def test_between_selects_by_event_time(tmp_path: Path) -> None:
    h = History(tmp_path)
    h.add(0, pings(0, 10))  # END, END - 1 s, ... END - 9 s
    got = h.between(END - 5000, END)
    assert sorted(got.column("ts_ms").to_pylist()) == [END - k * 1000 for k in range(5, 0, -1)]
    assert History(tmp_path / "empty").between(0, END).num_rows == 0


def test_last_record_is_the_latest_finished_batch_s(tmp_path: Path) -> None:
    h = History(tmp_path)
    assert h.last_record() is None
    for b in range(25):  # old records are pruned at compactions; the latest stays
        h.add(b, pings(b, 1, at=END + b * MIN))
        h.done(b, {"end": END + b * MIN}, keep_from_ms=0)
    assert h.last_record() == {"end": END + 24 * MIN}
    assert History(tmp_path).last_record() == {"end": END + 24 * MIN}


class _Conn:
    def __enter__(self) -> _Conn:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        pass


class _Admin:
    def __init__(self, conn: _Conn) -> None:
        pass

    def describe(self, topic: str) -> topics_pb2.TopicDescription:
        spec = topics_pb2.TopicSpec(name=topic, h3_resolution=9)
        return topics_pb2.TopicDescription(topic=topics_pb2.Topic(spec=spec))


def test_the_stream_reports_its_interval_and_last_window_also_after_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(roadlog.client, "Connection", lambda servers: _Conn())
    monkeypatch.setattr(roadlog.client, "Admin", _Admin)

    def start() -> CollectorRegistry:
        registry = CollectorRegistry()
        job = StreamJob(
            spark=cast(Any, None),
            topic="munich",
            servers=["127.0.0.1:1"],
            checkpoint=tmp_path,
            windows=W,
            metrics=Metrics(registry),
        )
        assert job.metrics is not None
        return registry

    def value(registry: CollectorRegistry, name: str) -> float | None:
        return registry.get_sample_value(f"roadlog_heatmap_stream_{name}", {"topic": "munich"})

    first = start()
    assert value(first, "trigger_interval_seconds") == 60
    assert value(first, "last_window_end_seconds") is None  # nothing committed yet
    registry = CollectorRegistry()
    m = Metrics(registry)
    m.committed("munich", END + MIN)
    m.committed("munich", END)  # a micro-batch run again commits an older window again
    assert value(registry, "last_window_end_seconds") == (END + MIN) / 1000
    # What the checkpoint recorded, after a restart: the last window committed.
    h = History(tmp_path / "history")
    for b, end in enumerate((END, END + MIN)):
        h.done(b, {"end": end}, keep_from_ms=0)
    again = start()
    assert value(again, "last_window_end_seconds") == (END + MIN) / 1000
    assert value(again, "trigger_interval_seconds") == 60
