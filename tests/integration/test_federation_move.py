"""Topic moves (issue 43, docs/federation.md "Topic moves") on loopback: a
directory and two member clusters made with the CLI, TLS and tokens on.

A topic moved with `roadlog topic move` while producers keep publishing
through the directory: every acknowledged ping stored exactly once, in
order per device, at the same offsets on the new home; an idempotent
producer keeps its id and its sequences (a retry of a batch sent before
the move answered as a duplicate after it); a consumer group resumes at
its committed offsets. Then a move whose target is killed mid-copy: the
move fails and the topic stays whole, writable, at its source.

One node a cluster, as in test_federation.py (replication is proved by
the rest of the tier). The module shares one federation; the last test
kills the second member.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from roadlog.client import Admin, Connection, Fetched, GroupConsumer, Producer, RoadlogError
from roadlog.errors import Code
from roadlog.federation.move import TopicMove
from roadlog.tools.localdirectory import directory_of
from tests.integration.conftest import (
    ProducerRun,
    assert_exactly_once_in_order,
    make_pings,
    read_topic,
    wait_for,
)
from tests.integration.test_federation import MUNICH, Federation, read_json, roadlog

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    f = Federation(tmp_path_factory.mktemp("federation-move"))
    try:
        roadlog("directory", "up", "--nodes", "1", "--dir", str(f.dd))
        for name, d in (("eu", f.eu_dir), ("us", f.us_dir)):
            up = roadlog(
                "cluster", "up", "--nodes", "1", "--name", name, "--directory", str(f.dd),
                "--dir", str(d), check=False,
            )  # fmt: skip
            assert up.returncode == 0, up.stderr
        yield f
    finally:
        for d in (f.eu_dir, f.us_dir):
            roadlog("cluster", "down", "--dir", str(d), check=False)
        roadlog("directory", "down", "--dir", str(f.dd), check=False)


def _create(fed: Federation, name: str, on: str) -> None:
    made = read_json(
        "topic", "create", name, "--bbox", MUNICH, "--partitions", "4",
        "--directory", str(fed.dd), "--on", on, "--json",
    )  # fmt: skip
    assert made["cluster"] == on


def test_a_topic_moves_under_load_exactly_once_with_its_producers_and_group(
    fed: Federation,
) -> None:
    _create(fed, "munich", "eu")
    dd = str(fed.dd)
    d = directory_of(dd)
    # A consumer group that read and committed part of the topic.
    conn = d.connection("munich")
    Producer(conn, "munich", client="seed").send_batch(make_pings("seed", 0, 400))
    group = GroupConsumer(d.connection("munich"), "munich", "dash")
    got = [0]

    def polled() -> bool:
        got[0] += sum(len(f.pings) for f in group.poll())
        return got[0] >= 400

    wait_for(polled, 60, "the group read what was published")
    assert got[0] == 400 and group.commit()
    committed = {o.partition: o.offset for o in Admin(conn).describe_group("dash").offsets}
    group.close(commit=False)
    # An idempotent producer whose last batch's answer we pretend was lost.
    sender = Producer(d.connection("munich"), "munich", client="keeper")
    before = sender.send_batch(make_pings("keeper", 0, 50))
    pid = sender.producer_id

    runs = [
        ProducerRun(d.connection("munich"), "munich", f"load{i}", batch=100, pause_s=0.02).start()
        for i in range(2)
    ]
    try:
        wait_for(lambda: all(len(r.acked) >= 1000 for r in runs), 60, "publishes before the move")

        def eu_reports_pings() -> bool:  # the load reports' pings a second (step 6)
            eu = next(m for m in d.federation().members if m.name == "eu")
            return any(load.pings_per_s > 0 for load in eu.loads)

        wait_for(eu_reports_pings, 30, "eu's load report with its pings a second")
        moved = read_json("topic", "move", "munich", "--to", "us", "--directory", dd, "--json")
        at_move = [len(r.acked) for r in runs]
        wait_for(
            lambda: all(len(r.acked) >= n + 1000 for r, n in zip(runs, at_move, strict=True)),
            60,
            "publishes after the move",
        )
    finally:
        for r in runs:
            r.join()
    print("MOVED", moved)
    assert moved["cluster"] == "us" and moved["source"] == "eu" and moved["pings"] > 0
    for r in runs:
        assert not r.errors, r.errors[:3]
        assert r.conn.cluster == "us"  # followed the redirect
    assert fed.status()["topics"]["munich"] == "us"
    # Nothing acknowledged lost or stored twice, in order per device.
    us = Connection(fed.us.servers, tls=fed.us.tls())
    stored = read_topic(us, "munich")
    acked = [p for r in runs for p in r.acked]
    assert_exactly_once_in_order(stored, acked)
    assert sum(len(rows) for rows in stored.values()) == 400 + 50 + len(acked)
    # eu holds it no more, and names its new home.
    eu = Connection(fed.eu.servers, tls=fed.eu.tls())
    assert "munich" not in {t.topic.spec.name for t in Admin(eu).list_topics()}
    assert Admin(eu).describe("munich").topic.spec.name == "munich" and eu.cluster == "us"
    # The producer keeps its id and sequences: its lost answer's retry is a
    # duplicate with the original offsets; its next batch is stored once.
    sender.sequence -= 1
    again = sender.send_batch(make_pings("keeper", 0, 50))
    assert sender.producer_id == pid and sender.conn.cluster == "us"
    assert again.duplicate and again.offsets == before.offsets
    assert not sender.send_batch(make_pings("keeper", 50, 50)).duplicate
    # The group resumes where it committed.
    assert {o.partition: o.offset for o in Admin(us).describe_group("dash").offsets} == committed
    resumed = GroupConsumer(d.connection("munich"), "munich", "dash")
    first: list[Fetched] = []

    def resumes() -> bool:
        first.extend(resumed.poll())
        return bool(first)

    wait_for(resumes, 60, "the group's first poll at the new home")
    # Nothing before the commit is read again: it starts at the committed offsets.
    starts: dict[int, int] = {}
    for f in first:
        starts.setdefault(f.partition, f.base_offset)
    assert all(starts[p] == committed.get(p, 0) for p in starts), (starts, committed)
    resumed.close(commit=False)
    d.close()


def test_a_client_made_through_the_directory_has_one_token_on_every_cluster(
    fed: Federation,
) -> None:
    dd = str(fed.dd)
    made = read_json(
        "client", "create", "car-7", "--scope", "read:*", "--directory", dd, "--json"
    )  # fmt: skip
    assert set(made["clusters"]) == {"directory", "eu", "us"}
    token = made["token"]
    members = {"eu": fed.eu, "us": fed.us}

    def listing(name: str) -> list[str]:
        lc = members[name]
        with Connection(lc.servers, tls=lc.tls().with_token(token)) as c:
            return [t.topic.spec.name for t in Admin(c).list_topics()]

    assert "munich" in listing("us") and isinstance(listing("eu"), list)
    done = roadlog("client", "revoke", "car-7", "--yes", "--directory", dd, check=False)
    assert done.returncode == 0, done.stderr
    assert "directory, eu, us" in done.stderr

    def refused_everywhere() -> bool:
        for name in members:
            try:
                listing(name)
                return False
            except RoadlogError as e:
                if e.code not in (Code.UNAUTHENTICATED, Code.PERMISSION_DENIED):
                    raise
        return True

    wait_for(refused_everywhere, 30, "the revoked token refused on both members")


class _LostAfterFlip(TopicMove):
    """A mover that dies right after the directory's flip."""

    def _drop_source(self, src: Connection) -> None:
        raise RoadlogError(Code.UNAVAILABLE, "the mover died")


def test_a_move_lost_after_its_flip_is_finished_by_running_it_again(fed: Federation) -> None:
    _create(fed, "munich-half", "eu")
    dd = str(fed.dd)
    d = directory_of(dd)
    Producer(d.connection("munich-half"), "munich-half", client="half").send_batch(
        make_pings("half", 0, 300)
    )
    with pytest.raises(RoadlogError):
        _LostAfterFlip(d, "munich-half", "us").run()
    assert fed.status()["topics"]["munich-half"] == "us"
    # The source's copy is still fenced: a write there waits, and is not redirected.
    eu = Connection(fed.eu.servers, tls=fed.eu.tls())
    assert Admin(eu).describe("munich-half").topic.moving and eu.cluster == ""
    stale = Producer(eu, "munich-half", idempotent=False, deadline_s=3)
    with pytest.raises(RoadlogError) as refused:
        stale.send_batch(make_pings("stale", 0, 10))
    assert refused.value.code == Code.UNAVAILABLE
    again = read_json("topic", "move", "munich-half", "--to", "us", "--directory", dd, "--json")
    assert again["source"] == "eu" and again["pings"] == 0
    # Finished: eu names the home now, which holds every ping.
    assert Admin(eu).describe("munich-half").topic.spec.name == "munich-half"
    assert eu.cluster == "us"
    us = Connection(fed.us.servers, tls=fed.us.tls())
    assert sum(len(rows) for rows in read_topic(us, "munich-half").values()) == 300
    d.close()


def test_a_move_whose_target_dies_mid_copy_leaves_the_topic_whole_at_its_source(
    fed: Federation,
) -> None:
    _create(fed, "munich-stays", "eu")
    d = directory_of(str(fed.dd))
    run = ProducerRun(d.connection("munich-stays"), "munich-stays", "stay", batch=500).start()
    try:
        wait_for(lambda: len(run.acked) >= 20_000, 90, "pings to copy")
        us = fed.us

        def kill_target(round_: int) -> None:
            for n in us.nodes:
                us.kill(n.id)

        move = TopicMove(d, "munich-stays", "us", tail_pings=0, timeout=5, on_round=kill_target)
        with pytest.raises(RoadlogError) as failed:
            move.run()
        print("FAILED", failed.value)
        at_failure = len(run.acked)
        wait_for(lambda: len(run.acked) >= at_failure + 2000, 60, "publishes after the failure")
    finally:
        run.join()
    assert not run.errors, run.errors[:3]
    assert fed.status()["topics"]["munich-stays"] == "eu"
    eu = Connection(fed.eu.servers, tls=fed.eu.tls())
    stored = read_topic(eu, "munich-stays")
    assert_exactly_once_in_order(stored, run.acked)
    assert sum(len(rows) for rows in stored.values()) == len(run.acked)
    d.close()
