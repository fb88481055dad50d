"""Where the write path's CPU goes: one ingest case of ``bench/ingest.py``
(a fresh 3-node local cluster, 32 corked publishers) with py-spy sampling
the queue server, the leader and one follower at once, and the main
thread's functions of each ranked by share of its samples.

    python -m bench.profile_write_path --system roadlog --batch 100 --seconds 20 --out /tmp/wp

With ``--groups G`` (multi-raft, issue 18): topics placed in G data groups
and each publisher sending one group's devices straight to its leader (the
fast path of ``bench/ingest.py --groups G``); every node is sampled (each
leads a share of the groups) beside the queue server, and with
``--workers`` other than 1 each node's worker processes too.

Writes the raw stacks (``py-spy record --format raw``, with ``--gil``: only
samples that hold the GIL, so time a thread spends waiting is left out) to
OUT/<process>.txt and prints, per process, the functions with the largest
inclusive and self shares, and the case's figures (pings/s, CPU-s per
million pings, each process's share of a core). Shares under load are
comparable between runs; absolute CPU is what ``bench/ingest.py`` measures.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

from bench.ingest import SYSTEMS, roadlog_case, roadlog_meter, topic_groups, wait_spread
from bench.peers import roadlog_cluster
from roadlog.runtime import eventloop

_LINE = re.compile(r" \((.*?):\d+\)")


def shares(raw: Path) -> tuple[int, Counter[str], Counter[str]]:
    """Total samples, and inclusive and self samples per function (its
    name and file, the line left out)."""
    incl: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_LINE.sub(r" (\1)", f) for f in stack.split(";")]
        for f in set(frames):
            incl[f] += n
        own[frames[-1]] += n
    return total, incl, own


def report(raw: Path, top: int) -> str:
    total, incl, own = shares(raw)
    if not total:
        return f"{raw.stem}: no samples"
    lines = [f"== {raw.stem}: {total} samples holding the GIL"]
    skip = ("runpy", "click/", "eventloop.py", "uvloop/__init__", "asyncio/runners", "main.py")
    lines.append("-- inclusive")
    shown = 0
    for f, n in incl.most_common():
        if any(s in f for s in skip):
            continue
        lines.append(f"{100 * n / total:5.1f}%  {f[:140]}")
        shown += 1
        if shown == top:
            break
    lines.append("-- self")
    for f, n in own.most_common(top):
        lines.append(f"{100 * n / total:5.1f}%  {f[:140]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--system", default="roadlog", choices=[s for s in SYSTEMS if s != "jetstream"])
    ap.add_argument("--batch", type=int, default=100, help="pings per publish")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--groups", type=int, default=1, help="data groups (multi-raft), fast route")
    ap.add_argument("--workers", type=int, default=1, help="with --groups: worker processes")
    ap.add_argument(
        "--split",
        action="store_true",
        help="with --groups: messages of every group's devices, split at the queue server "
        "(as bench/ingest.py --split), instead of one group's each",
    )
    args = ap.parse_args(argv)
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(pyspy).exists():
        sys.exit(
            f"py-spy is not installed (a profiling tool, not in the lock): "
            f"{sys.executable} -m pip install py-spy"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    node_args, queue_args = SYSTEMS[args.system]
    if args.groups > 1:
        node_args = [
            *node_args, "--data-groups", str(args.groups), "--place-topics",
            "--workers", str(args.workers),
        ]  # fmt: skip
    with roadlog_cluster(extra=node_args, queue_extra=queue_args) as lc:
        leader = lc.status()["leader"]
        pids = {"queue": lc.queue_servers[0].pid}
        groups: list[int] = []
        if args.groups > 1:
            wait_spread(lc, args.groups)
            groups = [] if args.split else topic_groups(lc)
            pids.update({f"n{n.id}": n.pid for n in lc.nodes})  # each leads its share
            for n in lc.nodes:  # and its worker processes, which run the data groups
                for i, child in enumerate(_children(n.pid)):
                    pids[f"n{n.id}-worker{i}"] = child
        else:
            for n in lc.nodes:
                if n.id == leader:
                    pids["leader"] = n.pid
                elif "follower" not in pids:
                    pids["follower"] = n.pid
        print(f"warming up, then sampling {sorted(pids)} for {args.seconds:.0f} s", flush=True)
        eventloop.run(
            roadlog_case(
                lc.servers, args.batch, args.concurrency, 3.0, tls=lc.tls(), partition_groups=groups
            )
        )
        spies = []
        for name, pid in pids.items():
            cmd = [pyspy, "record", "--pid", str(pid), "--duration", str(int(args.seconds) - 2),
                   "--rate", str(args.rate), "--format", "raw", "--nonblocking", "--gil",
                   "-o", str(args.out / f"{name}.txt")]  # fmt: skip
            spies.append(
                subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        case = eventloop.run(
            roadlog_case(
                lc.servers,
                args.batch,
                args.concurrency,
                args.seconds,
                roadlog_meter(lc),
                tls=lc.tls(),
                partition_groups=groups,
            )
        )
        for spy in spies:
            spy.wait(timeout=120)
    figures = {k: v for k, v in case.items() if not isinstance(v, list)}
    (args.out / "case.json").write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures))
    for name in pids:
        raw = args.out / f"{name}.txt"
        print(report(raw, args.top) if raw.exists() else f"{name}: py-spy wrote nothing")
    return 0


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (a node's worker processes)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return sorted(int(c) for c in text.split())


if __name__ == "__main__":
    raise SystemExit(main())
