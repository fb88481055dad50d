"""The round trace: marks recorded only when on, bounded, written per
process; and the timeline the bench makes of them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.round_timeline import ROUND_GAP_NS, load, timeline
from roadlog import round_trace

pytestmark = pytest.mark.unit


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(round_trace, "_dir", None)
    monkeypatch.setattr(round_trace, "_marks", [])


def test_off_a_mark_records_nothing(fresh: None, tmp_path: Path) -> None:
    round_trace.mark("work_in")
    round_trace.dump()
    assert round_trace._marks == [] and not list(tmp_path.iterdir())


def test_on_marks_are_written_in_order_and_bounded(
    fresh: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(round_trace, "MAX_MARKS", 3)
    round_trace.start(tmp_path / "t")
    for tag in ("work_in", "propose", "peer_out", "peer_in"):
        round_trace.mark(tag)
    round_trace.dump()
    rows = load(tmp_path / "t")[os.getpid()]
    assert [tag for _, tag in rows] == ["work_in", "propose", "peer_out"]  # the 4th: over the bound
    assert [t for t, _ in rows] == sorted(t for t, _ in rows)


def _ms(x: float) -> int:
    return int(x * 1_000_000)


def test_the_timeline_is_each_hops_median_after_the_leaders_work_in() -> None:
    leader, follower, queue = 10, 11, 12
    marks: dict[int, list[tuple[int, str]]] = {leader: [], follower: [], queue: []}
    starts = [0.0, 4.0, 8.5, 60.0, 64.0]  # 8.5 -> 60: a pause, not a round
    for k, s in enumerate(starts):
        marks[leader] += [(_ms(s), "work_in"), (_ms(s + 0.5 + 0.1 * k), "propose")]
        marks[follower] += [(_ms(s + 1.0), "peer_in"), (_ms(s + 2.0), "log1")]
        marks[queue] += [(_ms(s + 3.0), "q_result_in")]
    t = timeline(marks)
    assert t["rounds"] == 3  # 0-4, 4-8.5, 60-64; 8.5-60 is longer than ROUND_GAP_NS
    assert ROUND_GAP_NS < (60.0 - 8.5) * 1e6
    by = {r["hop"]: r for r in t["hops"]}
    assert by["L.propose"]["median_ms"] == pytest.approx(0.6)  # rounds 0, 1, 3: 0.5, 0.6, 0.8
    assert by["F0.peer_in"]["median_ms"] == pytest.approx(1.0)
    assert by["F0.log1"]["median_ms"] == pytest.approx(2.0)
    assert by["q_result_in"]["median_ms"] == pytest.approx(3.0)
    assert by["next L.work_in"]["median_ms"] == pytest.approx(4.0)
    assert t["hops"][0]["hop"] == "L.work_in"
