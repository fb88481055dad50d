"""The storage ceiling: Raft log appends to LMDB with fsync.

Each Raft entry carries a batch of pings (about 40 bytes each); every save
is one LMDB transaction with one fsync. Measured for batches of 1, 100 and
1000 pings, with one entry per fsync and with 32 entries per fsync (group
commit, what the node daemon does under load). Writes
bench/results/storage_ceiling.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

from bench.common import write_result
from node_daemon.raft import Entry, HardState
from node_daemon.storage.raft_log import LmdbLogStorage

PING_BYTES = 40


def run_case(pings_per_entry: int, entries_per_save: int, seconds: float) -> dict[str, Any]:
    payload = os.urandom(PING_BYTES * pings_per_entry)
    with tempfile.TemporaryDirectory(prefix="roadlog-bench-", dir="/var/tmp") as d:
        st = LmdbLogStorage(d, map_size=8 << 30)
        index, saves, t0 = 1, 0, time.perf_counter()
        deadline = t0 + seconds
        while time.perf_counter() < deadline:
            batch = [Entry(1, index + k, data=payload) for k in range(entries_per_save)]
            st.save(HardState(1, 1, index - 1), batch, sync=True)
            index += entries_per_save
            saves += 1
        elapsed = time.perf_counter() - t0
        st.close()
    entries = index - 1
    return {
        "pings_per_entry": pings_per_entry,
        "entries_per_fsync": entries_per_save,
        "entries_per_s": round(entries / elapsed, 1),
        "fsyncs_per_s": round(saves / elapsed, 1),
        "pings_per_s": round(entries * pings_per_entry / elapsed, 1),
        "mb_per_s": round(entries * len(payload) / elapsed / 1e6, 2),
        "ms_per_fsync": round(1000 * elapsed / saves, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=3.0, help="per case")
    args = ap.parse_args(argv)
    cases = []
    for per_save in (1, 32):
        for pings in (1, 100, 1000):
            r = run_case(pings, per_save, args.seconds)
            cases.append(r)
            print(
                f"{pings:>5} pings/entry, {per_save:>2} entries/fsync: "
                f"{r['entries_per_s']:>9.0f} entries/s {r['pings_per_s']:>11.0f} pings/s "
                f"{r['mb_per_s']:>7.2f} MB/s {r['ms_per_fsync']:.2f} ms/fsync",
                file=sys.stderr,
                flush=True,
            )
    out = write_result("storage_ceiling", {"ping_bytes": PING_BYTES, "cases": cases})
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
