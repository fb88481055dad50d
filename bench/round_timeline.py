"""Where a replication round's latency goes: one ingest case of
``bench/ingest.py`` (a fresh 3-node local cluster, 32 corked publishers)
with every process tracing its hops (``roadlog.round_trace``), and
the median time of each hop in a round, from the leader taking a call of
publishes from the queue server (``L.work_in``) to taking the next one.

    python -m bench.round_timeline --batch 100 --seconds 6

Processes: ``L`` the leader, ``F0``/``F1`` the followers, ``q_`` the queue
server, ``c_`` this client. Hops: ``validate0/1`` the leader's validation of
the call's publishes; ``propose``; ``peer_out``/``peer_in`` Raft frames out
and in; ``log0/1`` a log write (``written``: a thread's write reported on
the loop); ``apply0/1`` an inline apply; ``store0/1`` the store of
entries answered as they committed (after the answer); ``result``/``answer_out`` the
call's answer made and sent; ``q_result_in``, ``q_answer_out``,
``q_req_in``, ``q_work_out`` the queue server's; ``c_answer_in``,
``c_write`` the client's. Writes bench/results/round_timeline.json.
Tracing costs a little; the case's pings/s is printed, not recorded as a
figure of the system.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.common import write_result
from bench.ingest import roadlog_case
from bench.peers import roadlog_cluster
from roadlog import round_trace
from roadlog.runtime import eventloop

ROUND_GAP_NS = 20_000_000  # a gap longer than this between calls is not a round


def load(directory: Path) -> dict[int, list[tuple[int, str]]]:
    out: dict[int, list[tuple[int, str]]] = {}
    for f in directory.glob("*.marks"):
        rows = []
        for line in f.read_text().splitlines():
            t, _, tag = line.partition(" ")
            rows.append((int(t), tag))
        out[int(f.stem)] = rows
    return out


def timeline(marks: dict[int, list[tuple[int, str]]]) -> dict[str, Any]:
    """Median ms of each hop after the leader's ``work_in``, over the rounds
    (one leader ``work_in`` to the next), and the share of rounds it is in."""

    def count(p: int, tag: str) -> int:
        return sum(1 for _, g in marks[p] if g == tag)

    leader = max(marks, key=lambda p: count(p, "work_in"))
    labels = {leader: "L."}
    followers = [
        p for p in marks if p != leader and count(p, "peer_in") and not count(p, "q_req_in")
    ]
    for i, p in enumerate(sorted(followers)):
        labels[p] = f"F{i}."
    events = sorted((t, labels.get(p, "") + tag) for p, rows in marks.items() for t, tag in rows)
    times = [t for t, _ in events]
    starts = [t for t, tag in events if tag == "L.work_in"]
    hops: dict[str, list[float]] = {}
    rounds = 0
    for a, b in itertools.pairwise(starts):
        if b - a > ROUND_GAP_NS:
            continue
        rounds += 1
        seen: dict[str, float] = {}
        for t, tag in events[bisect.bisect_left(times, a) : bisect.bisect_left(times, b)]:
            key, n = tag, 1
            while key in seen:
                n += 1
                key = f"{tag}#{n}"
            seen[key] = (t - a) / 1e6
        seen["next L.work_in"] = (b - a) / 1e6
        for k, v in seen.items():
            hops.setdefault(k, []).append(v)
    rows: list[dict[str, Any]] = [
        {
            "hop": k,
            "median_ms": round(statistics.median(v), 3),
            "in_rounds": round(len(v) / rounds, 2),
        }
        for k, v in hops.items()
        if rounds and len(v) >= rounds / 2
    ]
    rows.sort(key=lambda r: float(r["median_ms"]))
    return {"rounds": rounds, "hops": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=100, help="pings per publish")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="roadlog-trace-") as d:
        os.environ[round_trace.ENV] = d  # the daemons started from here trace too
        round_trace.start(d)
        with roadlog_cluster() as lc:
            print(
                f"tracing one case of {args.batch} pings per publish for {args.seconds:.0f} s",
                flush=True,
            )
            case = eventloop.run(
                roadlog_case(lc.servers, args.batch, args.concurrency, args.seconds, tls=lc.tls())
            )
        round_trace.dump()
        del os.environ[round_trace.ENV]
        result = timeline(load(Path(d)))
    print(f"{case['pings_per_s'] / 1e3:.0f}k pings/s while tracing; {result['rounds']} rounds")
    for r in result["hops"]:
        print(f"  {r['hop']:22s} {r['median_ms']:7.3f} ms  (in {r['in_rounds']:.0%} of rounds)")
    write_result(
        "round_timeline",
        {
            "batch": args.batch,
            "concurrency": args.concurrency,
            "pings_per_s_traced": case["pings_per_s"],
            **result,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
