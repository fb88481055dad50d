"""Run simulation seeds: ``python -m tests.simulation.run --seeds N --start S``.

Ends with ``simulated N seeds: V violations``; each violation prints its
seed and the command that replays it. Exit status 1 when any seed failed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from collections.abc import Iterable, Iterator

from tests.simulation.harness import Result, replay_command, run_seed


def run_seeds(seeds: Iterable[int], jobs: int) -> Iterator[Result]:
    seeds = list(seeds)
    if jobs <= 1 or len(seeds) < 4:
        yield from map(run_seed, seeds)
        return
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(jobs) as pool:
        yield from pool.imap(run_seed, seeds, chunksize=4)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, default=200, help="how many seeds")
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--jobs", type=int, default=multiprocessing.cpu_count())
    ap.add_argument("--verbose", action="store_true", help="a line per seed")
    ap.add_argument(
        "--record", action="store_true", help="write the figures to bench/results/simulation.json"
    )
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    violations = 0
    totals = {
        "acked": 0,
        "writes": 0,
        "resent": 0,
        "fetches": 0,
        "refetched": 0,
        "snapshots": 0,
        "crashes": 0,
        "conf_changes": 0,
        "reads": 0,
        "split_acked": 0,
        "split_refused": 0,
        "split_resent": 0,
        "offset_commits": 0,
        "offset_refused": 0,
        "offset_read_index": 0,
        "offset_missing_group": 0,
        "offset_not_caught_up": 0,
    }
    seeds = range(args.start, args.start + args.seeds)
    for done, r in enumerate(run_seeds(seeds, args.jobs), start=1):
        for k in totals:
            totals[k] += getattr(r, k)
        if not r.ok:
            violations += 1
            print(f"VIOLATION {r.message}\n  replay: {replay_command(r.seed)}", flush=True)
        elif args.verbose:
            print(f"seed {r.seed}: ok ticks={r.ticks} acked={r.acked} applied={r.applied}")
        if done % 500 == 0 or done == args.seeds:
            rate = done / max(time.monotonic() - t0, 1e-9)
            print(
                f"progress {done}/{args.seeds} seeds, {violations} violations, {rate:.1f} seeds/s",
                file=sys.stderr,
                flush=True,
            )
    elapsed = time.monotonic() - t0
    print("totals: " + ", ".join(f"{k}={v}" for k, v in totals.items()) + f"; {elapsed:.1f} s")
    print(f"simulated {args.seeds} seeds: {violations} violations")
    if args.record:
        from bench.common import write_result

        figures = {"seeds": args.seeds, "start": args.start, "jobs": args.jobs}
        figures |= {"violations": violations, "seconds": round(elapsed, 1), **totals}
        write_result("simulation", figures)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
