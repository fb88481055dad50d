"""A directory's federation in the state machine (issue 43): members
registered and reporting, topics placed by name, tags or load, one home a
topic, replicas that apply the same entries alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from node_daemon.state.federation import HEALTHY_MS
from roadlog.errors import Code
from roadlog.v1 import command_pb2, federation_pb2
from tests.unit.node_daemon.state.applying import T0, Applying

pytestmark = pytest.mark.unit


def register(name: str, qs: str, tags: tuple[str, ...] = ()) -> command_pb2.Op:
    m = federation_pb2.FederationMember(name=name, tags=list(tags), queue_servers=[qs])
    return command_pb2.Op(register_member=command_pb2.RegisterMemberOp(member=m))


def report(name: str, qs: str, publishes: float = 0.0) -> command_pb2.Op:
    load = federation_pb2.MemberLoad(queue_server=qs, publishes_per_s=publishes)
    req = federation_pb2.ReportLoadRequest(name=name, load=load)
    return command_pb2.Op(report_load=command_pb2.ReportLoadOp(request=req))


def place(topic: str, on: str = "", tags: tuple[str, ...] = ()) -> command_pb2.Op:
    req = federation_pb2.PlaceTopicRequest(topic=topic, on=on, tags=list(tags))
    return command_pb2.Op(place_topic_home=command_pb2.PlaceTopicHomeOp(request=req))


def forget(topic: str, cluster: str = "") -> command_pb2.Op:
    req = federation_pb2.ForgetTopicHomeRequest(topic=topic, cluster=cluster)
    return command_pb2.Op(forget_topic_home=command_pb2.ForgetTopicHomeOp(request=req))


def home(a: Applying, topic: str, op: command_pb2.Op | None = None, at: int = T0) -> str:
    raw = a.ok(op or place(topic), at)
    return federation_pb2.TopicHome.FromString(raw).cluster


def two_members(a: Applying) -> None:
    a.ok(register("eu", "10.0.0.1:7500", ("region=eu",)))
    a.ok(register("us", "10.0.1.1:7500", ("region=us", "tier=gold")))
    a.ok(report("eu", "10.0.0.1:7500", 10.0))
    a.ok(report("us", "10.0.1.1:7500", 50.0))


def test_registration_adds_queue_servers_and_replaces_tags(tmp_path: Path) -> None:
    a = Applying(tmp_path)
    a.ok(register("eu", "10.0.0.1:7500", ("region=eu",)))
    raw = a.ok(register("eu", "10.0.0.2:7500", ("region=eu-west", "tier=gold")))
    m = federation_pb2.RegisterMemberResponse.FromString(raw).member
    assert list(m.queue_servers) == ["10.0.0.1:7500", "10.0.0.2:7500"]
    assert list(m.tags) == ["region=eu-west", "tier=gold"]
    assert m.registered_ms == T0 and not m.healthy  # no report yet
    assert a.apply(register("Bad Name", "x:1")).code == Code.INVALID_ARGUMENT
    assert a.apply(register("eu", "x:1", ("no-equals",))).code == Code.INVALID_ARGUMENT


def test_a_report_needs_a_registered_member_and_queue_server(tmp_path: Path) -> None:
    a = Applying(tmp_path)
    assert a.apply(report("eu", "10.0.0.1:7500")).code == Code.NOT_FOUND
    a.ok(register("eu", "10.0.0.1:7500"))
    assert a.apply(report("eu", "10.9.9.9:7500")).code == Code.NOT_FOUND
    a.ok(report("eu", "10.0.0.1:7500", 3.0), T0 + 1000)
    fed = a.sm.read_federation(lambda txn, t: t.federation(txn, T0 + 1000))
    [m] = fed.members
    assert m.healthy and m.reported_ms == T0 + 1000 and m.loads[0].publishes_per_s == 3.0
    later = a.sm.read_federation(lambda txn, t: t.federation(txn, T0 + 1000 + HEALTHY_MS + 1))
    assert not later.members[0].healthy


def test_placement_by_name_by_tags_and_least_loaded(tmp_path: Path) -> None:
    a = Applying(tmp_path)
    two_members(a)
    assert home(a, "paris", place("paris", on="us")) == "us"
    assert home(a, "denver", place("denver", tags=("region=us",))) == "us"
    # Least loaded: fewest topics (eu has none), then publishes a second.
    assert home(a, "lyon") == "eu"
    assert home(a, "nice") == "eu"  # 1 topic each, eu publishes less
    assert a.apply(place("x", on="asia")).code == Code.NOT_FOUND
    assert a.apply(place("y", tags=("region=asia",))).code == Code.FAILED_PRECONDITION
    fed = a.sm.read_federation(lambda txn, t: t.federation(txn, T0))
    assert {t.topic: t.cluster for t in fed.topics} == {
        "denver": "us",
        "lyon": "eu",
        "nice": "eu",
        "paris": "us",
    }
    assert {m.name: m.topics for m in fed.members} == {"eu": 2, "us": 2}


def test_a_topic_name_has_one_home_in_the_federation(tmp_path: Path) -> None:
    a = Applying(tmp_path)
    two_members(a)
    assert home(a, "paris", place("paris", on="eu")) == "eu"
    again = a.apply(place("paris", on="us"))
    assert again.code == Code.ALREADY_EXISTS and "'eu'" in again.message
    assert a.apply(place("Bad Topic")).code == Code.INVALID_ARGUMENT
    # Forgotten only by its own home's name (or by any).
    assert not federation_pb2.ForgetTopicHomeResponse.FromString(
        a.ok(forget("paris", "us"))
    ).forgotten
    assert federation_pb2.ForgetTopicHomeResponse.FromString(a.ok(forget("paris"))).forgotten
    assert home(a, "paris", place("paris", on="us")) == "us"
    got = a.sm.read_federation(lambda txn, t: t.home(txn, "paris"))
    assert got.cluster == "us" and list(got.queue_servers) == ["10.0.1.1:7500"]


def test_unhealthy_members_are_not_chosen_but_may_be_named(tmp_path: Path) -> None:
    a = Applying(tmp_path)
    two_members(a)  # both reported at T0
    late = T0 + HEALTHY_MS + 1
    a.ok(report("us", "10.0.1.1:7500", 99.0), late)  # only us is fresh then
    assert home(a, "a1", at=late) == "us"
    assert home(a, "a2", place("a2", on="eu"), at=late) == "eu"


def test_no_member_at_all_is_unavailable(tmp_path: Path) -> None:
    a = Applying(tmp_path)
    assert a.apply(place("paris")).code == Code.UNAVAILABLE


def test_replicas_that_apply_the_same_entries_are_identical(tmp_path: Path) -> None:
    a, b = Applying(tmp_path / "a"), Applying(tmp_path / "b")
    for x in (a, b):
        two_members(x)
        home(x, "lyon")
        home(x, "paris", place("paris", tags=("tier=gold",)))
        x.ok(forget("lyon"))
    assert a.sm.digest() == b.sm.digest()


def move(topic: str, source: str, target: str) -> command_pb2.Op:
    req = federation_pb2.MoveTopicHomeRequest(topic=topic, source=source, target=target)
    return command_pb2.Op(move_topic_home=command_pb2.MoveTopicHomeOp(request=req))


def test_a_moved_home_flips_only_from_its_source_and_the_counts_follow(tmp_path: Path) -> None:
    """MoveTopicHome is a compare-and-set: of two movers one wins, and a
    move whose source is not the home (abandoned, or raced) changes nothing."""
    a = Applying(tmp_path)
    two_members(a)
    assert home(a, "paris", place("paris", on="eu")) == "eu"
    assert home(a, "paris", move("paris", "eu", "us")) == "us"
    with a.sm.env.begin() as txn:
        assert a.sm.federation.count(txn, "eu") == 0
        assert a.sm.federation.count(txn, "us") == 1
    raced = a.apply(move("paris", "eu", "us"))
    assert raced.code == Code.FAILED_PRECONDITION and "'us', not 'eu'" in raced.message
    assert a.apply(move("paris", "us", "mars")).code == Code.NOT_FOUND
    assert a.apply(move("atlantis", "eu", "us")).code == Code.NOT_FOUND
    fed = a.sm.read_federation(lambda txn, t: t.federation(txn, T0))
    assert {t.topic: t.cluster for t in fed.topics} == {"paris": "us"}
