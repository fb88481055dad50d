"""LMDB's CPU per commit over time for values that need overflow pages,
with and without long read transactions (what a snapshot copy holds).

A write pattern like the state machine's: each commit puts 16 values of
23,000 bytes (a 1000-ping batch) under increasing keys, and 16 small index
entries. Every `--reader-every` commits a read transaction is held across
half of them (as a snapshot copy holds one for seconds). The pages the
commits free meanwhile cannot be reused until it ends, and then they are
single pages, which a value of several pages (a contiguous run) cannot use:
LMDB scans and merges its whole free list for every such value, and saves
it back at every commit. Modes:

- `plain`: no long reader;
- `reader`: the long readers;
- `chunked`: the long readers, each value stored as chunks of one page
  (`--chunk` bytes, 4080 for 4 KiB pages), which any single free page fits;
- `state`: the long readers, with the real state machine applying append ops
  of 8 partitions of about 1000 pings each (two ops a commit, 16 batches),
  as a node's apply does: whatever layout the state stores batches in.

Prints the CPU per commit every 2,000 commits; writes
bench/results/lmdb-freelist.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Any

import lmdb

from bench.common import write_result
from node_daemon.raft import Entry, EntryType
from node_daemon.state.machine import StateMachine

VALUE_BYTES = 23_000
PER_COMMIT = 16


def _cpu() -> tuple[float, float]:
    """(user, system) CPU-seconds of this process so far. The system part
    includes the kernel's copies of written pages and any writeback this
    process was made to do when dirty pages piled up (memory pressure, not
    the layout): the user part is LMDB's and Python's own work."""
    t = os.times()
    return t.user, t.system


def _timed_commits(
    label: str, commits: int, reader_every: int, commit: Any, begin: Any, data_file: str
) -> list[dict[str, Any]]:
    """Call ``commit`` ``commits`` times, holding a read transaction from
    ``begin`` (None: none) over half of every ``reader_every``; a row of CPU
    per commit every 2,000."""
    reader, t0, out = None, _cpu(), []
    for c in range(1, commits + 1):
        commit()
        if begin is not None and c % reader_every == reader_every // 4:
            reader = begin()
        if reader is not None and c % reader_every == 3 * reader_every // 4:
            reader.abort()
            reader = None
        if c % 2000 == 0:
            t = _cpu()
            row = {
                "commits": c,
                "cpu_ms_per_commit": round(1000 * (t[0] + t[1] - t0[0] - t0[1]) / 2000, 3),
                "user_ms_per_commit": round(1000 * (t[0] - t0[0]) / 2000, 3),
                "file_mib": os.path.getsize(data_file) >> 20,
            }
            print(f"{label:8s} {row}", file=sys.stderr)
            out.append(row)
            t0 = t
    if reader is not None:
        reader.abort()
    return out


def run(mode: str, commits: int, reader_every: int, chunk: int) -> list[dict[str, Any]]:
    if mode == "state":
        return run_state(commits, reader_every)
    d = tempfile.mkdtemp(prefix="lmdb-freelist-", dir="/var/tmp")
    env = lmdb.open(d, map_size=64 << 30, sync=False, metasync=False, max_dbs=4)
    try:
        batches, index = env.open_db(b"batches"), env.open_db(b"timeidx")
        value = os.urandom(VALUE_BYTES)
        k = 0

        def commit() -> None:
            nonlocal k
            with env.begin(write=True) as txn:
                for _ in range(PER_COMMIT):
                    key = k.to_bytes(8, "big")
                    if mode == "chunked":
                        for j in range(0, VALUE_BYTES, chunk):
                            txn.put(key + j.to_bytes(4, "big"), value[j : j + chunk], db=batches)
                    else:
                        txn.put(key, value, db=batches)
                    txn.put((k * 7919 % 1_000_003).to_bytes(8, "big") + key, b"x" * 16, db=index)
                    k += 1

        begin = None if mode == "plain" else env.begin
        return _timed_commits(
            mode, commits, reader_every, commit, begin, os.path.join(d, "data.mdb")
        )
    finally:
        env.close()
        shutil.rmtree(d, ignore_errors=True)


def _append_entries() -> tuple[bytes, bytes]:
    """The create-topic command, and one append command of 8 publishes of
    1000 pings each over 8 partitions (about 1000 pings, 23 KB, a part)."""
    import numpy as np

    from node_daemon.work.appends import prepare_appends
    from roadlog import columnar
    from roadlog.columnar import PingColumns
    from roadlog.geo import bbox_region
    from roadlog.v1 import client_pb2, command_pb2, pings_pb2, topics_pb2

    region = bbox_region(11.4, 48.05, 11.75, 48.25)
    rng = np.random.default_rng(7)
    t0 = 1_800_000_000_000
    reqs = []
    for k in range(8):
        n = 1000
        cols = PingColumns.from_columns(
            [f"car-{d}" for d in rng.integers(0, 5000, n)],
            list(t0 + k * n + np.arange(n)),
            list(rng.uniform(48.06, 48.24, n)),
            list(rng.uniform(11.41, 11.74, n)),
        )
        reqs.append(
            client_pb2.PublishRequest(
                topic="munich",
                client_id="bench",
                batch=pings_pb2.PingBatch.FromString(columnar.encode(cols)),
            ).SerializeToString()
        )
    prepared, errors = prepare_appends(reqs, lambda _name: (8, region), t0)
    assert not errors and len(prepared) == 1
    spec = topics_pb2.TopicSpec(name="munich", region_geojson=region.geojson, partitions=8)
    create = command_pb2.Command(
        leader_ms=t0, ops=[command_pb2.Op(create_topic=command_pb2.CreateTopicOp(spec=spec))]
    )
    append = command_pb2.Command(leader_ms=t0, ops=[prepared[0].op])
    return create.SerializeToString(), append.SerializeToString()


def run_state(commits: int, reader_every: int) -> list[dict[str, Any]]:
    """``run``'s long readers against the real state machine's applies."""
    d = tempfile.mkdtemp(prefix="lmdb-freelist-", dir="/var/tmp")
    sm = StateMachine(os.path.join(d, "state"), map_size=64 << 30)
    try:
        create, append = _append_entries()
        sm.apply([Entry(1, 1, EntryType.NORMAL, create)], results=False)
        index = 1

        def commit() -> None:
            nonlocal index
            sm.apply(
                [
                    Entry(1, index + 1, EntryType.NORMAL, append),
                    Entry(1, index + 2, EntryType.NORMAL, append),
                ],
                results=False,
            )
            index += 2

        return _timed_commits(
            "state",
            commits,
            reader_every,
            commit,
            sm.env.begin,
            os.path.join(d, "state", "data.mdb"),
        )
    finally:
        sm.close()
        shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--commits", type=int, default=12_000)
    ap.add_argument("--reader-every", type=int, default=2_000)
    ap.add_argument("--chunk", type=int, default=4080, help="bytes per chunk (chunked mode)")
    ap.add_argument("--modes", default="plain,reader,chunked,state")
    args = ap.parse_args(argv)
    figures = {
        "commits": args.commits,
        "values_per_commit": PER_COMMIT,
        "value_bytes": VALUE_BYTES,
        "reader_every": args.reader_every,
        "chunk": args.chunk,
        "modes": {
            m: run(m, args.commits, args.reader_every, args.chunk) for m in args.modes.split(",")
        },
    }
    print(write_result("lmdb-freelist", figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
