"""The checker: judges a recorded history (see ``history``) property by
property, and names the first event that breaks each.

A ping is named by (producer, n): producer ``P`` sends its pings with
n = 0, 1, 2, ... in publishes of consecutive ranges [n0, n1), one publish
at a time. The final state is what the run read back after healing
everything (``final_topics`` and one ``final_read`` per partition, rows
in offset order from the partition's first offset).

Properties (each a function below, over the same ``Facts``):

- ``acked_exactly_once``: every ping of an acknowledged publish is stored
  exactly once, at the offsets its acknowledgement gave.
- ``indeterminate_at_most_once``: a publish that failed with an unknown
  outcome stored its pings at most once; one that certainly failed, not at
  all; nothing was stored that nobody sent.
- ``producer_order``: in every partition, each producer's pings appear in
  the order it sent them.
- ``no_lost_reads``: every ping a read returned is in the final log at the
  offset it was read at (no read saw a ping that was later lost, or a log
  that was later rewritten).
- ``fenced_reads``: a read of a partition fenced at index F of the
  partition's Raft group saw every acknowledged publish whose answer gave
  that partition's part an index <= F in that group (group 0's
  ``applied_index``, or a data group's ``group_fences``: ``part_index``).
- ``reads_to_end``: a read to the end (``read_end``: ``ReadFences`` on a
  connection of its own, then a fetch fenced on them) saw the partition
  end at or past every publish to it acknowledged before the read began.
- ``group_offsets``: in log order (the commits' applied indexes), a
  group's committed offset of a partition never goes backwards, and no
  committed or observed offset points past the partition's end.
- ``topics``: an acknowledged create exists at the end unless a delete of
  it was tried; an acknowledged delete stays deleted.
- ``give_to_get``: a heat-map read (fenced past the client's publish in
  some group the publish wrote) is refused to no client whose publish to
  the topic was acknowledged less than half the contribution window before
  (on the run's clock) as one that has not published; a refusal because
  the contribution is not enough yet (issue 39: at least the topic's
  ``min_pings`` over ``min_seconds``, which the read records) must count
  at least the pings acknowledged in that half window and fenced in every
  group they went to, and must not report a run that qualifies. A read is
  allowed to no client that never published to the topic, nor to one that
  had sent fewer than ``min_pings`` pings when the answer came (a single
  made-up ping unlocks nothing). The span is not held against the cluster:
  the log's clock stands still while a leader's wall clock is stepped back.
- ``membership``: a node whose last membership change was an
  acknowledged add (or none) is in the configuration found at the end,
  and one whose last change was an acknowledged removal is not.
- ``replicas_identical``: at the end every node reports the same state
  digest at the same applied index, for group 0 and for each data group.
- ``processes_alive``: every process that should run ran to the end.

Pings of topics that saw a delete (acknowledged, of unknown outcome, or
answered "not found") are left out of the ping properties: their fate is
the delete's.
"""

from __future__ import annotations

import bisect
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tests.nemesis.history import Event

PROPERTIES = (
    "acked_exactly_once",
    "indeterminate_at_most_once",
    "producer_order",
    "no_lost_reads",
    "fenced_reads",
    "reads_to_end",
    "group_offsets",
    "topics",
    "give_to_get",
    "membership",
    "replicas_identical",
    "processes_alive",
)


@dataclass
class Failure:
    prop: str
    i: int  # the event of the history that shows it
    t: float
    message: str

    def __str__(self) -> str:
        return f"{self.prop}: {self.message} (history event {self.i}, t={self.t:.3f} s)"


@dataclass
class Verdict:
    prop: str
    checked: int = 0  # how many things were checked
    failed: int = 0  # how many of them failed
    failures: list[Failure] = field(default_factory=list)  # the first few, in full

    @property
    def ok(self) -> bool:
        return not self.failed

    def fail(self, ev: Event, message: str) -> None:
        self.failed += 1
        if len(self.failures) < 20:  # the first few tell the story
            self.failures.append(Failure(self.prop, ev.get("i", -1), ev.get("t", 0.0), message))


@dataclass
class Op:
    """An invocation and its completion (``type`` "ok", "fail", "info", or
    "open" when the history ends before it completes)."""

    invoke: Event
    done: Event | None

    @property
    def type(self) -> str:
        return self.done["type"] if self.done is not None else "open"

    @property
    def f(self) -> str:
        return str(self.invoke["f"])


@dataclass
class Facts:
    """What the checks share, derived once from the history."""

    ops: list[Op]
    events: list[Event]
    final_topics: dict[str, int] | None
    final: dict[tuple[str, int], tuple[int, list[tuple[str, int]]]]  # (topic, p) -> first, rows
    final_events: dict[tuple[str, int], Event]
    deleted: set[str]  # topics a delete was tried on (ok or unknown)
    sent: dict[str, list[tuple[int, int, int]]]  # producer -> sorted (n0, n1, op index)
    counts: dict[tuple[str, int], int]  # (producer, n) -> times stored at the end

    def ok(self, *names: str) -> Iterator[tuple[Op, Event]]:
        """The operations of these names that completed ok, with their completion."""
        for op in self.ops:
            if op.f in names and op.type == "ok" and op.done is not None:
                yield op, op.done


def pair(events: Iterable[Event]) -> tuple[list[Op], list[Event]]:
    """Operations (invoke + completion, by ``op``) and the rest, in order."""
    ops: list[Op] = []
    open_: dict[int, Op] = {}
    rest: list[Event] = []
    for ev in events:
        if ev["type"] == "invoke":
            op = Op(ev, None)
            open_[ev["op"]] = op
            ops.append(op)
        elif "op" in ev and ev["op"] in open_:
            open_.pop(ev["op"]).done = ev
        else:
            rest.append(ev)
    return ops, rest


def facts(events: list[Event]) -> Facts:
    ops, rest = pair(events)
    final_topics: dict[str, int] | None = None
    final: dict[tuple[str, int], tuple[int, list[tuple[str, int]]]] = {}
    final_events: dict[tuple[str, int], Event] = {}
    for ev in rest:
        if ev["f"] == "final_topics":
            final_topics = {str(k): int(v) for k, v in ev["topics"].items()}
        elif ev["f"] == "final_read":
            key = (ev["topic"], int(ev["partition"]))
            final[key] = (int(ev["first_offset"]), [(str(a), int(b)) for a, b in ev["rows"]])
            final_events[key] = ev
    # A delete answered NOT_FOUND found the topic gone: perhaps by its own
    # first attempt, whose answer was lost before the connection retried it.
    deleted = {
        op.invoke["topic"]
        for op in ops
        if op.f == "delete_topic"
        and (op.type in ("ok", "info") or (op.done or {}).get("code") == "NOT_FOUND")
    }
    sent: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for k, op in enumerate(ops):
        if op.f == "publish":
            sent[op.invoke["producer"]].append((op.invoke["n0"], op.invoke["n1"], k))
    for ranges in sent.values():
        ranges.sort()
    counts: Counter[tuple[str, int]] = Counter()
    for _, rows in final.values():
        counts.update(rows)
    return Facts(ops, events, final_topics, final, final_events, deleted, dict(sent), counts)


def sender(fx: Facts, producer: str, n: int) -> Op | None:
    """The publish that sent ping (producer, n), if any."""
    ranges = fx.sent.get(producer, [])
    k = bisect.bisect_right(ranges, (n, float("inf"), 0)) - 1
    if k >= 0 and ranges[k][0] <= n < ranges[k][1]:
        return fx.ops[ranges[k][2]]
    return None


def _pings(op: Op) -> Iterable[tuple[str, int]]:
    prod = op.invoke["producer"]
    return ((prod, n) for n in range(op.invoke["n0"], op.invoke["n1"]))


# ------------------------------------------------------------- properties


def acked_exactly_once(fx: Facts) -> Verdict:
    v = Verdict("acked_exactly_once")
    if fx.final_topics is None:
        v.fail(fx.events[-1] if fx.events else {}, "the run has no final read to check against")
        return v
    for op in fx.ops:
        if op.f != "publish" or op.type != "ok" or op.invoke["topic"] in fx.deleted:
            continue
        assert op.done is not None
        topic = op.invoke["topic"]
        v.checked += 1
        bad = [(ping, fx.counts.get(ping, 0)) for ping in _pings(op) if fx.counts.get(ping) != 1]
        if bad:
            (prod, n), c = bad[0]
            v.fail(
                op.done,
                f"publish op {op.invoke['op']} by {prod} to {topic} was acknowledged, but "
                f"{len(bad)} of its pings are stored other than once: ping n={n} {c} times",
            )
            continue
        # The acknowledgement told the truth: its offsets hold its pings.
        mine = set(_pings(op))
        for p, base, count in op.done.get("offsets", []):
            first, rows = fx.final.get((topic, p), (0, []))
            got = rows[base - first : base - first + count] if base >= first else []
            if len(got) != count or not set(got) <= mine:
                v.fail(
                    op.done,
                    f"publish op {op.invoke['op']} was acknowledged at partition {p} offsets "
                    f"{base}..{base + count - 1}, but the log holds other pings there",
                )
                break
    return v


def indeterminate_at_most_once(fx: Facts) -> Verdict:
    v = Verdict("indeterminate_at_most_once")
    if fx.final_topics is None:
        return v
    for op in fx.ops:
        if op.f != "publish" or op.type == "ok" or op.invoke["topic"] in fx.deleted:
            continue
        ev = op.done or op.invoke
        v.checked += 1
        limit = 0 if op.type == "fail" else 1
        over = [(ping, fx.counts[ping]) for ping in _pings(op) if fx.counts.get(ping, 0) > limit]
        if over:
            (prod, n), c = over[0]
            what = "certainly failed" if op.type == "fail" else "ended unknown"
            v.fail(
                ev,
                f"publish op {op.invoke['op']} by {prod} {what} "
                f"({ev.get('code', '?')}: {ev.get('reason', '')[:80]}), "
                f"yet ping n={n} is stored {c} times",
            )
    for (topic, p), (first, rows) in fx.final.items():
        if topic in fx.deleted:
            continue
        for k, (prod, n) in enumerate(rows):
            v.checked += 1
            if sender(fx, prod, n) is None:
                v.fail(
                    fx.final_events[(topic, p)],
                    f"{topic}/{p} offset {first + k} holds ping ({prod}, {n}) that nobody sent",
                )
                break
    return v


def producer_order(fx: Facts) -> Verdict:
    v = Verdict("producer_order")
    for (topic, p), (first, rows) in sorted(fx.final.items()):
        if topic in fx.deleted:
            continue
        last: dict[str, tuple[int, int]] = {}
        for k, (prod, n) in enumerate(rows):
            v.checked += 1
            prev = last.get(prod)
            if prev is not None and n <= prev[0]:
                op = sender(fx, prod, n)
                ev = (op.done or op.invoke) if op is not None else fx.final_events[(topic, p)]
                v.fail(
                    ev,
                    f"{topic}/{p}: producer {prod}'s ping n={n} at offset {first + k} comes "
                    f"after its ping n={prev[0]} at offset {prev[1]}",
                )
            last[prod] = (n, first + k)
    return v


def _read_rows(op: Op) -> Iterable[tuple[int, tuple[str, int]]]:
    assert op.done is not None
    for base, rows in op.done.get("batches", []):
        for k, (prod, n) in enumerate(rows):
            yield base + k, (str(prod), int(n))


def no_lost_reads(fx: Facts) -> Verdict:
    v = Verdict("no_lost_reads")
    if fx.final_topics is None:
        return v
    for op, done in fx.ok("read"):
        topic, p = op.invoke["topic"], int(op.invoke["partition"])
        if topic in fx.deleted:
            continue
        first, rows = fx.final.get((topic, p), (0, []))
        for offset, row in _read_rows(op):
            v.checked += 1
            if sender(fx, *row) is None:
                v.fail(done, f"a read of {topic}/{p} returned ping {row}, which nobody sent")
                break
            if offset < first:
                continue  # trimmed since
            if offset >= first + len(rows):
                v.fail(
                    done,
                    f"a read of {topic}/{p} returned ping {row} at offset {offset}, past the "
                    f"final end {first + len(rows)}: it was read, then lost",
                )
                break
            if rows[offset - first] != row:
                v.fail(
                    done,
                    f"a read of {topic}/{p} returned ping {row} at offset {offset}; the final "
                    f"log holds {rows[offset - first]} there: the log was rewritten",
                )
                break
    return v


def fenced_reads(fx: Facts) -> Verdict:
    v = Verdict("fenced_reads")
    # (topic, p) -> sorted (applied_index, end offset promised by that ack)
    promises: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
    for op in fx.ops:
        if op.f == "publish" and op.type == "ok":
            assert op.done is not None
            applied = int(op.done.get("applied_index", 0))
            part_index = op.done.get("part_index", {})
            for p, base, count in op.done.get("offsets", []):
                idx = int(part_index.get(str(p), applied))
                promises[(op.invoke["topic"], p)].append((idx, base + count))
    best: dict[tuple[str, int], tuple[list[int], list[int]]] = {}
    for key, items in promises.items():
        items.sort()
        running, ends = 0, []
        for _, end in items:
            running = max(running, end)
            ends.append(running)
        best[key] = ([i for i, _ in items], ends)
    for op in fx.ops:
        if op.f != "read" or op.type != "ok" or not op.invoke.get("fence"):
            continue
        assert op.done is not None
        key = (op.invoke["topic"], int(op.invoke["partition"]))
        if key[0] in fx.deleted:
            continue
        idxs, ends = best.get(key, ([], []))
        k = bisect.bisect_right(idxs, int(op.invoke["fence"])) - 1
        if k < 0:
            continue
        v.checked += 1
        seen_end = int(op.done.get("end_offset", 0))
        if seen_end < ends[k]:
            v.fail(
                op.done,
                f"a read of {key[0]}/{key[1]} fenced at index {op.invoke['fence']} saw the "
                f"partition end at {seen_end}, but a publish acknowledged at or below that "
                f"index ended at {ends[k]}",
            )
    return v


def reads_to_end(fx: Facts) -> Verdict:
    v = Verdict("reads_to_end")
    # (topic, p) -> (times acknowledged, ascending; the furthest end by then)
    acked: dict[tuple[str, int], list[tuple[float, int]]] = defaultdict(list)
    for op, done in fx.ok("publish"):
        for p, base, count in done.get("offsets", []):
            acked[(op.invoke["topic"], int(p))].append((float(done["t"]), base + count))
    best: dict[tuple[str, int], tuple[list[float], list[int]]] = {}
    for key, items in acked.items():
        items.sort()
        running, ends = 0, []
        for _, end in items:
            running = max(running, end)
            ends.append(running)
        best[key] = ([t for t, _ in items], ends)
    for op, done in fx.ok("read_end"):
        key = (op.invoke["topic"], int(op.invoke["partition"]))
        if key[0] in fx.deleted:
            continue
        times, ends = best.get(key, ([], []))
        k = bisect.bisect_left(times, float(op.invoke["t"])) - 1  # acknowledged strictly before
        if k < 0:
            continue
        v.checked += 1
        end = int(done.get("end_offset", 0))
        if end < ends[k]:
            v.fail(
                done,
                f"a read to the end of {key[0]}/{key[1]} begun at t={op.invoke['t']:.3f} saw "
                f"the end at {end} (fences {done.get('fences', {})}), but publishes "
                f"acknowledged before it began ended at {ends[k]}",
            )
    return v


def group_offsets(fx: Facts) -> Verdict:
    v = Verdict("group_offsets")
    ends = {key: first + len(rows) for key, (first, rows) in fx.final.items()}
    commits = sorted(
        (int(op.done.get("applied_index", 0)), k, op)
        for k, op in enumerate(fx.ops)
        if op.f == "commit" and op.type == "ok" and op.done is not None
    )
    last: dict[tuple[str, int], tuple[int, Op]] = {}
    for idx, _, op in commits:
        assert op.done is not None
        group, topic = op.invoke["group"], op.invoke["topic"]
        for p_raw, off in op.invoke.get("offsets", {}).items():
            p = int(p_raw)
            v.checked += 1
            prev = last.get((group, p))
            if prev is not None and off < prev[0]:
                v.fail(
                    op.done,
                    f"group {group} partition {p}: commit at index {idx} by "
                    f"{op.invoke['member']} moved the offset back from {prev[0]} (committed by "
                    f"{prev[1].invoke['member']}) to {off}",
                )
            last[(group, p)] = (off, op)
            end = ends.get((topic, p))
            if topic not in fx.deleted and end is not None and off > end:
                v.fail(op.done, f"group {group} committed offset {off} past the end {end} of p{p}")
    for op, done in fx.ok("describe_group"):
        topic = op.invoke["topic"]
        for p_raw, off in done.get("offsets", {}).items():
            v.checked += 1
            end = ends.get((topic, int(p_raw)))
            if topic not in fx.deleted and end is not None and off > end:
                v.fail(
                    done,
                    f"group {op.invoke['group']} shows offset {off} past the end {end} "
                    f"of partition {p_raw}",
                )
    return v


def topics(fx: Facts) -> Verdict:
    v = Verdict("topics")
    if fx.final_topics is None:
        return v
    tried_delete = {op.invoke["topic"] for op in fx.ops if op.f == "delete_topic"}
    for op, done in fx.ok("create_topic", "delete_topic"):
        name = op.invoke["topic"]
        v.checked += 1
        if op.f == "create_topic" and name not in tried_delete and name not in fx.final_topics:
            v.fail(done, f"topic {name} was created (acknowledged) but is gone at the end")
        if op.f == "delete_topic" and done.get("deleted") and name in fx.final_topics:
            v.fail(done, f"topic {name} was deleted (acknowledged) but exists at the end")
    return v


_ENOUGH_YET = re.compile(r"has contributed (\d+) ping\(s\) over ([\d.e+-]+) s")


def give_to_get(fx: Facts) -> Verdict:
    v = Verdict("give_to_get")
    # A publish's indexes: group 0's (``applied_index``) under "0", each data
    # group's it wrote under its own; a read fenced at or past any one of
    # them must see the contribution that group recorded.
    acked: dict[tuple[str, str], list[tuple[float, dict[str, int], int]]] = defaultdict(list)
    tried: dict[tuple[str, str], list[tuple[float, int]]] = defaultdict(list)
    for op in fx.ops:
        if op.f == "publish":
            key = (op.invoke["producer"], op.invoke["topic"])
            pings = int(op.invoke.get("n1", 1)) - int(op.invoke.get("n0", 0))
            tried[key].append((float(op.invoke["t"]), pings))
            if op.type == "ok" and op.done is not None:
                index = {"0": int(op.done.get("applied_index", 0)), **op.done.get("fences", {})}
                acked[key].append(
                    (float(op.done["t"]), {g: int(i) for g, i in index.items() if i}, pings)
                )
    for op, done in fx.ok("heatmap"):
        key = (op.invoke["client"], op.invoke["topic"])
        t = float(op.invoke["t"])
        fence = {"0": int(op.invoke.get("fence", 0)), **op.invoke.get("fences", {})}
        half = op.invoke.get("window_ms", 900_000) / 2000
        # Histories from before the minimum: any contribution counted.
        min_pings, min_seconds = op.invoke.get("min_pings", 1), op.invoke.get("min_seconds", 0)
        v.checked += 1
        if done.get("allowed"):
            if key not in tried:
                v.fail(done, f"{key[0]} never published to {key[1]}, yet read its heat map")
                continue
            sent = sum(n for at, n in tried[key] if at <= float(done["t"]))
            if sent < min_pings:
                v.fail(
                    done,
                    f"{key[0]} read the heat map of {key[1]} after sending {sent} ping(s), "
                    f"fewer than the {min_pings} a contribution needs",
                )
            continue
        recent = [
            (at, index, n)
            for at, index, n in acked[key]
            if at <= t and t - at < half and any(i <= fence.get(g, 0) for g, i in index.items())
        ]
        if not recent:
            continue
        reason = str(done.get("reason", ""))
        counted = _ENOUGH_YET.search(reason)
        if counted is None:  # refused as one that has not published lately
            v.fail(
                done,
                f"{key[0]} was refused the heat map of {key[1]} "
                f"{t - max(at for at, _, _ in recent):.1f} s after a publish of its was "
                f"acknowledged: {reason[:160]}",
            )
            continue
        told, spanned = int(counted.group(1)), float(counted.group(2))
        whole = [n for _, index, n in recent if all(i <= fence.get(g, 0) for g, i in index.items())]
        if told < sum(whole):
            v.fail(
                done,
                f"{key[0]}'s contribution to {key[1]} was told as {told} ping(s), but "
                f"{sum(whole)} were acknowledged and fenced in the last {half:.0f} s",
            )
        elif told >= min_pings and spanned >= min_seconds:
            v.fail(
                done,
                f"{key[0]} was refused the heat map of {key[1]} with a contribution that "
                f"qualifies ({told} pings over {spanned:g} s): {reason[:160]}",
            )
    return v


def membership(fx: Facts) -> Verdict:
    v = Verdict("membership")
    config = next((ev for ev in fx.events if ev.get("f") == "config"), None)
    if config is None:
        return v
    members = set(config.get("voters", [])) | set(config.get("learners", []))
    last: dict[int, Op] = {}
    for op in fx.ops:
        if op.f in ("add_node", "remove_node") and op.invoke["i"] < config["i"]:
            last[int(op.invoke["node"])] = op
    for node, op in sorted(last.items()):
        if op.type != "ok":
            continue  # unknown: either way is right
        v.checked += 1
        assert op.done is not None
        if op.f == "add_node" and node not in members:
            v.fail(op.done, f"adding node {node} was acknowledged, yet the configuration "
                            f"found at the end lacks it: {sorted(members)}")  # fmt: skip
        if op.f == "remove_node" and node in members:
            v.fail(op.done, f"removing node {node} was acknowledged, yet the configuration "
                            f"found at the end has it: {sorted(members)}")  # fmt: skip
    return v


def replicas_identical(fx: Facts) -> Verdict:
    v = Verdict("replicas_identical")
    evs = [ev for ev in fx.events if ev.get("f") == "digests" and ev["type"] != "invoke"]
    if not evs:
        v.fail(fx.events[-1] if fx.events else {}, "no digests were taken at the end")
    for ev in evs:
        v.checked += 1
        nodes: dict[str, Any] = ev.get("nodes", {})
        answered = {k: tuple(d) for k, d in nodes.items() if d}
        if len(answered) != len(nodes):
            silent = sorted(k for k, d in nodes.items() if not d)
            v.fail(ev, f"node(s) {', '.join(silent)} gave no digest of group {ev.get('group', 0)}")
        elif len(set(answered.values())) != 1:
            desc = ", ".join(f"n{k}: index {d[0]} {str(d[1])[:12]}" for k, d in answered.items())
            v.fail(ev, f"replicas of group {ev.get('group', 0)} differ at the end: {desc}")
    return v


def processes_alive(fx: Facts) -> Verdict:
    v = Verdict("processes_alive")
    for ev in fx.events:
        if ev.get("f") in ("alive", "crashed") and ev["type"] != "invoke":
            v.checked += 1
            dead = ev.get("dead", {})
            if dead:
                names = ", ".join(sorted(dead))
                tail = next(iter(dead.values()))
                v.fail(ev, f"{names} not running though it should: {str(tail)[-300:]}")
    return v


CHECKS = {
    "acked_exactly_once": acked_exactly_once,
    "indeterminate_at_most_once": indeterminate_at_most_once,
    "producer_order": producer_order,
    "no_lost_reads": no_lost_reads,
    "fenced_reads": fenced_reads,
    "reads_to_end": reads_to_end,
    "group_offsets": group_offsets,
    "topics": topics,
    "give_to_get": give_to_get,
    "membership": membership,
    "replicas_identical": replicas_identical,
    "processes_alive": processes_alive,
}


@dataclass
class Report:
    verdicts: dict[str, Verdict]
    faults: Counter[str]
    ops: Counter[str]
    skipped: int = 0  # faults of the schedule left out (no target, or a known finding)

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts.values())

    def failures(self) -> list[Failure]:
        return [f for v in self.verdicts.values() for f in v.failures[:3]]

    def line(self) -> str:
        """The one line a run ends with."""
        faults = " ".join(f"{k}={c}" for k, c in sorted(self.faults.items()))
        ops = " ".join(f"{k}={c}" for k, c in sorted(self.ops.items()))
        verdicts = " ".join(
            f"{name}={'ok' if v.ok else 'FAIL'}({v.checked if v.ok else v.failed})"
            for name, v in self.verdicts.items()
        )
        return (
            f"faults {sum(self.faults.values())} (+{self.skipped} skipped) [{faults}] | "
            f"ops {sum(self.ops.values())} [{ops}] | {verdicts} | "
            f"{'PASS' if self.ok else 'FAIL'}"
        )


def check(events: list[Event]) -> Report:
    """Every property over the history."""
    fx = facts(events)
    verdicts = {name: fn(fx) for name, fn in CHECKS.items()}
    faults: Counter[str] = Counter(
        ev["kind"] for ev in fx.events if ev.get("f") == "nemesis" and ev.get("phase") == "start"
    )
    ops: Counter[str] = Counter(op.f for op in fx.ops)
    skipped = sum(1 for ev in fx.events if ev.get("f") == "nemesis" and ev.get("phase") == "skip")
    return Report(verdicts, faults, ops, skipped)


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.nemesis.checker RUN_DIR/history.jsonl``: check a
    stored history again."""
    import sys
    from pathlib import Path

    from tests.nemesis.history import load

    args = sys.argv[1:] if argv is None else argv
    report = check(load(Path(args[0])))
    for f in report.failures():
        print(f)
    print(report.line())
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
