"""What one replication round costs in CPU, process by process: ingest
cases of ``bench/ingest.py`` (a fresh local cluster, corked publishers)
with each server process's user and system CPU read from /proc over the
timed window, divided by the calls the leaders took (one call of corked
publishes is one round of its group's log).

    python -m bench.round_cost --cases 1x5,1x32,6x32 --seconds 8

A case ``GxC`` is G data groups (the fast route, ``--workers 1``) and C
publishers. At 100 pings a message a round's CPU hardly depends on how many
publishes it carries, so the cost of a round is what sets pings/s per core
there, and G groups pay it G times as often (bench/profiles/write-path.md,
session 26). Writes bench/results/round_cost.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from bench.common import write_result
from bench.cpu import user_sys
from bench.ingest import roadlog_case, topic_groups, wait_spread
from bench.peers import roadlog_cluster
from roadlog.runtime import eventloop


def per_round(
    before: dict[str, tuple[float, float]],
    after: dict[str, tuple[float, float]],
    seconds: float,
    rounds: int,
) -> dict[str, dict[str, float]]:
    """Per process: its share of a core (user, system) over ``seconds`` and
    its CPU-milliseconds per round (user, system, both)."""
    out: dict[str, dict[str, float]] = {}
    for name, (u0, s0) in before.items():
        u1, s1 = after[name]
        du, ds = u1 - u0, s1 - s0
        out[name] = {
            "user_cores": round(du / seconds, 3),
            "sys_cores": round(ds / seconds, 3),
            "user_ms_per_round": round(1000 * du / max(rounds, 1), 3),
            "sys_ms_per_round": round(1000 * ds / max(rounds, 1), 3),
            "ms_per_round": round(1000 * (du + ds) / max(rounds, 1), 3),
        }
    return out


def parse_case(text: str) -> tuple[int, int]:
    """``GxC`` as (groups, publishers)."""
    g, sep, c = text.partition("x")
    if not sep or not g.isdigit() or not c.isdigit() or int(g) < 1 or int(c) < 1:
        raise argparse.ArgumentTypeError(f"a case is GROUPSxPUBLISHERS, like 6x32: {text!r}")
    return int(g), int(c)


def one_case(groups: int, publishers: int, pings: int, seconds: float) -> dict[str, Any]:
    extra = ["--data-groups", str(groups), "--place-topics", "--workers", "1"]
    with roadlog_cluster(extra=extra if groups > 1 else []) as lc:
        placed: list[int] = []
        if groups > 1:
            wait_spread(lc, groups)
            placed = topic_groups(lc)
        leader = lc.status()["leader"]
        pids = {
            f"node_{n.id}" + ("_leader" if n.id == leader and groups == 1 else ""): n.pid
            for n in lc.nodes
        }
        pids.update({f"queue_server_{i + 1}": q.pid for i, q in enumerate(lc.queue_servers)})
        warm = roadlog_case(
            lc.servers, pings, publishers, 2.0, tls=lc.tls(), partition_groups=placed
        )
        eventloop.run(warm)
        before = {k: user_sys(p) for k, p in pids.items()}
        t0 = time.monotonic()
        out = eventloop.run(
            roadlog_case(
                lc.servers, pings, publishers, seconds, tls=lc.tls(), partition_groups=placed
            )
        )
        took = time.monotonic() - t0
        after = {k: user_sys(p) for k, p in pids.items()}
    rounds = round(out["messages"] / max(out.get("publishes_per_call", 1.0), 1.0))
    procs = per_round(before, after, took, rounds)
    return {
        "groups": groups,
        "publishers": publishers,
        "pings_per_message": pings,
        "pings_per_s": out["pings_per_s"],
        "ack_p50_ms": out["ack_p50_ms"],
        "publishes_per_round": out.get("publishes_per_call"),
        "rounds_per_s": round(rounds / took, 1),
        "server_ms_per_round": round(sum(p["ms_per_round"] for p in procs.values()), 3),
        "processes": procs,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cases", default="1x5,1x32,6x32", help="GROUPSxPUBLISHERS, comma-separated")
    ap.add_argument("--batch", type=int, default=100, help="pings per publish")
    ap.add_argument("--seconds", type=float, default=8.0)
    args = ap.parse_args(argv)
    cases = [parse_case(c) for c in args.cases.split(",") if c]
    results = []
    for i, (g, c) in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {g} group(s), {c} publishers ...", file=sys.stderr, flush=True)
        r = one_case(g, c, args.batch, args.seconds)
        print(
            f"  {r['pings_per_s']:.0f} pings/s, {r['rounds_per_s']} rounds/s of "
            f"{r['publishes_per_round']} publishes, {r['server_ms_per_round']} server CPU-ms "
            "per round",
            file=sys.stderr,
            flush=True,
        )
        results.append(r)
    path = write_result("round_cost", {"cases": results})
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
