"""What a self-registered phone may do is the operator's choice (issue 39,
item 3), in the state machine on real LMDB: give-to-get counts a
contribution only once a run of pings is long enough, topics' access fields
are updated through the log, cluster settings are stored and checked on
apply, and a state from before (records of one stamp, no settings, topics
without the fields) reads as the defaults."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_daemon.state.heatmaps import Contribution, merged
from node_daemon.state.machine import append_op
from node_daemon.state.responses import OpResult
from node_daemon.state.settings import (
    OPEN_REGISTRATION_SCOPES,
    REGISTRATION_IDLE_DAYS,
    REGISTRATION_PER_MINUTE,
)
from roadlog.columnar import PingColumns
from roadlog.contribution import min_pings, min_seconds
from roadlog.errors import Code, RoadlogError
from roadlog.geo import bbox_region
from roadlog.partitioning import split_by_partition
from roadlog.v1 import client_pb2, command_pb2, heatmaps_pb2, settings_pb2, topics_pb2
from tests.unit.node_daemon.state.applying import T0, Applying

pytestmark = pytest.mark.unit

REGION = bbox_region(11.4, 48.05, 11.75, 48.25).geojson
PARTS = 4
WINDOW = 15 * 60_000


class Replica(Applying):
    def __init__(self, path: Path, **spec: object) -> None:
        super().__init__(path)
        topic = topics_pb2.TopicSpec(name="berlin", region_geojson=REGION, partitions=PARTS)
        for k, v in spec.items():
            setattr(topic, k, v)
        self.ok(command_pb2.Op(create_topic=command_pb2.CreateTopicOp(spec=topic)))
        hm = heatmaps_pb2.HeatMap(
            topic="berlin", window_start_ms=T0 - WINDOW, window_end_ms=T0, h3_resolution=9
        )
        put = client_pb2.PutHeatmapRequest(heatmap=hm)
        self.ok(command_pb2.Op(put_heatmap=command_pb2.PutHeatmapOp(request=put)))

    def publish(self, client: str, at_ms: int, n: int = 1) -> None:
        cols = PingColumns.from_columns(
            [f"car-{i}" for i in range(n)], [at_ms] * n, [48.1] * n, [11.5] * n
        )
        self.ok(append_op("berlin", split_by_partition(cols, PARTS), client_id=client), at_ms)

    def allowed(self, client: str, now_ms: int) -> bool:
        """Whether give-to-get lets ``client`` read (the map exists: a
        refusal is PERMISSION_DENIED and nothing else)."""
        req = client_pb2.GetHeatmapRequest(topic="berlin", client_id=client)
        try:
            self.sm.heatmap(req, now_ms)
        except RoadlogError as e:
            assert e.code == Code.PERMISSION_DENIED, e.message
            return False
        return True

    def update(self, **fields: object) -> topics_pb2.TopicSpec:
        req = client_pb2.UpdateTopicRequest(name="berlin", **fields)  # type: ignore[arg-type]
        raw = self.ok(command_pb2.Op(update_topic=command_pb2.UpdateTopicOp(request=req)))
        return topics_pb2.TopicDescription.FromString(raw).topic.spec

    def set(self, key: str, value: str) -> OpResult:
        req = settings_pb2.SetSettingRequest(key=key, value=value)
        return self.apply(command_pb2.Op(set_setting=command_pb2.SetSettingOp(request=req)))


@pytest.fixture
def r(tmp_path: Path) -> Iterator[Replica]:
    rep = Replica(tmp_path / "sm")
    yield rep
    rep.sm.close()


def test_a_topic_gets_the_defaults_set_explicitly(r: Replica) -> None:
    spec = r.sm.topic("berlin").spec
    assert spec.HasField("contribution_min_pings") and spec.HasField("contribution_min_seconds")
    assert (min_pings(spec), min_seconds(spec), spec.no_open_produce) == (20, 60, False)
    bare = topics_pb2.TopicSpec(name="old")  # a topic from before the fields
    assert (min_pings(bare), min_seconds(bare)) == (20, 60)


def test_one_made_up_ping_unlocks_nothing_with_the_defaults(r: Replica) -> None:
    r.publish("phone", T0)
    assert not r.allowed("phone", T0 + 1_000)
    r.publish("phone", T0 + 30_000, n=30)  # pings enough, but over 30 s only
    assert not r.allowed("phone", T0 + 31_000)
    r.publish("phone", T0 + 60_000)  # 32 pings over 60 s
    assert r.allowed("phone", T0 + 61_000)
    assert not r.allowed("phone", T0 + 60_000 + WINDOW + 1)  # the last too long ago


def test_the_refusal_says_what_is_missing(r: Replica) -> None:
    r.publish("phone", T0, n=2)
    req = client_pb2.GetHeatmapRequest(topic="berlin", client_id="phone")
    with pytest.raises(RoadlogError) as e:
        r.sm.heatmap(req, T0 + 1_000)
    assert "2 ping(s) over 0 s" in e.value.message and "at least 20 ping(s)" in e.value.message


def test_a_gap_longer_than_the_window_starts_a_new_run(r: Replica) -> None:
    r.publish("phone", T0, n=10)
    later = T0 + WINDOW + 1
    r.publish("phone", later, n=10)  # 20 pings over more than 60 s, but two runs
    assert not r.allowed("phone", later + 1)
    r.publish("phone", later + 60_000, n=10)  # the new run: 20 over 60 s
    assert r.allowed("phone", later + 60_001)


def test_small_topic_values_count_three_pings_over_two_seconds(tmp_path: Path) -> None:
    r = Replica(tmp_path / "sm", contribution_min_pings=3, contribution_min_seconds=2)
    for k in range(3):
        r.publish("phone", T0 + k * 1_000)
    assert r.allowed("phone", T0 + 2_000)
    r.publish("other", T0, n=3)  # three pings at once span no time
    assert not r.allowed("other", T0 + 1)


def test_updating_a_topic_changes_the_rule_and_keeps_the_rest(r: Replica) -> None:
    r.publish("phone", T0, n=3)
    assert not r.allowed("phone", T0 + 1)
    spec = r.update(contribution_min_pings=3, contribution_min_seconds=0)
    assert (spec.contribution_min_pings, spec.contribution_min_seconds) == (3, 0)
    assert r.allowed("phone", T0 + 1)
    assert r.update(no_open_produce=True).no_open_produce
    after = r.sm.topic("berlin").spec
    assert after.no_open_produce and after.contribution_min_pings == 3
    assert after.partitions == PARTS and after.region_geojson  # untouched


def test_a_bad_update_is_refused_on_apply_and_changes_nothing(r: Replica) -> None:
    before = r.sm.topic("berlin").spec
    for fields in (
        {"contribution_min_pings": 0},
        {"contribution_min_seconds": 15 * 60 + 1},  # longer than the window
    ):
        req = client_pb2.UpdateTopicRequest(name="berlin", **fields)  # type: ignore[arg-type]
        res = r.apply(command_pb2.Op(update_topic=command_pb2.UpdateTopicOp(request=req)))
        assert res.code == Code.INVALID_ARGUMENT, fields
    req = client_pb2.UpdateTopicRequest(name="nowhere", no_open_produce=True)
    res = r.apply(command_pb2.Op(update_topic=command_pb2.UpdateTopicOp(request=req)))
    assert res.code == Code.NOT_FOUND
    assert r.sm.topic("berlin").spec == before


def test_settings_have_defaults_until_set_and_are_checked_on_apply(r: Replica) -> None:
    listed = {s.key: s for s in r.sm.list_settings()}
    assert set(listed) == {
        OPEN_REGISTRATION_SCOPES,
        REGISTRATION_PER_MINUTE,
        REGISTRATION_IDLE_DAYS,
    }
    assert listed[OPEN_REGISTRATION_SCOPES].value == "produce:*,heatmap:*"
    assert not listed[OPEN_REGISTRATION_SCOPES].set
    res = r.set(OPEN_REGISTRATION_SCOPES, "produce:berlin heatmap:berlin")
    assert res.code == Code.OK
    stored = settings_pb2.SetSettingResponse.FromString(res.response)
    assert stored.setting.value == "produce:berlin,heatmap:berlin" and stored.setting.set
    assert stored.applied_index == r.index
    assert r.sm.setting(OPEN_REGISTRATION_SCOPES) == "produce:berlin,heatmap:berlin"
    digest = r.sm.digest()
    for key, value in (
        (OPEN_REGISTRATION_SCOPES, "admin"),
        (OPEN_REGISTRATION_SCOPES, "produce:*,ops"),
        (OPEN_REGISTRATION_SCOPES, "write:*"),
        (OPEN_REGISTRATION_SCOPES, ""),
        (REGISTRATION_PER_MINUTE, "0"),
        (REGISTRATION_PER_MINUTE, "many"),
    ):
        res = r.set(key, value)
        assert res.code == Code.INVALID_ARGUMENT, (key, value)
    assert r.set("no_such_key", "1").code == Code.NOT_FOUND
    assert r.sm.setting(OPEN_REGISTRATION_SCOPES) == "produce:berlin,heatmap:berlin"
    assert r.sm.digest() != digest  # the applied index moved, and nothing else:
    assert r.sm.list_settings(REGISTRATION_PER_MINUTE)[0].value == "600"


def test_a_record_from_before_runs_reads_as_one_ping(r: Replica) -> None:
    """A data directory of today's release holds a contribution as its
    last stamp alone (8 bytes): it reads as a run of one ping, which the
    new default does not count, and the run goes on from there."""
    tid = r.sm.topic("berlin").id
    with r.sm.env.begin(write=True) as txn:
        txn.put(struct.pack(">I", tid) + b"old-phone", struct.pack(">q", T0), db=r.sm.heat.contrib)
    assert r.sm.contribution("berlin", "old-phone") == Contribution(T0, T0, 1)
    assert not r.allowed("old-phone", T0 + 1)
    r.publish("old-phone", T0 + 60_000, n=19)
    assert r.sm.contribution("berlin", "old-phone") == Contribution(T0 + 60_000, T0, 20)
    assert r.allowed("old-phone", T0 + 60_001)


def test_runs_of_several_groups_merge_while_they_last() -> None:
    a, b = Contribution(T0 + 10_000, T0, 12), Contribution(T0 + 61_000, T0 + 5_000, 9)
    assert merged([a, b, None], T0 + 61_000, WINDOW) == Contribution(T0 + 61_000, T0, 21)
    assert merged([a, b], T0 + 10_000 + WINDOW + 1, WINDOW) == b  # a lapsed
    assert merged([None], T0, WINDOW) is None
