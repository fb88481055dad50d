"""Consumer groups end to end: `roadlog consume --group` processes share a
topic's partitions, hand them over to a newcomer without re-reading any,
take over from a member that was SIGKILLed, and resume from the committed
offsets after a restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from roadlog.client import Admin, Connection, GroupConsumer, NotFound, Producer
from roadlog.runtime.processes import alive, wait_dead
from roadlog.tools.localcluster import LocalCluster
from tests.integration.conftest import create_topic, make_pings, settled, wait_for

pytestmark = pytest.mark.integration

PARTS = 6
GROUP = "dash"


class Member:
    """One `roadlog consume NAME --group G --format jsonl` process."""

    def __init__(self, lc: LocalCluster, out: Path) -> None:
        self.out = out
        self.log = out.with_suffix(".err")
        with open(out, "ab") as o, open(self.log, "ab") as e:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "roadlog.cli",
                    "consume",
                    "munich",
                    "--group",
                    GROUP,
                    "--format",
                    "jsonl",
                    "--session-timeout-ms",
                    "4000",
                    "--servers",
                    ",".join(lc.servers),
                ],
                stdout=o,
                stderr=e,
                env={**os.environ, "ROADLOG_CLIENT_ID": f"member-{out.stem}"},
            )

    def rows(self) -> list[tuple[int, int]]:
        """(partition, offset) of every ping printed so far."""
        out = []
        for line in self.out.read_text().splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                out.append((r["partition"], r["offset"]))
        return out

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if alive(self.proc.pid):
            self.proc.send_signal(sig)
        self.proc.wait(30)


@pytest.fixture
def members(tmp_path: Path) -> Iterator[Callable[[LocalCluster, str], Member]]:
    made: list[Member] = []

    def make(lc: LocalCluster, name: str) -> Member:
        m = Member(lc, tmp_path / f"{name}.jsonl")
        made.append(m)
        return m

    yield make
    for m in made:
        if alive(m.proc.pid):
            m.proc.send_signal(signal.SIGKILL)
            wait_dead(m.proc.pid, 10)
        m.proc.wait(10)


def describe(conn: Connection) -> dict[str, Any]:
    d = Admin(conn).describe_group(GROUP)
    return {
        "generation": d.group.generation,
        "members": {m.member_id: list(m.partitions) for m in d.group.members},
        "revoking": sorted(p for m in d.group.members for p in m.revoking),
        "offsets": {o.partition: o.offset for o in d.offsets},
    }


def has(g: dict[str, Any] | None, n: int) -> bool:
    """``n`` members own every partition, and no move is under way."""
    if g is None:
        return False
    parts = sorted(p for ps in g["members"].values() for p in ps)
    still = not g["revoking"] and all(g["members"].values())
    return len(g["members"]) == n and parts == list(range(PARTS)) and still


def described(conn: Connection) -> dict[str, Any] | None:
    """The group as some node describes it (None: not known there).

    The members are other processes: their joins, commits and leaves leave
    the test no index to fence this read at, and any node answers it, one
    that has not applied the latest of them yet included. A read that must
    show them is read again until it does (settled), and what is checked is
    that answer, not one read right after it (perhaps from a node behind)."""
    try:
        return describe(conn)
    except Exception:
        return None


def group_has(conn: Connection, n: int) -> bool:
    return has(described(conn), n)


def ends(conn: Connection) -> dict[int, int]:
    return {p.partition: p.next_offset for p in Admin(conn).describe("munich").partitions}


def publish(conn: Connection, name: str, start: int, n: int) -> None:
    p = Producer(conn, "munich", client=name)
    p.send_batch(make_pings(name, start, n, devices=24))  # devices spread over the partitions


def everything_read(conn: Connection, ms: list[Member]) -> bool:
    seen = {r for m in ms for r in m.rows()}
    return all((p, o) in seen for p, end in ends(conn).items() for o in range(end))


def test_members_share_partitions_take_over_and_resume(
    make_cluster: Callable[..., LocalCluster],
    members: Callable[[LocalCluster, str], Member],
) -> None:
    lc = make_cluster(3)
    with Connection(lc.servers) as conn:
        create_topic(conn, partitions=PARTS)
        publish(conn, "p1", 0, 600)
        a, b = members(lc, "a"), members(lc, "b")
        wait_for(lambda: group_has(conn, 2), 60, "two members sharing every partition")
        wait_for(lambda: everything_read(conn, [a, b]), 60, "two members reading everything")
        g = settled(lambda: described(conn), lambda v: has(v, 2), "the two members described")
        assert g is not None
        owned = list(g["members"].values())
        assert not set(owned[0]) & set(owned[1])  # no partition assigned twice
        cli = [sys.executable, "-m", "roadlog.cli", "group"]
        where = ["--servers", ",".join(lc.servers), "--json"]

        def cli_json(*args: str) -> Any:
            return json.loads(subprocess.check_output([*cli, *args, *where], timeout=60))

        # The CLI has no fence option either.
        listed = settled(lambda: cli_json("list"), bool, "the group listed by the CLI")
        assert [x["group"] for x in listed] == [GROUP] and listed[0]["topic"] == "munich"
        shown = settled(
            lambda: cli_json("describe", GROUP),
            lambda v: v["generation"] >= g["generation"],
            "the CLI describing the group at the generation the SDK saw",
        )
        assert {m["member_id"]: m["partitions"] for m in shown["members"]} == g["members"]
        assert shown["generation"] == g["generation"]

        c = members(lc, "c")
        three = settled(
            lambda: described(conn),
            lambda v: (
                v is not None and has(v, 3) and all(len(m) == 2 for m in v["members"].values())
            ),
            "a third member getting its partitions, once their owners released them",
            60,
        )
        assert three is not None
        publish(conn, "p1", 600, 600)
        wait_for(lambda: everything_read(conn, [a, b, c]), 60, "three members reading everything")
        wait_for(lambda: bool(c.rows()), 60, "the third member reading its partitions")
        # Joins in good order move partitions cooperatively (the old owner
        # commits and releases, then the new one starts there): no ping was
        # read twice, by one member or by two.
        rows = a.rows() + b.rows() + c.rows()
        assert len(rows) == len(set(rows)), "pings read twice while members joined"

        b.stop(signal.SIGKILL)  # no leave: the leader expires it after 4 s
        gen = three["generation"]  # b's last generation (a read now may lag behind it)
        wait_for(
            lambda: group_has(conn, 2) and describe(conn)["generation"] > gen,
            60,
            "the killed member expired and its partitions moved",
        )
        publish(conn, "p1", 1200, 600)
        wait_for(lambda: everything_read(conn, [a, b, c]), 60, "the survivors reading everything")

        # A graceful stop commits what it printed; a restarted member resumes
        # from the committed offsets: no gap.
        wait_for(
            lambda: describe(conn)["offsets"] == ends(conn), 30, "offsets committed to the end"
        )
        a.stop()
        c.stop()
        after_stop = settled(
            lambda: described(conn),
            lambda v: v is not None and v["offsets"] == ends(conn),
            "the offsets still at the ends after the stops",
        )
        assert after_stop is not None
        committed = after_stop["offsets"]
        assert committed == ends(conn)
        publish(conn, "p1", 1800, 600)
        d = members(lc, "d")
        wait_for(lambda: group_has(conn, 1), 60, "the restarted member owning everything")
        wait_for(lambda: everything_read(conn, [a, b, c, d]), 60, "the restarted member reading")
        resumed: dict[int, int] = {}
        for p, o in d.rows():
            resumed.setdefault(p, o)
        assert resumed == {p: committed[p] for p in resumed}  # started exactly at the commits
        assert set(resumed) == {p for p, e in ends(conn).items() if e > committed[p]}
        d.stop()
        assert d.proc.returncode == 0, d.log.read_text()

        # Once no member is in it, the group can be deleted, offsets and all.
        wait_for(lambda: not describe(conn)["members"], 30, "the last member gone from the group")
        deleted = json.loads(
            subprocess.check_output([*cli, "delete", GROUP, "--yes", *where], timeout=60)
        )
        assert deleted["deleted"] == GROUP and deleted["applied_index"] > 0
        with pytest.raises(NotFound):  # read at the delete's index: gone
            Admin(conn).describe_group(GROUP, min_applied_index=deleted["applied_index"])
        wait_for(lambda: Admin(conn).list_groups() == [], 10, "the group gone from the list")


def _read(member: GroupConsumer, rows: list[tuple[int, int]]) -> None:
    """One poll; every ping it returns recorded as (partition, offset)."""
    for f in member.poll(max_pings=50):
        rows += [(f.partition, f.base_offset + i) for i in range(len(f.pings))]


def test_a_newcomer_starts_where_the_old_owner_stopped_nothing_is_read_twice(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """The re-read of issue 21: a member that has read (but not yet
    committed) pings of a partition that moves to a newcomer. The partition
    stays with it until it commits and releases; the newcomer starts there."""
    lc = make_cluster(3)
    with Connection(lc.servers) as conn:
        create_topic(conn, partitions=PARTS)
        publish(conn, "p1", 0, 1200)
        a = GroupConsumer(conn, "munich", "coop", client="a", session_timeout_ms=3000)
        b = GroupConsumer(conn, "munich", "coop", client="b", session_timeout_ms=3000)
        read_a: list[tuple[int, int]] = []
        read_b: list[tuple[int, int]] = []
        try:
            a.join()
            for _ in range(PARTS):  # a reads part of every partition, commits nothing
                _read(a, read_a)
            assert {p for p, _ in read_a} == set(range(PARTS))
            b.join()
            assert b.assigned == []  # nothing moves before a gives it up
            wait_for(lambda: bool(a.revoking), 30, "a hearing that partitions move")
            moving = list(a.revoking)
            _read(a, read_a)  # releases them, with their positions, before reading on
            assert a.revoking == [] and not set(a.assigned) & set(moving)
            wait_for(lambda: b.assigned == moving, 30, "b owning them")
            total = sum(ends(conn).values())
            for _ in range(200):
                _read(a, read_a)
                _read(b, read_b)
                a.commit()
                b.commit()
                if len(set(read_a) | set(read_b)) >= total:
                    break
            assert len(set(read_a) | set(read_b)) == total  # everything read
            assert not set(read_a) & set(read_b), "pings read by both members"
            assert len(read_a) == len(set(read_a)) and len(read_b) == len(set(read_b))
        finally:
            b.close()
            a.close()
