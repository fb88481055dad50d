"""Retention of heat maps in the state machine, on real LMDB: a trim op that
carries ``heatmap_keep_newest`` deletes each topic's heat maps whose window
ended before the log's clock minus the topic's retention, but never its
newest windows; a trim op from before (no such field) leaves heat maps
alone; replicas that apply the same entries hold the same state, and one
that ignored the field (a node of an earlier release during a rolling
upgrade) holds the same as the others again after its next trim."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from node_daemon.raft import Entry, EntryType
from node_daemon.state.heatmaps import HEATMAP_KEEP_NEWEST
from node_daemon.state.machine import StateMachine, append_op, trim_op
from roadlog.columnar import PingColumns
from roadlog.errors import Code, RoadlogError
from roadlog.geo import bbox_region
from roadlog.partitioning import split_by_partition
from roadlog.v1 import client_pb2, command_pb2, heatmaps_pb2, topics_pb2

pytestmark = pytest.mark.unit

REGION = bbox_region(11.4, 48.05, 11.75, 48.25).geojson
T0 = 1_800_000_000_000
MIN = 60_000
HOUR = 60 * MIN
WINDOW = 15 * MIN


def create_op(name: str, retention_ms: int) -> command_pb2.Op:
    # Retention, not give-to-get, is what these tests look at: one ping counts.
    spec = topics_pb2.TopicSpec(
        name=name,
        region_geojson=REGION,
        partitions=2,
        retention_ms=retention_ms,
        contribution_min_pings=1,
        contribution_min_seconds=0,
    )
    return command_pb2.Op(create_topic=command_pb2.CreateTopicOp(spec=spec))


def put_op(topic: str, start: int, length: int = WINDOW, pings: int = 3) -> command_pb2.Op:
    hm = heatmaps_pb2.HeatMap(
        topic=topic,
        window_start_ms=start,
        window_end_ms=start + length,
        h3_resolution=9,
        computed_ms=start + length,
        cells=heatmaps_pb2.HeatMapCells(
            h3=[617700169958293503], pings=[pings], devices=[1], mean_speed_mps=[7.5]
        ),
    )
    return command_pb2.Op(
        put_heatmap=command_pb2.PutHeatmapOp(request=client_pb2.PutHeatmapRequest(heatmap=hm))
    )


def publish_op(topic: str, client: str, at_ms: int) -> command_pb2.Op:
    cols = PingColumns.from_columns(["car-1", "car-2"], [at_ms] * 2, [48.1] * 2, [11.5] * 2)
    return append_op(topic, split_by_partition(cols, 2), client_id=client)


def entry(index: int, leader_ms: int, *ops: command_pb2.Op) -> Entry:
    cmd = command_pb2.Command(leader_ms=leader_ms, ops=list(ops))
    return Entry(1, index, EntryType.NORMAL, cmd.SerializeToString())


def as_old_release(e: Entry) -> Entry:
    """The entry as a node of the release before heat-map retention applies
    it: the trim op's new field unknown to it, so ignored."""
    cmd = command_pb2.Command.FromString(e.data)
    for op in cmd.ops:
        if op.WhichOneof("op") == "trim":
            op.trim.ClearField("heatmap_keep_newest")
    return Entry(e.term, e.index, e.type, cmd.SerializeToString())


class Replica:
    """One state machine fed committed entries, each also kept."""

    def __init__(self, path: Path) -> None:
        self.sm = StateMachine(path, map_size=64 << 20)
        self.entries: list[Entry] = []

    def run(self, leader_ms: int, *ops: command_pb2.Op) -> None:
        e = entry(len(self.entries) + 1, leader_ms, *ops)
        self.entries.append(e)
        [results] = self.sm.apply([e])
        for r in results:
            r = r.spans[0] if r.spans else r
            assert r.code == Code.OK, r.message

    def windows(self, topic: str = "munich") -> list[int]:
        with self.sm.env.begin() as txn:
            return self.sm.heat.windows(txn, self.sm.topic(topic).id)

    def get(
        self, topic: str, client: str, now_ms: int, start: int = 0
    ) -> client_pb2.GetHeatmapResponse:
        req = client_pb2.GetHeatmapRequest(topic=topic, client_id=client, window_start_ms=start)
        return self.sm.heatmap(req, now_ms)


@pytest.fixture
def r(tmp_path: Path) -> Iterator[Replica]:
    rep = Replica(tmp_path / "sm")
    yield rep
    rep.sm.close()


def starts(first: int, n: int, step: int = WINDOW) -> list[int]:
    return [first + k * step for k in range(n)]


def test_trim_keeps_the_windows_that_ended_within_retention_and_the_newest(r: Replica) -> None:
    r.run(T0, create_op("munich", retention_ms=HOUR))
    every = starts(T0, 12)  # 15-minute windows over 3 hours
    for s in every:
        r.run(T0, put_op("munich", s))
    now = T0 + 3 * HOUR  # the last window ends now; the cutoff is 2 h after T0
    r.run(now, trim_op(heatmap_keep_newest=2))
    # ended at or after T0 + 2 h: the windows starting at 1 h 45 min on
    assert r.windows() == [s for s in every if s + WINDOW >= T0 + 2 * HOUR]
    assert r.windows() == every[7:]
    # the newest windows are kept however old they are
    r.run(now + 10 * HOUR, trim_op(heatmap_keep_newest=2))
    assert r.windows() == every[-2:]
    r.run(now + 20 * HOUR, trim_op(heatmap_keep_newest=2))
    assert r.windows() == every[-2:]


def test_a_window_ending_exactly_at_the_cutoff_stays_and_one_ending_before_goes(
    r: Replica,
) -> None:
    r.run(T0, create_op("munich", retention_ms=HOUR))
    r.run(T0, put_op("munich", T0, length=WINDOW - 1))  # ends 1 ms before the cutoff
    r.run(T0, put_op("munich", T0 + 1, length=WINDOW - 1))  # ends at the cutoff
    r.run(T0, put_op("munich", T0 + 2, length=3 * HOUR))  # started long before, ends later
    r.run(T0, put_op("munich", T0 + 4 * HOUR))
    r.run(T0 + WINDOW + HOUR, trim_op(heatmap_keep_newest=1))  # the cutoff: T0 + WINDOW
    assert r.windows() == [T0 + 1, T0 + 2, T0 + 4 * HOUR]


def test_each_topic_keeps_heat_maps_for_its_own_retention(r: Replica) -> None:
    r.run(T0, create_op("munich", retention_ms=HOUR))
    r.run(T0, create_op("vienna", retention_ms=24 * HOUR))
    for s in starts(T0, 8):
        r.run(T0, put_op("munich", s), put_op("vienna", s))
    r.run(T0 + 5 * HOUR, trim_op(heatmap_keep_newest=1))
    assert r.windows("munich") == [T0 + 7 * WINDOW]  # all older than 1 h: the newest stays
    assert r.windows("vienna") == starts(T0, 8)  # all within a day


def test_a_trim_op_from_before_heat_map_retention_leaves_heat_maps_alone(r: Replica) -> None:
    r.run(T0, create_op("munich", retention_ms=HOUR))
    r.run(T0, publish_op("munich", "alice", T0))
    for s in starts(T0, 4):
        r.run(T0, put_op("munich", s))
    r.run(T0 + 10 * HOUR, command_pb2.Op(trim=command_pb2.TrimOp()))
    assert r.windows() == starts(T0, 4)  # as a node before this release did
    assert all(p.first_offset == p.next_offset for p in r.sm.describe("munich").partitions)


def test_the_trim_is_on_the_log_s_clock_not_a_late_stamp(r: Replica) -> None:
    r.run(T0, create_op("munich", retention_ms=HOUR))
    for s in starts(T0, 4):
        r.run(T0, put_op("munich", s))
    r.run(T0 + 5 * HOUR, publish_op("munich", "alice", T0 + 5 * HOUR))  # the log's clock
    # A trim stamped hours behind what was applied (a leader whose clock
    # is behind): heat maps are trimmed as of the log's clock all the same.
    r.run(T0, trim_op(heatmap_keep_newest=1))
    assert r.windows() == [T0 + 3 * WINDOW]


def test_get_heatmap_serves_the_kept_windows_and_not_the_trimmed(r: Replica) -> None:
    r.run(T0, create_op("munich", retention_ms=HOUR))
    every = starts(T0, 12)
    for s in every:
        r.run(T0, put_op("munich", s, pings=s // MIN % 1000))
    now = T0 + 3 * HOUR
    r.run(now, publish_op("munich", "alice", now), trim_op(heatmap_keep_newest=2))
    kept = every[7:]
    got = r.get("munich", "alice", now)
    assert list(got.windows) == kept
    assert got.heatmap.window_start_ms == every[-1]  # the latest, as before
    old = r.get("munich", "alice", now, start=kept[0])  # the oldest kept one
    assert old.heatmap.window_start_ms == kept[0]
    assert list(old.heatmap.cells.pings) == [kept[0] // MIN % 1000]
    with pytest.raises(RoadlogError) as e:  # a trimmed one
        r.get("munich", "alice", now, start=every[6])
    assert e.value.code == Code.NOT_FOUND
    with pytest.raises(RoadlogError) as e:  # give-to-get first, as always
        r.get("munich", "stranger", now, start=kept[0])
    assert e.value.code == Code.PERMISSION_DENIED
    # A window committed again after it was trimmed (a late batch build) is back.
    r.run(now, put_op("munich", every[0]))
    assert r.windows() == [every[0], *kept]
    assert r.get("munich", "alice", now, start=every[0]).heatmap.window_start_ms == every[0]


def test_the_leader_s_trim_op_keeps_the_documented_number_of_windows() -> None:
    assert HEATMAP_KEEP_NEWEST == 96
    assert trim_op().trim.heatmap_keep_newest == HEATMAP_KEEP_NEWEST


def random_log(seed: int, keep: int = 0, n: int = 160) -> list[tuple[int, list[command_pb2.Op]]]:
    """Puts (the stream's one-minute windows, batch builds of any window,
    windows committed again), publishes and trims with a heat-map field
    (``keep`` windows, or a random number each time), on a clock that
    mostly goes forward and sometimes lags."""
    rng = np.random.default_rng(seed)
    out: list[tuple[int, list[command_pb2.Op]]] = [
        (T0, [create_op("munich", HOUR), create_op("vienna", 2 * HOUR)]),
    ]
    now = T0
    for _ in range(n):
        now += int(rng.integers(0, 10 * MIN))
        stamp = now - int(rng.integers(0, HOUR)) if rng.random() < 0.1 else now
        topic = str(rng.choice(["munich", "vienna"]))
        x = rng.random()
        if x < 0.55:
            start = now // MIN * MIN - WINDOW
            if rng.random() < 0.3:  # a batch build or a late window, maybe long
                start -= int(rng.integers(0, 4 * HOUR)) // MIN * MIN
            length = WINDOW if rng.random() < 0.8 else int(rng.integers(1, 3 * HOUR))
            out.append((stamp, [put_op(topic, max(start, 0), length, int(rng.integers(1, 9)))]))
        elif x < 0.75:
            out.append((stamp, [publish_op(topic, "alice", now)]))
        else:
            k = keep or int(rng.choice([1, 3, 8]))
            out.append((stamp, [trim_op(heatmap_keep_newest=k)]))
    return out


def expected_after_trim(windows: dict[int, int], cutoff: int, keep: int) -> dict[int, int]:
    """The rule, plainly: window start -> end of what stays."""
    newest = sorted(windows)[-keep:]
    return {s: e for s, e in windows.items() if e >= cutoff or s in newest}


@pytest.mark.parametrize("seed", range(6))
def test_random_logs_keep_what_the_rule_says_and_replicas_agree(tmp_path: Path, seed: int) -> None:
    log = random_log(seed)
    a, b = Replica(tmp_path / "a"), Replica(tmp_path / "b")
    retention = {"munich": HOUR, "vienna": 2 * HOUR}
    model: dict[str, dict[int, int]] = {"munich": {}, "vienna": {}}
    clock = 0
    trims = 0
    try:
        for stamp, ops in log:
            a.run(stamp, *ops)
            clock = max(clock, stamp)
            for op in ops:
                kind = op.WhichOneof("op")
                if kind == "put_heatmap":
                    hm = op.put_heatmap.request.heatmap
                    model[hm.topic][hm.window_start_ms] = hm.window_end_ms
                elif kind == "trim":
                    trims += 1
                    keep = op.trim.heatmap_keep_newest
                    for t in model:
                        model[t] = expected_after_trim(model[t], clock - retention[t], keep)
            for t in model:
                assert a.windows(t) == sorted(model[t])
        assert trims > 5
        # A second replica applying the same entries, in other batches, is identical.
        for k in range(0, len(a.entries), 7):
            b.sm.apply(a.entries[k : k + 7], results=False)
        assert b.sm.digest() == a.sm.digest()
    finally:
        a.sm.close()
        b.sm.close()


@pytest.mark.parametrize("seed", range(6))
def test_a_node_of_the_earlier_release_agrees_again_after_its_first_trim_once_upgraded(
    tmp_path: Path, seed: int
) -> None:
    """During a rolling upgrade a node not yet upgraded ignores the trim's
    heat-map field, so it keeps heat maps the others deleted; once upgraded,
    the next trim it applies deletes them and it is identical again (leaders
    send the same number of windows to keep: a release's constant)."""
    log = random_log(seed, keep=3)
    new, old = Replica(tmp_path / "new"), Replica(tmp_path / "old")
    try:
        for stamp, ops in log:
            new.run(stamp, *ops)
        old.sm.apply([as_old_release(e) for e in new.entries], results=False)
        # Entries without the field (the log before the upgrade) apply alike.
        if all(e == as_old_release(e) for e in new.entries):
            pytest.skip("no heat-map trim in this log")
        kept = {t: new.windows(t) for t in ("munich", "vienna")}
        assert any(set(kept[t]) < set(old.windows(t)) for t in kept)  # they differ now
        # The old node is upgraded; the leader's next trim: the same state again.
        now = max(stamp for stamp, _ in log) + MIN
        applied = list(new.entries)
        for rep in (new, old):
            rep.entries = list(applied)
            rep.run(now, trim_op(heatmap_keep_newest=3))
        assert old.sm.digest() == new.sm.digest()
        assert old.windows("munich") == new.windows("munich")
    finally:
        new.sm.close()
        old.sm.close()


def test_entries_without_the_field_give_the_same_state_on_either_release(tmp_path: Path) -> None:
    """The log of an old leader: applied by this release, the state is what
    the release before made of it (it never touched heat maps)."""
    log = [(stamp, ops) for stamp, ops in random_log(3)]
    new, old = Replica(tmp_path / "new"), Replica(tmp_path / "old")
    try:
        for stamp, ops in log:
            new.run(stamp, *[command_pb2.Op(trim=command_pb2.TrimOp())
                             if op.WhichOneof("op") == "trim" else op for op in ops])  # fmt: skip
        old.sm.apply([as_old_release(e) for e in new.entries], results=False)
        assert new.sm.digest() == old.sm.digest()
        puts = {
            op.put_heatmap.request.heatmap.window_start_ms
            for _, ops in log
            for op in ops
            if op.WhichOneof("op") == "put_heatmap"
            and op.put_heatmap.request.heatmap.topic == "munich"
        }
        assert new.windows("munich") == sorted(puts)  # nothing of heat maps trimmed
    finally:
        new.sm.close()
        old.sm.close()


def test_a_heat_map_answer_lists_the_newest_windows_asked_for(r: Replica) -> None:
    """A topic keeps a window per trigger for its retention (thousands); a
    reader (the dashboard's slider) asks for the newest few, read from the
    end of the table."""
    r.run(T0, create_op("munich", retention_ms=HOUR))
    r.run(T0, create_op("berlin", retention_ms=HOUR))  # its windows are not munich's
    every = starts(T0, 30)
    for s in every:
        r.run(T0, put_op("munich", s), put_op("berlin", s + 1))
    r.run(T0 + 60_000, publish_op("munich", "alice", T0 + 60_000))
    now = T0 + 2 * MIN

    def ask(newest: int, start: int = 0) -> client_pb2.GetHeatmapResponse:
        req = client_pb2.GetHeatmapRequest(
            topic="munich", client_id="alice", window_start_ms=start, max_windows=newest
        )
        return r.sm.heatmap(req, now)

    assert list(ask(0).windows) == every  # 0: every window, as before
    assert list(ask(5).windows) == every[-5:]
    assert ask(5).heatmap.window_start_ms == every[-1]
    assert list(ask(100).windows) == every
    old = ask(3, start=every[0])  # an older window itself can still be asked for
    assert old.heatmap.window_start_ms == every[0] and list(old.windows) == every[-3:]
