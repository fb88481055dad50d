"""``python -m tests.nemesis.run --seconds N --seed S``: one nemesis run.

Builds a cluster of 3 nodes (``--nodes``) and 2 queue servers as hosts in network
namespaces, starts the workload, injects the seed's schedule of faults
for N seconds, heals everything, lets the workload see the healed
cluster, stops it, reads everything back, takes the replicas' digests and
checks the history. The run directory keeps ``schedule.json``,
``history.jsonl`` (the store), ``nemesis.log`` and every daemon's log.

Prints progress on stderr and ONE line on stdout at the end: the faults
per kind, the operations, and each property's verdict. Exits 1 if any
property fails, 2 if the run could not be made (no cluster), 0 otherwise.

Bounded: every phase has a deadline; the whole run ends by about
N + 6 minutes even if nothing answers.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from roadlog.client import Admin, Connection, Consumer, RoadlogError
from roadlog.client_tls import ClientTLS
from roadlog.runtime.logs import JsonFormatter
from tests.bridge_lock import bridge_subnet
from tests.nemesis import schedule, workload
from tests.nemesis.checker import check
from tests.nemesis.cluster import NemesisCluster
from tests.nemesis.faults import Nemesis
from tests.nemesis.history import Recorder, load
from tests.netns.conftest import SUBNET
from tests.waiting import wait_until

log = logging.getLogger("nemesis.run")

SETUP_S, HEAL_S, AFTER_HEAL_S, FINAL_S, DIGEST_S = 90.0, 120.0, 15.0, 120.0, 90.0


def _logging(run_dir: Path) -> None:
    fmt = JsonFormatter("nemesis")
    file = logging.FileHandler(run_dir / "nemesis.log")
    file.setFormatter(fmt)
    progress = logging.StreamHandler(sys.stderr)
    progress.setFormatter(fmt)
    progress.addFilter(lambda r: r.name in ("nemesis.run", "nemesis.progress"))
    root = logging.getLogger()
    root.handlers[:] = [file, progress]
    root.setLevel(logging.INFO)


def _progress(rec: Recorder, ctx: workload.Ctx, nem: Nemesis, stop: threading.Event) -> None:
    plog = logging.getLogger("nemesis.progress")
    while not stop.wait(10.0):
        plog.info(
            "progress",
            extra={
                "t": round(rec.now(), 1),
                "ops": dict(rec.invokes),
                "fence": ctx.fence,
                "down": sorted(nem.down),
                "paused": sorted(nem.paused),
            },
        )


def final_reads(rec: Recorder, ctx: workload.Ctx) -> bool:
    """Every topic, every partition, read whole at the highest index any
    client was told; recorded as ``final_topics`` and ``final_read``."""
    fence = ctx.fence
    with Connection(
        ctx.servers, timeout=30, client="final", tls=ctx.tls_for(workload.INFRA)
    ) as conn:
        try:
            conn.raise_fence(fence)
            for g, index in ctx.fences().items():
                if g:
                    conn.raise_group_fence(g, index)
            topics = Admin(conn).list_topics()
            out: list[tuple[str, int, int, list[list[Any]]]] = []
            for t in topics:
                name, parts = t.topic.spec.name, t.topic.spec.partitions
                d = Admin(conn).describe(name)
                c = Consumer(conn, name)
                c.min_applied_index = fence
                for p in range(parts):
                    first = d.partitions[p].first_offset
                    c.seek(p, first)
                    rows: list[list[Any]] = []
                    for b in c.read_to_end(p):
                        if b.base_offset != first + len(rows):
                            raise RuntimeError(f"{name}/{p}: offsets not dense at {b.base_offset}")
                        rows += ctx.rows(b.pings)
                    out.append((name, p, first, rows))
        except (RoadlogError, RuntimeError) as e:
            rec.event("run", "info", "final_failed", reason=str(e)[:300])
            log.error("final read failed", extra={"why": str(e)})
            return False
    rec.event("run", "ok", "final_topics", fence=fence,
              topics={t.topic.spec.name: t.topic.spec.partitions for t in topics})  # fmt: skip
    for name, p, first, rows in out:
        rec.event("run", "ok", "final_read", topic=name, partition=p, first_offset=first,
                  end_offset=first + len(rows), rows=rows)  # fmt: skip
    return True


def converged_digests(rec: Recorder, cluster: NemesisCluster) -> None:
    """For group 0 and each data group: wait until every node reports the
    same applied index of it, then record the digests (the last ones seen,
    if that never happens), one ``digests`` event per group."""
    deadline = time.monotonic() + DIGEST_S
    for group in cluster.groups():
        last: dict[int, tuple[int, str] | None] = {}

        def same_index(group: int = group) -> bool:
            nonlocal last
            last = cluster.digests(group)
            got = list(last.values())
            return all(got) and len({d[0] for d in got if d}) == 1

        converged = wait_until(same_index, max(5.0, deadline - time.monotonic()))
        rec.event("run", "ok" if converged else "info", "digests", group=group,
                  converged=converged,
                  nodes={str(k): list(v) if v else None for k, v in last.items()})  # fmt: skip
        if len({d[1] for d in last.values() if d}) > 1:
            keep_states(cluster, group)


def keep_states(cluster: NemesisCluster, group: int = 0) -> None:
    """Replicas of ``group`` differ: copy each node's state of it (LMDB
    copies with the lock file, the nodes keep running) out of its disk into
    the run directory, to compare."""
    import lmdb

    for svc in cluster.node_services:
        src = cluster.group_dirs(svc).get(group)
        if src is None:
            continue
        dest = cluster.dir / "states" / f"group{group}" / svc.name
        dest.mkdir(parents=True, exist_ok=True)
        try:
            env = lmdb.open(str(src / "state"), readonly=True, max_dbs=16)
            env.copy(str(dest))
            env.close()
        except lmdb.Error as e:
            log.error("state not copied", extra={"node": svc.name, "group": group, "why": str(e)})


def stop_on_signals(stop: threading.Event, rec: Recorder) -> None:
    """SIGTERM or SIGINT ends the faults early: the run then heals, reads,
    checks what ran and reports as usual. A second one aborts (the cluster
    is still taken down, by ``run``'s cleanup). Main thread only."""

    def handler(signum: int, frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        rec.event("run", "info", "stopped", signal=signal.Signals(signum).name)
        log.warning("stopping early: healing, then checking what ran (again: abort)")

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def run(
    seconds: float,
    seed: int,
    run_dir: Path,
    subnet: str,
    replay: Path | None = None,
    kinds: tuple[str, ...] = schedule.KINDS,
    skip_known: bool = False,
    disk_mib: int = 256,
    pace: float = 1.0,
    phases: tuple[float, float] | None = None,
    max_batch: int = 200,
    snapshot_entries: int = 2000,
    snapshot_mib_per_s: int = 64,
    data_groups: int = 0,
    tls: bool = True,
    nodes: int = 3,
) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    _logging(run_dir)
    if replay is not None:
        seed, seconds, faults = schedule.load(replay)
    else:
        faults = schedule.generate(seed, seconds, kinds, pace, phases)
    schedule.save(faults, run_dir / "schedule.json", seed, seconds)
    rec = Recorder(run_dir / "history.jsonl")
    rec.event("run", "info", "run", seed=seed, seconds=seconds, faults=len(faults),
              kinds=list(kinds), skip_known=skip_known, subnet=subnet, pace=pace,
              phases=list(phases) if phases else None, max_batch=max_batch,
              snapshot_entries=snapshot_entries, snapshot_mib_per_s=snapshot_mib_per_s,
              data_groups=data_groups, tls=tls, nodes=nodes, pid=os.getpid())  # fmt: skip
    log.info("starting", extra={"seed": seed, "seconds": seconds, "faults": len(faults),
                                "dir": str(run_dir)})  # fmt: skip
    cluster = NemesisCluster(
        run_dir, subnet, f"n{os.getpid() % 100000}", disk_bytes=disk_mib << 20,
        snapshot_entries=snapshot_entries, snapshot_mib_per_s=snapshot_mib_per_s,
        data_groups=data_groups, tls=tls, nodes=nodes,
    )  # fmt: skip
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        stop_on_signals(stop, rec)
    made = False
    try:
        cluster.create()
        cluster.start_all()
        if not wait_until(cluster.healthy, SETUP_S):
            log.error("the cluster did not come up")
            return 2
        # Tokens on: the identities an operator would issue (the admin first,
        # through a node with the cluster's credentials), then the workload.
        tokens = cluster.issue_identities(workload.identities())
        ctx = workload.Ctx(
            rec,
            [q.address for q in cluster.queue_services],
            [q.http for q in cluster.queue_services],
            seed,
            deadline=time.monotonic() + seconds + SETUP_S + HEAL_S + AFTER_HEAL_S,
            max_batch=max_batch,
            tls=ClientTLS(cluster.client_tls.ca_file) if tls else ClientTLS(insecure=True),
            tokens=tokens,
        )
        if not workload.create_main_topic(ctx):
            log.error("could not create the main topic")
            return 2
        made = True
        workers = workload.start_all(ctx)
        wait_until(lambda: len(ctx.acks) >= 4, 30)  # the load is flowing
        nem = Nemesis(cluster, rec, faults, seed, offset=rec.now(), skip_known=skip_known)
        threading.Thread(
            target=_progress, args=(rec, ctx, nem, stop), daemon=True, name="progress"
        ).start()
        log.info("faults begin", extra={"t": round(rec.now(), 1)})
        nem.run(stop)
        nem.heal_all()
        nem.settle_membership()
        healed = wait_until(cluster.healthy, HEAL_S)
        rec.event("run", "ok" if healed else "info", "healed", healthy=healed)
        log.info("healed", extra={"t": round(rec.now(), 1), "healthy": healed})
        # The workload goes on a while on the healed cluster: writes after
        # the faults must be taken again.
        fence0 = ctx.fence
        wait_until(lambda: ctx.fence > fence0 + 20, AFTER_HEAL_S)
        stuck = workload.stop_all(ctx, workers)
        if stuck:
            log.error("workers did not stop", extra={"workers": stuck})
        wait_until(lambda: final_reads(rec, ctx), FINAL_S)
        converged_digests(rec, cluster)
        nem.check_alive()
        rec.event("run", "ok", "alive", dead={s: "crashed during the run" for s in nem.crashed})
    finally:
        stop.set()
        cluster.destroy()
        rec.close()
    report = check(load(run_dir / "history.jsonl"))
    for f in report.failures():
        print(f, file=sys.stderr)
    print(f"nemesis seed={seed} seconds={seconds:g}: {report.line()} | {run_dir}", flush=True)
    return 0 if (report.ok and made) else 1


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long faults go on")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dir", type=Path, default=None, help="run directory (default out/nemesis/)")
    ap.add_argument("--subnet", default=os.environ.get("ROADLOG_NEMESIS_SUBNET", SUBNET),
                    help="first three octets of the bridge's /24")  # fmt: skip
    ap.add_argument("--replay", type=Path, default=None, help="a schedule.json to run again")
    ap.add_argument("--skip-known", action="store_true",
                    help="leave out faults that trigger known, unfixed findings (a disk "
                    "filled under a node catching up after a wipe)")  # fmt: skip
    ap.add_argument("--disk-mib", type=int, default=256,
                    help="each node's disk, in MiB (long runs store more)")  # fmt: skip
    ap.add_argument("--kinds", default=",".join(schedule.KINDS),
                    help="the kinds of fault to draw, comma-separated")  # fmt: skip
    ap.add_argument("--pace", type=float, default=1.0,
                    help="gaps between kills, pauses, power cuts and network faults, times "
                    "their usual length: above 1 leaves the quiet spells that wipes, "
                    "corruptions and membership changes wait for (long runs)")  # fmt: skip
    ap.add_argument("--phases", default="",
                    help="STORM,CALM seconds, repeated: kills, pauses, power cuts and "
                    "network faults start only in storms, wipes, corruptions and membership "
                    "changes only in calms (long runs; default: any kind at any time)")  # fmt: skip
    ap.add_argument("--max-batch", type=int, default=200,
                    help="pings in a gRPC publish, 1..N (HTTP: half): long runs may send "
                    "fewer, so that the state, and the catching up the wipes, corruptions "
                    "and membership changes wait for, grow slower")  # fmt: skip
    ap.add_argument("--snapshot-entries", type=int, default=2000,
                    help="the nodes' snapshot_entries: fewer takes snapshots (and their "
                    "compactions, installs and catch-ups) more often under the faults")  # fmt: skip
    ap.add_argument("--data-groups", type=int,
                    default=int(os.environ.get("DATA_GROUPS", "0") or 0),
                    help="the nodes' data_groups: 0 (the default cluster: one data group per "
                    "voter, in worker processes), or 1 for every ping in group 0, the shape "
                    "before data groups (default: $DATA_GROUPS, else 0)")  # fmt: skip
    ap.add_argument("--insecure", action="store_true",
                    help="plaintext and no tokens, the shape of runs before (default: "
                    "TLS on every port, certificates for the hosts' addresses, "
                    "issued tokens)")  # fmt: skip
    ap.add_argument("--nodes", type=int, default=3,
                    help="node daemons, odd, 3..7 (default 3): with 5, two of them may lose "
                    "their copy, or one its copy and one its place, at once (a majority of "
                    "every group keeps its copy): the quiet kinds overlap, long runs get "
                    "more of them")  # fmt: skip
    ap.add_argument("--snapshot-mib-per-s", type=int, default=64,
                    help="the nodes' snapshot_mib_per_s: low, a snapshot's paced copy lasts "
                    "long enough for kills, power cuts and stops to land in it")  # fmt: skip
    a = ap.parse_args(argv)
    if a.nodes not in (3, 5, 7):
        ap.error("--nodes must be 3, 5 or 7")
    if not 0 <= a.data_groups <= 64:
        ap.error("--data-groups must be in 0..64")
    if a.snapshot_entries < 1 or a.snapshot_mib_per_s < 0:
        ap.error("--snapshot-entries must be at least 1, --snapshot-mib-per-s at least 0")
    if not 1 <= a.max_batch <= 10_000:
        ap.error("--max-batch must be in 1..10000")
    if not 0.1 <= a.pace <= 20:
        ap.error("--pace must be in 0.1..20")
    phases: tuple[float, float] | None = None
    if a.phases:
        try:
            storm, calm = (float(x) for x in a.phases.split(","))
        except ValueError:
            ap.error("--phases takes STORM,CALM seconds, e.g. 25,35")
        if storm < 1 or calm < 1:
            ap.error("--phases: each phase at least 1 s")
        phases = (storm, calm)
    if os.geteuid() != 0:
        print("the nemesis needs root (network namespaces, nftables, mounts)", file=sys.stderr)
        return 2
    run_dir = a.dir or Path("out/nemesis") / time.strftime(
        f"seed{a.seed}-%Y%m%dT%H%M%S", time.gmtime()
    )
    kinds = tuple(k for k in a.kinds.split(",") if k)
    unknown = set(kinds) - set(schedule.KINDS)
    if unknown:
        ap.error(f"unknown kinds {sorted(unknown)}; known: {','.join(schedule.KINDS)}")
    # The bridge subnet is shared with the netns and lab tiers (each clears
    # what it finds there): one user at a time (tests/bridge_lock.py).
    with bridge_subnet("nemesis", say=_say):
        return run(
            a.seconds, a.seed, run_dir.resolve(), a.subnet, a.replay, kinds, a.skip_known,
            a.disk_mib, a.pace, phases, a.max_batch, a.snapshot_entries, a.snapshot_mib_per_s,
            a.data_groups, not a.insecure, a.nodes,
        )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
