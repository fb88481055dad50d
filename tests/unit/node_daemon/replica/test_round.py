"""The round (node_daemon/replica/round.py): one Ready pass a turn over every
woken group, then one transport flush, one group commit and the deferred
applies, in that order; a failed group is dropped alone. With real replicas
(a one-node cluster's Store with two data groups): one synced commit
carries both groups' entries of a turn, and a process killed while both
groups are written loses no acknowledged entry of either."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from node_daemon.replica.round import MAX_PASSES, Round
from node_daemon.storage.log_store import LogStore, store_dir

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[4]


class _Calls:
    def __init__(self) -> None:
        self.calls: list[str] = []


class _Transport:
    def __init__(self, calls: _Calls) -> None:
        self.c = calls

    def flush(self) -> None:
        self.c.calls.append("flush")


class _Commits:
    def __init__(self, calls: _Calls) -> None:
        self.c = calls
        self.on_reported: Any = None

    def flush_now(self) -> None:
        self.c.calls.append("commit")


class _Group:
    def __init__(self, group: int, calls: _Calls, fail: bool = False) -> None:
        self.group = group
        self.c = calls
        self.fail = fail
        self.then: Any = None  # run during the turn (a wake, a deferral)

    def round_turn(self) -> None:
        self.c.calls.append(f"turn{self.group}")
        if self.fail:
            raise RuntimeError("a write failed")
        then, self.then = self.then, None
        if then is not None:
            then()


def _round(calls: _Calls) -> Round:
    return Round(_Transport(calls), _Commits(calls))  # type: ignore[arg-type]


def _round_of_two(calls: _Calls) -> tuple[Round, _Group, _Group]:
    """A round with groups 1 and 2 added (neither with a failure callback)."""
    r = _round(calls)
    a, b = _Group(1, calls), _Group(2, calls)
    r.add(a, None)
    r.add(b, None)
    return r, a, b


def test_a_pass_turns_each_woken_group_once_then_flushes_commits_and_applies() -> None:
    async def main() -> list[str]:
        calls = _Calls()
        r, a, b = _round_of_two(calls)

        def a_then() -> None:
            r.wake(a)
            r.defer(lambda: calls.calls.append("apply1"))

        a.then = a_then
        b.then = lambda: r.wake(b)  # woken again during its turn: once in this pass
        r.run_now()
        return calls.calls

    calls = asyncio.run(main())
    first = calls[: calls.index("apply1") + 1]
    assert first == ["turn1", "turn2", "flush", "commit", "apply1"]
    # The groups woken during the pass are turned in the next pass of this run.
    assert calls[len(first) :] == ["turn1", "turn2", "flush", "commit"]


def test_a_group_woken_between_turns_runs_in_the_loops_next_turn_with_the_others() -> None:
    async def main() -> list[str]:
        calls = _Calls()
        r, a, b = _round_of_two(calls)
        await asyncio.sleep(0)  # the adds' first pass
        calls.calls.clear()
        r.wake(b)
        r.wake(a)
        r.wake(b)
        assert calls.calls == []  # nothing runs inside wake
        await asyncio.sleep(0)
        return calls.calls

    assert asyncio.run(main()) == ["turn2", "turn1", "flush", "commit"]


def test_a_failed_group_is_dropped_and_told_while_the_others_go_on() -> None:
    async def main() -> tuple[list[str], list[BaseException]]:
        calls = _Calls()
        r = _round(calls)
        failures: list[BaseException] = []
        bad, good = _Group(1, calls, fail=True), _Group(2, calls)
        r.add(bad, failures.append)
        r.add(good, None)
        r.run_now()
        r.wake(bad)  # never turned again
        r.wake(good)
        r.run_now()
        return calls.calls, failures

    calls, failures = asyncio.run(main())
    assert calls == ["turn1", "turn2", "flush", "commit", "turn2", "flush", "commit"]
    assert len(failures) == 1 and isinstance(failures[0], RuntimeError)


def test_a_group_that_keeps_waking_itself_yields_the_loop() -> None:
    async def main() -> tuple[int, int]:
        calls = _Calls()
        r = _round(calls)
        g = _Group(1, calls)
        r.add(g, None)

        def again() -> None:
            g.then = again
            r.wake(g)

        g.then = again
        r.run_now()
        in_one = calls.calls.count("turn1")
        await asyncio.sleep(0)  # the rest goes on in the loop's next turn
        return in_one, calls.calls.count("turn1")

    in_one, later = asyncio.run(main())
    assert in_one == MAX_PASSES
    assert later > in_one


# ---------------------------------------------------------------- real groups

_NODE = """
import asyncio, json, sys, time
from pathlib import Path
from node_daemon.config import NodeConfig
from node_daemon.state.machine import trim_op
from node_daemon.store.store import Store

async def main(data, addr, rounds):
    cfg = NodeConfig(node_id=1, data_dir=Path(data), listen=addr, peers={1: addr},
                     data_groups=2)
    store = Store(cfg)
    await store.start()
    groups = store.data
    deadline = time.monotonic() + 30
    while not all(n.is_leader and n.caught_up_as_leader for n in groups.values()):
        assert time.monotonic() < deadline, "no leaders"
        await asyncio.sleep(0.02)
    counts = [0, 0]  # groups' writes, synced commits
    commit = store.log_store.commit
    def counted(saves):
        counts[0] += len(saves)
        counts[1] += 1
        return commit(saves)
    store.log_store.commit = counted
    i = 0
    while rounds == 0 or i < rounds:
        i += 1
        before = tuple(counts)
        futs = [n.propose_op(trim_op()) for n in groups.values()]  # one turn: both groups
        for f in futs:
            await f
        after = tuple(counts)
        acked = {g: n.core.log.committed for g, n in groups.items()}
        print(json.dumps({"acked": acked, "writes": after[0] - before[0],
                          "commits": after[1] - before[1]}), flush=True)
    await store.stop()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


def _run_node(tmp_path: Path, rounds: int) -> subprocess.Popen[str]:
    from roadlog.runtime.processes import free_port

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(_NODE),
            str(tmp_path / "n1"),
            f"127.0.0.1:{free_port()}",
            str(rounds),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )


def test_two_groups_proposed_in_one_turn_share_one_synced_commit(tmp_path: Path) -> None:
    import json

    proc = _run_node(tmp_path, 20)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    rounds = [json.loads(line) for line in out.splitlines()]
    assert len(rounds) == 20
    # Each round wrote both groups' entries; most rounds in one commit.
    assert all(r["writes"] >= 2 for r in rounds)
    shared = [r for r in rounds if r["commits"] < r["writes"]]
    assert len(shared) >= len(rounds) // 2, rounds


def test_a_process_killed_mid_round_loses_no_acknowledged_entry_of_any_group(
    tmp_path: Path,
) -> None:
    import json

    proc = _run_node(tmp_path, 0)
    assert proc.stdout is not None
    acked: dict[str, int] = {}
    for n, line in enumerate(proc.stdout):
        acked = json.loads(line)["acked"]
        if n >= 150:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    store = LogStore(store_dir(tmp_path / "n1", "main"))
    try:
        for g, index in acked.items():
            log = store.open(int(g))
            assert log.last_index() >= index, (g, log.last_index(), index)
            assert log.verify() == 0
    finally:
        store.close()
