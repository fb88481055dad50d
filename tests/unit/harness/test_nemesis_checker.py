"""The nemesis checker on hand-made histories: a good one passes every
property; each kind of bad one fails exactly the property it breaks, and
the report names the event of the history that shows it."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.nemesis.checker import PROPERTIES, check
from tests.nemesis.history import Event, Recorder, load

pytestmark = pytest.mark.unit


class H:
    """A history under construction."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.ops = 0

    def ev(self, proc: str, type_: str, f: str, **kw: Any) -> Event:
        e: Event = {"i": len(self.events), "t": len(self.events) / 10, "proc": proc}
        e.update(type=type_, f=f, **kw)
        self.events.append(e)
        return e

    def op(
        self, proc: str, f: str, outcome: str, inv: dict[str, Any], done: dict[str, Any]
    ) -> Event:
        self.ops += 1
        self.ev(proc, "invoke", f, op=self.ops, **inv)
        return self.ev(proc, outcome, f, op=self.ops, **done)

    def publish(
        self, n0: int, n1: int, outcome: str = "ok", offsets: list[list[int]] | None = None,
        index: int = 0, producer: str = "P", topic: str = "main",
    ) -> Event:  # fmt: skip
        done = (
            {"offsets": offsets or [], "applied_index": index}
            if outcome == "ok"
            else {"code": "UNAVAILABLE" if outcome == "info" else "INVALID_ARGUMENT"}
        )
        inv = {"topic": topic, "producer": producer, "api": "grpc", "n0": n0, "n1": n1}
        return self.op(producer, "publish", outcome, inv, done)

    def read(
        self, offset: int, rows: list[list[Any]], end: int, fence: int = 0, partition: int = 0
    ) -> Event:
        inv = {"api": "grpc", "topic": "main", "partition": partition, "offset": offset,
               "fence": fence}  # fmt: skip
        done = {"first_offset": 0, "end_offset": end, "batches": [[offset, rows]] if rows else []}
        return self.op("reader", "read", "ok", inv, done)

    def read_end(self, offset: int, end: int, partition: int = 0) -> Event:
        inv = {"topic": "main", "partition": partition, "offset": offset}
        return self.op("reader", "read_end", "ok", inv, {"end_offset": end, "fences": {}})

    def commit(self, offsets: dict[str, int], index: int, member: str = "m1") -> Event:
        inv = {"group": "g", "topic": "main", "member": member, "generation": 1,
               "offsets": offsets, "release": []}  # fmt: skip
        return self.op(member, "commit", "ok", inv, {"applied_index": index})

    def final(
        self, parts: dict[int, list[list[Any]]], topics: dict[str, int] | None = None
    ) -> None:
        self.ev("run", "ok", "final_topics", topics=topics or {"main": len(parts)})
        for p, rows in parts.items():
            self.ev("run", "ok", "final_read", topic="main", partition=p, first_offset=0,
                    end_offset=len(rows), rows=rows)  # fmt: skip

    def end(
        self, digests: dict[str, Any] | None = None, dead: dict[str, str] | None = None
    ) -> None:
        nodes = digests or {"1": [9, "aa"], "2": [9, "aa"], "3": [9, "aa"]}
        self.ev("run", "ok", "digests", group=0, converged=True, nodes=nodes)
        # A data group's replicas, digested apart (their indexes are their own).
        data = {"1": [4, "cc"], "2": [4, "cc"], "3": [4, "cc"]}
        self.ev("run", "ok", "digests", group=1, converged=True, nodes=data)
        self.ev("run", "ok", "alive", dead=dead or {})


def good() -> H:
    """P's pings 0..6: [0, 2) acked at p0 offsets 0-1, [2, 4) unknown and
    not stored, [4, 6) acked at 2-3; a read of each acked batch, fenced; a
    consumer committing forward; the final log; equal digests."""
    h = H()
    h.ev("nemesis", "info", "nemesis", phase="start", fault="kill-0", kind="kill")
    h.op("setup", "create_topic", "ok", {"topic": "main", "api": "grpc"}, {"applied_index": 2})
    h.publish(0, 2, offsets=[[0, 0, 2]], index=5)
    h.read(0, [["P", 0], ["P", 1]], end=2, fence=5)
    h.publish(2, 4, "info")
    h.publish(4, 6, offsets=[[0, 2, 2]], index=7)
    h.read(2, [["P", 4], ["P", 5]], end=4, fence=7)
    h.read_end(2, end=4)
    h.commit({"0": 2}, index=8)
    h.commit({"0": 4}, index=9, member="m2")
    h.op("observer", "describe_group", "ok", {"group": "g", "topic": "main", "fence": 9},
         {"offsets": {"0": 4}, "generation": 2})  # fmt: skip
    h.op("heat", "heatmap", "ok", {"topic": "main", "client": "P", "fence": 7,
         "window_ms": 900_000}, {"allowed": True})  # fmt: skip
    h.op("heat", "heatmap", "ok", {"topic": "main", "client": "stranger", "fence": 7,
         "window_ms": 900_000}, {"allowed": False})  # fmt: skip
    h.op("nemesis", "remove_node", "ok", {"node": 3}, {"node": 3})
    h.op("nemesis", "add_node", "ok", {"node": 3}, {"node": 3})
    h.ev("nemesis", "info", "nemesis", phase="heal", fault="kill-0", kind="kill")
    h.ev("run", "ok", "config", leader=1, voters=[1, 2], learners=[3])
    h.final({0: [["P", 0], ["P", 1], ["P", 4], ["P", 5]]})
    h.end()
    return h


def failing(h: H) -> dict[str, list[str]]:
    report = check(h.events)
    return {k: [str(f) for f in v.failures] for k, v in report.verdicts.items() if not v.ok}


def test_a_good_history_passes_every_property() -> None:
    report = check(good().events)
    assert report.ok, [str(f) for f in report.failures()]
    assert list(report.verdicts) == list(PROPERTIES)
    assert all(v.checked > 0 for v in report.verdicts.values()), report.line()
    line = report.line()
    assert "\n" not in line and line.endswith("PASS")
    assert "kill=1" in line and "publish=3" in line
    assert all(f"{p}=ok" in line for p in PROPERTIES)


def _final(h: H, rows: list[list[Any]]) -> H:
    """``h`` with partition 0's final rows replaced."""
    h = copy.deepcopy(h)
    for e in h.events:
        if e["f"] == "final_read":
            e["rows"], e["end_offset"] = rows, len(rows)
    return h


Bad = Callable[[], tuple[H, str, str]]

FOLLOW = {
    "acked_lost": ("no_lost_reads", "group_offsets"),  # the log is shorter now
    "acked_twice": ("producer_order",),  # a ping after itself
    "ack_lied_about_offsets": ("fenced_reads",),  # the lie promised more
    "unknown_stored_twice": ("acked_exactly_once", "no_lost_reads", "producer_order"),
    "out_of_order": ("acked_exactly_once", "no_lost_reads"),
}


def acked_lost() -> tuple[H, str, str]:
    return _final(good(), [["P", 0], ["P", 4], ["P", 5]]), "acked_exactly_once", "0 times"


def acked_twice() -> tuple[H, str, str]:
    rows = [["P", 0], ["P", 1], ["P", 4], ["P", 5], ["P", 5]]
    return _final(good(), rows), "acked_exactly_once", "2 times"


def ack_lied_about_offsets() -> tuple[H, str, str]:
    h = good()
    h.events[4]["offsets"] = [[0, 1, 2]]  # the first publish's ack
    return h, "acked_exactly_once", "other pings there"


def unknown_stored_twice() -> tuple[H, str, str]:
    rows = [["P", 0], ["P", 1], ["P", 2], ["P", 2], ["P", 4], ["P", 5]]
    return _final(good(), rows), "indeterminate_at_most_once", "ended unknown"


def failed_yet_stored() -> tuple[H, str, str]:
    h = good()
    h.publish(6, 7, "fail")
    h2 = _final(h, [["P", 0], ["P", 1], ["P", 4], ["P", 5], ["P", 6]])
    return h2, "indeterminate_at_most_once", "certainly failed"


def stored_but_never_sent() -> tuple[H, str, str]:
    rows = [["P", 0], ["P", 1], ["P", 4], ["P", 5], ["Q", 0]]
    return _final(good(), rows), "indeterminate_at_most_once", "nobody sent"


def out_of_order() -> tuple[H, str, str]:
    return _final(good(), [["P", 0], ["P", 1], ["P", 5], ["P", 4]]), "producer_order", "n=4"


def read_then_lost() -> tuple[H, str, str]:
    h = good()
    h.read(4, [["P", 2]], end=5)  # the unknown publish's ping, read, then gone
    return h, "no_lost_reads", "then lost"


def log_rewritten() -> tuple[H, str, str]:
    h = good()
    h.read(3, [["P", 4]], end=4)  # the final log holds P5 at offset 3
    return h, "no_lost_reads", "rewritten"


def fence_not_honoured() -> tuple[H, str, str]:
    h = good()
    h.read(2, [], end=2, fence=7)  # the publish acked at index 7 ended at 4
    return h, "fenced_reads", "fenced at index 7"


def offsets_backwards() -> tuple[H, str, str]:
    h = good()
    h.commit({"0": 1}, index=10, member="m3")
    return h, "group_offsets", "moved the offset back from 4"


def offset_past_the_end() -> tuple[H, str, str]:
    h = good()
    h.commit({"0": 9}, index=10)
    return h, "group_offsets", "past the end"


def created_topic_gone() -> tuple[H, str, str]:
    h = good()
    h.op("churn", "create_topic", "ok", {"topic": "t1", "api": "http"}, {"applied_index": 11})
    return h, "topics", "t1 was created"


def deleted_topic_back() -> tuple[H, str, str]:
    h = good()
    h.op("churn", "delete_topic", "ok", {"topic": "main", "api": "grpc"}, {"deleted": True})
    return h, "topics", "main was deleted"


def contributor_refused() -> tuple[H, str, str]:
    h = good()
    h.op("heat", "heatmap", "ok", {"topic": "main", "client": "P", "fence": 7,
         "window_ms": 900_000}, {"allowed": False, "reason": "not published"})  # fmt: skip
    return h, "give_to_get", "P was refused"


def stranger_let_in() -> tuple[H, str, str]:
    h = good()
    h.op("heat", "heatmap", "ok", {"topic": "main", "client": "nobody", "fence": 7,
         "window_ms": 900_000}, {"allowed": True})  # fmt: skip
    return h, "give_to_get", "never published"


def added_node_missing() -> tuple[H, str, str]:
    h = good()
    next(e for e in h.events if e["f"] == "config")["learners"] = []
    return h, "membership", "adding node 3 was acknowledged"


def removed_node_present() -> tuple[H, str, str]:
    h = good()
    k = next(i for i, e in enumerate(h.events) if e["f"] == "config")
    extra = H()
    extra.ops = 100
    extra.op("nemesis", "remove_node", "ok", {"node": 2}, {"node": 2})
    h.events[k:k] = extra.events
    for i, e in enumerate(h.events):
        e["i"] = i
    return h, "membership", "removing node 2 was acknowledged"


def replicas_differ() -> tuple[H, str, str]:
    h = good()
    h.events[-3]["nodes"]["2"] = [9, "bb"]
    return h, "replicas_identical", "replicas of group 0 differ"


def data_group_replicas_differ() -> tuple[H, str, str]:
    h = good()
    h.events[-2]["nodes"]["3"] = [4, "dd"]
    return h, "replicas_identical", "replicas of group 1 differ"


def replica_silent() -> tuple[H, str, str]:
    h = good()
    h.events[-3]["nodes"]["3"] = None
    return h, "replicas_identical", "no digest of group 0"


def read_to_end_short() -> tuple[H, str, str]:
    h = good()
    h.read_end(0, end=2)  # begun after the publish that ended at 4 was acknowledged
    return h, "reads_to_end", "acknowledged before it began ended at 4"


def process_died() -> tuple[H, str, str]:
    h = good()
    h.events[-1]["dead"] = {"n2": "Traceback: StorageError"}
    return h, "processes_alive", "n2 not running"


@pytest.mark.parametrize(
    "bad",
    [
        acked_lost, acked_twice, ack_lied_about_offsets, unknown_stored_twice,
        failed_yet_stored, stored_but_never_sent, out_of_order, read_then_lost,
        log_rewritten, fence_not_honoured, offsets_backwards, offset_past_the_end,
        created_topic_gone, deleted_topic_back, contributor_refused, stranger_let_in,
        added_node_missing, removed_node_present, read_to_end_short,
        replicas_differ, data_group_replicas_differ, replica_silent, process_died,
    ],
)  # fmt: skip
def test_each_kind_of_bad_history_fails_its_property_and_names_the_event(bad: Bad) -> None:
    h, prop, words = bad()
    failed = failing(h)
    # Only the property broken, and those a changed final log breaks with it
    # (the good history's reads and acknowledgements no longer match it).
    assert prop in failed and set(failed) <= {prop, *FOLLOW.get(bad.__name__, ())}, failed
    first = failed[prop][0]
    assert words in first, first
    assert "history event" in first and "t=" in first
    report = check(h.events)
    assert report.line().endswith("FAIL") and f"{prop}=FAIL" in report.line()


def test_the_event_named_is_the_one_that_shows_the_failure() -> None:
    h, _, _ = read_then_lost()
    report = check(h.events)
    (f,) = report.verdicts["no_lost_reads"].failures
    assert h.events[f.i]["f"] == "read" and h.events[f.i]["type"] == "ok"
    assert h.events[f.i]["batches"] == [[4, [["P", 2]]]]


def test_a_deleted_topic_s_pings_are_not_held_against_anyone() -> None:
    h = good()
    h.publish(0, 3, offsets=[[0, 0, 3]], index=12, producer="C", topic="churn-1")
    h.op("churn", "delete_topic", "ok", {"topic": "churn-1", "api": "grpc"}, {"deleted": True})
    report = check(h.events)
    assert report.ok, [str(f) for f in report.failures()]


def test_a_delete_answered_not_found_found_its_topic_gone() -> None:
    """Its first attempt may have deleted it, the answer lost and the
    connection's retry told there is no such topic."""
    h = good()
    h.publish(0, 3, offsets=[[0, 0, 3]], index=12, producer="C", topic="churn-1")
    h.op("churn", "delete_topic", "fail", {"topic": "churn-1", "api": "grpc"},
         {"code": "NOT_FOUND"})  # fmt: skip
    assert check(h.events).ok


def test_without_a_final_read_nothing_can_be_promised() -> None:
    h = good()
    h.events = [e for e in h.events if e["f"] not in ("final_read", "final_topics")]
    assert "acked_exactly_once" in failing(h)


def test_a_history_round_trips_through_the_recorder(tmp_path: Path) -> None:
    rec = Recorder(tmp_path / "history.jsonl")
    op = rec.invoke("P", "publish", topic="main", producer="P", api="grpc", n0=0, n1=2)
    rec.complete("P", op, "ok", "publish", offsets=[[0, 0, 2]], applied_index=5)
    rec.event("run", "ok", "final_topics", topics={"main": 1})
    rec.event("run", "ok", "final_read", topic="main", partition=0, first_offset=0,
              end_offset=2, rows=[["P", 0], ["P", 1]])  # fmt: skip
    rec.close()
    events = load(tmp_path / "history.jsonl")
    assert [e["i"] for e in events] == list(range(4))
    assert all(a["t"] <= b["t"] for a, b in itertools.pairwise(events))
    report = check(events)
    assert (
        report.verdicts["acked_exactly_once"].ok and report.verdicts["acked_exactly_once"].checked
    )


def placed() -> H:
    """A topic placed in data groups: P's pings [0, 2) acked at p0 offsets
    0-1 by data group 1 at its index 5 (group 0's ``applied_index`` is 0:
    nothing was written there), the final log holding them."""
    h = H()
    h.op("setup", "create_topic", "ok", {"topic": "main", "api": "grpc"}, {"applied_index": 2})
    inv = {"topic": "main", "producer": "P", "api": "grpc", "n0": 0, "n1": 2}
    done = {"offsets": [[0, 0, 2]], "applied_index": 0, "fences": {"1": 5},
            "part_index": {"0": 5}}  # fmt: skip
    h.op("P", "publish", "ok", inv, done)
    return h


def test_a_placed_partition_is_judged_by_the_index_of_its_own_group() -> None:
    """A read fenced at data group 1's index 5 must see the part that group
    stored at 5; at 4 it need not (group 0's index 0 says nothing)."""
    short = placed()
    short.read(0, [], end=0, fence=5)
    short.final({0: [["P", 0], ["P", 1]]})
    short.end()
    failed = failing(short)
    assert set(failed) == {"fenced_reads"}, failed
    assert "fenced at index 5" in failed["fenced_reads"][0]
    early = placed()
    early.read(0, [], end=0, fence=4)
    early.final({0: [["P", 0], ["P", 1]]})
    early.end()
    assert not failing(early)


def test_give_to_get_holds_a_refusal_against_a_read_fenced_in_any_group_written() -> None:
    """A heat-map read fenced past the publish's index in data group 1 must
    see the contribution that group recorded; fenced below it (and at group
    0's index only), the refusal is not held against the cluster."""
    for fences, fails in (({"1": 5}, True), ({"1": 4}, False), ({}, False)):
        h = placed()
        h.op("heat", "heatmap", "ok", {"topic": "main", "client": "P", "fence": 9,
             "fences": fences, "window_ms": 900_000}, {"allowed": False})  # fmt: skip
        h.final({0: [["P", 0], ["P", 1]]})
        h.end()
        failed = failing(h)
        assert (set(failed) == {"give_to_get"}) if fails else not failed, (fences, failed)


def test_give_to_get_holds_the_minimum_contribution_both_ways() -> None:
    """Issue 39: a read recorded with the topic's minimum (``min_pings``,
    ``min_seconds``) is allowed to no client that had sent fewer pings;
    a refusal "not enough yet" is held against the cluster only when it
    counts fewer pings than were acknowledged and fenced, or reports a
    contribution that qualifies. P sent 6 pings, 4 acknowledged by index 7."""
    rule = {"topic": "main", "client": "P", "fence": 7, "window_ms": 900_000,
            "min_pings": 3, "min_seconds": 2}  # fmt: skip
    for reason, allowed, min_pings, fails in (
        ("", True, 3, False),  # 6 sent: enough pings
        ("", True, 7, True),  # allowed after 6 sent of 7
        (
            "client 'P' has contributed 4 ping(s) over 1.2 s to 'main' so far: not enough yet",
            False,
            3,
            False,
        ),
        (
            "client 'P' has contributed 1 ping(s) over 0 s to 'main' so far: not enough yet",
            False,
            3,
            True,
        ),
        (
            "client 'P' has contributed 4 ping(s) over 3 s to 'main' so far: not enough yet",
            False,
            3,
            True,
        ),
        ("client 'P' has not published pings to 'main' in the last 15 minute(s)", False, 3, True),
    ):
        h = good()
        h.op("heat", "heatmap", "ok", {**rule, "min_pings": min_pings},
             {"allowed": allowed, "reason": reason})  # fmt: skip
        failed = failing(h)
        assert (set(failed) == {"give_to_get"}) if fails else not failed, (reason, failed)
