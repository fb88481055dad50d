"""The Raft core alone: commits/s of a 3-node in-process cluster with
instant delivery and the in-memory store (no fsync, no network).

Two shapes: one proposal at a time, each waited for until committed on the
leader (latency-bound: the rounds a commit takes), and proposals in batches
of 100 per stabilisation (pipelined throughput). Writes
bench/results/core_commits.json.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

from bench.common import write_result
from node_daemon.raft import Config, MemoryStorage, Message, RaftCore, Role, bootstrap


class InstantCluster:
    def __init__(self, n: int) -> None:
        voters = list(range(1, n + 1))
        self.stores = {i: MemoryStorage() for i in voters}
        for s in self.stores.values():
            bootstrap(s, voters)
        self.cores = {i: RaftCore(Config(i), self.stores[i], random.Random(i)) for i in voters}
        self.cores[1].campaign()
        self.stabilize()
        assert self.cores[1].role == Role.LEADER

    def stabilize(self) -> None:
        while True:
            queue: list[Message] = []
            for i, c in self.cores.items():
                while c.has_ready():
                    rd = c.ready()
                    self.stores[i].save(rd.hard_state, rd.entries, rd.snapshot, rd.must_sync)
                    queue.extend(rd.messages)
                    c.advance(rd)
            if not queue:
                return
            for m in queue:
                self.cores[m.to].step(m)


def run(batch: int, seconds: float, payload: bytes) -> dict[str, Any]:
    cl = InstantCluster(3)
    leader = cl.cores[1]
    start_commit = leader.log.committed
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while time.perf_counter() < deadline:
        leader.propose_many([payload] * batch)
        cl.stabilize()
    elapsed = time.perf_counter() - t0
    commits = leader.log.committed - start_commit
    assert all(c.log.committed == leader.log.committed for c in cl.cores.values())
    return {
        "proposals_per_round": batch,
        "commits_per_s": round(commits / elapsed, 1),
        "us_per_commit": round(1e6 * elapsed / commits, 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=3.0, help="per case")
    args = ap.parse_args(argv)
    payload = bytes(40 * 100)  # an entry carrying 100 pings
    cases = []
    for batch in (1, 100):
        r = run(batch, args.seconds, payload)
        cases.append(r)
        print(
            f"{batch:>4} proposals/round: {r['commits_per_s']:>10.0f} commits/s "
            f"({r['us_per_commit']} us each)",
            file=sys.stderr,
            flush=True,
        )
    out = write_result("core_commits", {"nodes": 3, "entry_bytes": len(payload), "cases": cases})
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
