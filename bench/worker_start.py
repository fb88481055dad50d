"""How fast a node's worker processes start (issue 41): a default cluster
(``LocalCluster.create`` with the product's data groups: one per voter,
in worker processes) from its start to ``wait_ready``, each worker's time
from the pool starting it ("worker process started", logged as the fork
or spawn returns) to its own "worker started", and its CPU-seconds by
then (/proc, read once the cluster is ready: its start and the few idle
seconds after). With ``--restart``, one worker SIGKILLed and the time
until its successor says "worker started" (the pool waits RESTART_FIRST_S
before it starts one again: that wait is in the figure).

    python -m bench.worker_start --rounds 3 --out /tmp/ws.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.cpu import cpu_seconds, spawned_children
from roadlog.tools.localcluster import LocalCluster


def _ts(doc: dict[str, Any]) -> float:
    return datetime.strptime(doc["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").timestamp()


def worker_starts(log: Path) -> list[dict[str, Any]]:
    """Each worker start in a node's log: worker, pid, seconds from the pool's
    "worker process started" to the worker's "worker started"."""
    pending: dict[int, dict[str, Any]] = {}
    out = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if not isinstance(doc, dict):
            continue
        if doc.get("msg") == "worker process started":
            pending[int(doc["worker"])] = {
                "worker": int(doc["worker"]),
                "pid": doc.get("pid"),
                "how": doc.get("how", "spawned"),
                "at": _ts(doc),
            }
        elif doc.get("msg") == "worker started" and int(doc.get("worker", -1)) in pending:
            start = pending.pop(int(doc["worker"]))
            start["start_s"] = round(_ts(doc) - start.pop("at"), 3)
            if "cpu_s" in doc:
                start["cpu_s_logged"] = doc["cpu_s"]
            out.append(start)
    return out


def one_round(restart: bool, data_groups: int | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ws-") as d:
        lc = LocalCluster.create(Path(d), nodes=3, data_groups=data_groups)
        t0 = time.monotonic()
        lc.start_all()
        try:
            lc.wait_ready(timeout=180)
            ready_s = time.monotonic() - t0
            want = sum(len(spawned_children(n.pid)) for n in lc.nodes)
            deadline = time.monotonic() + 60  # the last "worker started" may follow readiness
            while time.monotonic() < deadline:
                if sum(len(worker_starts(Path(n.log))) for n in lc.nodes) >= want:
                    break
                time.sleep(0.05)
            cpu = {}
            for n in lc.nodes:
                for pid in spawned_children(n.pid):
                    with contextlib.suppress(ProcessLookupError):
                        cpu[pid] = round(cpu_seconds(pid), 3)
            starts = [s for n in lc.nodes for s in worker_starts(Path(n.log))]
            for s in starts:
                s["cpu_s"] = cpu.get(s["pid"])
            out: dict[str, Any] = {"ready_s": round(ready_s, 3), "workers": starts}
            if restart and spawned_children(lc.nodes[0].pid):
                node = lc.nodes[0]
                victim = spawned_children(node.pid)[0]
                before = len(worker_starts(Path(node.log)))
                t1 = time.monotonic()
                os.kill(victim, signal.SIGKILL)
                deadline = t1 + 120
                while time.monotonic() < deadline:
                    if len(worker_starts(Path(node.log))) > before:
                        out["restart_s"] = round(time.monotonic() - t1, 3)
                        out["restarted"] = worker_starts(Path(node.log))[-1]
                        break
                    time.sleep(0.02)
            return out
        finally:
            lc.down()


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def stats(xs: list[float]) -> dict[str, float]:
        xs = sorted(x for x in xs if x is not None)
        if not xs:
            return {}
        return {
            "median": round(statistics.median(xs), 3),
            "min": xs[0],
            "max": xs[-1],
            "n": len(xs),
        }

    starts = [w for r in rounds for w in r["workers"]]
    return {
        "ready_s": stats([r["ready_s"] for r in rounds]),
        "worker_start_s": stats([w["start_s"] for w in starts]),
        "worker_cpu_s": stats([w["cpu_s"] for w in starts]),
        "restart_s": stats([r["restart_s"] for r in rounds if "restart_s" in r]),
        "how": sorted({w["how"] for w in starts}),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--restart", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--data-groups", type=int, help="default: the product's (one per voter)")
    args = ap.parse_args()
    rounds = [one_round(args.restart, args.data_groups) for _ in range(args.rounds)]
    doc = {"load": os.getloadavg(), "rounds": rounds, "summary": summary(rounds)}
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    json.dump(doc["summary"], sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
