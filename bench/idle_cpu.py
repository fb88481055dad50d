"""Idle CPU: what a default cluster (3 nodes, 1 queue server, TLS, one data
group per voter, worker processes) spends doing nothing. The cluster starts,
settles for ``--settle`` seconds, then each process's user + system CPU is
read from /proc over ``--seconds``, per round; the figures are cores (1.0 is
one core kept busy): the whole cluster, and per process kind (node main
process, worker process, queue server: the mean of each kind and the sum).
Also each kind's wake-ups a second (voluntary context switches of all its
threads, from /proc): a figure that, unlike CPU time, does not grow with
what else the machine runs.
Extra arguments after ``--`` go to every node. Writes
bench/results/idle_cpu.json (or ``--name``).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import write_result
from bench.cpu import CpuMeter, spawned_children
from roadlog.tools.localcluster import LocalCluster


def processes(lc: LocalCluster) -> dict[str, int]:
    """label -> pid: each node's main process (``node1``), its worker
    processes (``node1.w0``, ...) and each queue server (``queue0``)."""
    out: dict[str, int] = {}
    for n in lc.nodes:
        assert n.pid is not None
        out[f"node{n.id}"] = n.pid
        for k, pid in enumerate(spawned_children(n.pid)):
            out[f"node{n.id}.w{k}"] = pid
    for k, q in enumerate(lc.queue_servers):
        assert q.pid is not None
        out[f"queue{k}"] = q.pid
    return out


def wakeups(pid: int) -> int:
    """Voluntary context switches of every thread of ``pid`` so far (each
    one a sleep, so a wake-up after it); ProcessLookupError when gone."""
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    for t in tasks:
        try:
            for line in (t / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
        except OSError:
            pass  # a thread that just exited
    return total


def kind_of(label: str) -> str:
    if label.startswith("queue"):
        return "queue_server"
    return "worker" if ".w" in label else "node_main"


def by_kind(cores: dict[str, float]) -> dict[str, dict[str, float]]:
    kinds: dict[str, list[float]] = {}
    for label, c in cores.items():
        kinds.setdefault(kind_of(label), []).append(c)
    return {
        k: {"processes": len(v), "mean": round(statistics.mean(v), 4), "sum": round(sum(v), 4)}
        for k, v in sorted(kinds.items())
    }


def measure(extra: list[str], settle: float, seconds: float, rounds: int) -> dict[str, Any]:
    d = Path(tempfile.mkdtemp(prefix="roadlog-idle-", dir="/var/tmp"))
    lc = LocalCluster.create(d / "c", 3, 1, extra, data_groups=None)
    lc.start_all()
    try:
        lc.wait_ready(60)
        time.sleep(settle)
        pids = processes(lc)
        totals: list[float] = []
        per: dict[str, list[float]] = {label: [] for label in pids}
        woke: dict[str, list[float]] = {label: [] for label in pids}
        for r in range(rounds):
            meter = CpuMeter(pids)
            w0 = {label: wakeups(pid) for label, pid in pids.items()}
            t0 = time.perf_counter()
            meter.start()
            time.sleep(seconds)
            cores = meter.stop(0)["cores"]
            elapsed = time.perf_counter() - t0
            for label, pid in pids.items():
                woke[label].append((wakeups(pid) - w0[label]) / elapsed)
            totals.append(sum(cores.values()))
            for label, c in cores.items():
                per[label].append(c)
            print(f"round {r + 1}: {totals[-1]:.3f} cores idle", file=sys.stderr, flush=True)
        median = {label: round(statistics.median(v), 4) for label, v in per.items()}
        woke_median = {label: round(statistics.median(v), 1) for label, v in woke.items()}
        return {
            "node_args": extra,
            "seconds": seconds,
            "rounds": rounds,
            "cores_total_median": round(statistics.median(totals), 4),
            "cores_total_all": [round(t, 4) for t in totals],
            "by_kind": by_kind(median),
            "by_process": median,
            "wakeups_per_s_by_kind": by_kind(woke_median),
            "wakeups_per_s_by_process": woke_median,
        }
    finally:
        lc.down(grace=1)
        shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=30.0, help="length of one measured round")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--settle", type=float, default=20.0, help="idle seconds before measuring")
    ap.add_argument("--name", default="idle_cpu", help="result file name (bench/results/NAME.json)")
    ap.add_argument("node_args", nargs=argparse.REMAINDER, help="-- then extra node arguments")
    args = ap.parse_args(argv)
    extra = args.node_args[1:] if args.node_args[:1] == ["--"] else list(args.node_args)
    figures = measure(extra, args.settle, args.seconds, args.rounds)
    print(
        f"{extra}: {figures['cores_total_median']:.3f} cores idle; {figures['by_kind']}",
        file=sys.stderr,
    )
    print(write_result(args.name, figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
