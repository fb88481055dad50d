"""What G groups' log appends cost on one node when each group has its own
LMDB environment (one synced commit per group, as roadlog does: issue 18
asks for an environment per group) against one environment that holds the
G logs as named databases (one synced commit for all of them, as TiKV's
raft engine or CockroachDB's shared WAL do).

    python -m bench.log_envs --groups 1,3,6 --rounds 400

A round appends one entry (``--entry-bytes``, the size of a 100-ping call
of 32 publishes is about 100 KB; of 5, about 16 KB) to every group's log.
CPU is this process's user + system time. Writes bench/results/log_envs.json.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lmdb

from bench.common import write_result

_KEY = struct.Struct(">Q")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _open(path: Path, max_dbs: int) -> lmdb.Environment:
    return lmdb.open(str(path), map_size=1 << 30, max_dbs=max_dbs, sync=True, metasync=True)


def separate(d: Path, groups: int, rounds: int, entry: bytes) -> tuple[float, float]:
    """Wall and CPU seconds: an environment per group, a commit each."""
    envs = [_open(d / f"sep{g}", 4) for g in range(groups)]
    dbs = [e.open_db(b"log") for e in envs]
    t, c = time.perf_counter(), _cpu()
    for i in range(rounds):
        for env, db in zip(envs, dbs, strict=True):
            with env.begin(write=True, db=db) as txn:
                txn.put(_KEY.pack(i), entry)
    took, cpu = time.perf_counter() - t, _cpu() - c
    for env in envs:
        env.close()
    return took, cpu


def shared(d: Path, groups: int, rounds: int, entry: bytes) -> tuple[float, float]:
    """Wall and CPU seconds: one environment, one commit for every group."""
    env = _open(d / "shared", groups + 4)
    dbs = [env.open_db(b"log%d" % g) for g in range(groups)]
    t, c = time.perf_counter(), _cpu()
    for i in range(rounds):
        with env.begin(write=True) as txn:
            for db in dbs:
                txn.put(_KEY.pack(i), entry, db=db)
    took, cpu = time.perf_counter() - t, _cpu() - c
    env.close()
    return took, cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--groups", default="1,3,6")
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--entry-bytes", type=int, default=16 * 1024)
    args = ap.parse_args(argv)
    entry = os.urandom(args.entry_bytes)
    cases: list[dict[str, Any]] = []
    for g in [int(x) for x in args.groups.split(",") if x]:
        for layout, run in (("separate", separate), ("shared", shared)):
            d = Path(tempfile.mkdtemp(prefix="roadlog-log-envs-", dir="/var/tmp"))
            try:
                took, cpu = run(d, g, args.rounds, entry)
            finally:
                shutil.rmtree(d, ignore_errors=True)
            case = {
                "groups": g,
                "layout": layout,
                "wall_ms_per_round": round(1000 * took / args.rounds, 3),
                "cpu_ms_per_round": round(1000 * cpu / args.rounds, 3),
            }
            print(case, file=sys.stderr, flush=True)
            cases.append(case)
    print(write_result("log_envs", {"entry_bytes": args.entry_bytes, "cases": cases}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
