"""A read-only view of a state replica applied by another process (worker
processes, docs/multiraft.md step 5), on real LMDB with a real second
process: it reads what the writer committed, follows a snapshot install
(the directory replaced whole) to the new state, lets a request finish on
the state it began with, waits for an index, and never goes back to an
older replica than one it saw."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import lmdb
import pytest

from node_daemon.state.machine import StateMachine
from node_daemon.state.replica_view import StateReplicaView
from roadlog import columnar
from roadlog.errors import Code, RoadlogError
from tests.unit.node_daemon.state.test_state_machine import Log, pings

pytestmark = pytest.mark.unit


def _pings(n: int, seed: int) -> columnar.PingColumns:
    return pings(n, start=seed * 1000)


def _writer(state: str, ahead: str, conn: Connection) -> None:
    """The other process: applies to ``state`` what the test asks for.
    ``ahead`` is a replica further along (as a leader's snapshot would be)."""
    sm = StateMachine(state, group=1)
    log = Log(sm)
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "create":
                log.create("munich")
            elif cmd == "append":
                code, _, msg = log.append(_pings(arg, seed=log.index))
                assert code == Code.OK, msg
            elif cmd == "install ahead":
                # A replica that applied everything this one did and more,
                # taken as a snapshot and installed here, as a follower does.
                sm.close()
                shutil.copytree(state, ahead)
                other = StateMachine(ahead, group=1)
                other_log = Log(other)
                code, _, msg = other_log.append(_pings(arg, seed=99))
                assert code == Code.OK, msg
                other.write_snapshot(f"{ahead}.snap")
                other.close()
                sm = StateMachine(state, group=1)
                sm.install_snapshot(f"{ahead}.snap")
                log = Log(sm)
            elif cmd == "quit":
                break
            conn.send(sm.applied_index)
    finally:
        sm.close()


def _stored(sm: StateMachine) -> int:
    return sum(p.next_offset for p in sm.describe("munich").partitions)


def test_the_view_follows_the_writer_across_a_snapshot_install(tmp_path: Path) -> None:
    state, ahead = tmp_path / "state", tmp_path / "ahead"
    view = StateReplicaView(state, group=1)
    with pytest.raises(RoadlogError) as e:
        view.current()
    assert e.value.code == Code.UNAVAILABLE and "not there yet" in e.value.message

    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_writer, args=(str(state), str(ahead), there))
    proc.start()

    def ask(cmd: str, arg: Any = None) -> int:
        here.send((cmd, arg))
        return answer(cmd)

    def answer(cmd: str) -> int:
        for _ in range(600):  # bounded: 60 s
            if here.poll(0.1):
                return int(here.recv())
            assert proc.is_alive(), f"the writer died doing {cmd!r}"
        raise AssertionError(f"the writer did not answer {cmd!r}")

    try:
        ask("create")
        at = ask("append", 10)
        sm = view.current()
        assert view.applied(sm) == at and _stored(sm) == 10
        with pytest.raises(lmdb.ReadonlyError):  # a view never writes
            Log(sm).append(_pings(1, seed=1))

        # The writer goes on: the same environment shows it.
        at = ask("append", 5)
        assert view.current() is sm and view.applied(sm) == at and _stored(sm) == 15

        # A snapshot install replaces the directory: the view opens the new
        # one; the old stays readable for whoever still holds it.
        held = sm
        at = ask("install ahead", 20)
        sm = view.current()
        assert sm is not held and view.applied(sm) == at and _stored(sm) == 35
        assert _stored(held) == 15

        # Waiting for an index the writer has not applied yet.
        async def wait_then_append() -> StateMachine:
            waiting = asyncio.ensure_future(view.wait_applied(at + 1, timeout=30))
            await asyncio.sleep(0.05)
            assert not waiting.done()
            here.send(("append", 3))
            got = await waiting
            answer("append")
            return got

        got = asyncio.run(wait_then_append())
        assert view.applied(got) >= at + 1 and _stored(got) == 38
        with pytest.raises(RoadlogError) as e:
            asyncio.run(view.wait_applied(10**9, timeout=0.05))
        assert e.value.code == Code.UNAVAILABLE and "not yet" in e.value.message
    finally:
        if proc.is_alive():
            here.send(("quit", None))
        proc.join(60)
        assert proc.exitcode == 0

    # Rebuilt from an older copy (its writer's start after a power loss):
    # behind what the view saw, so not ready, rather than a step back.
    shutil.rmtree(state)
    shutil.copytree(ahead, state)  # the replica as it was before the last appends
    with pytest.raises(RoadlogError) as e:
        view.current()
    assert e.value.code == Code.UNAVAILABLE and "rebuilding" in e.value.message


def test_a_replacement_while_the_view_opens_is_not_taken_for_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory replaced (a snapshot installed) between the view's look
    at the data file and its opening: the view must not take the new file
    for the old one (it would then try to open the new one again on every
    call, which LMDB refuses in one process: unavailable for good)."""
    from node_daemon.state import replica_view

    state, newer = tmp_path / "state", tmp_path / "newer"
    for path, n in ((state, 10), (newer, 25)):
        sm = StateMachine(path, group=1)
        log = Log(sm)
        log.create("munich")
        log.append(_pings(n, seed=n))
        sm.close()
    real = StateMachine
    swaps: list[int] = []

    def opening(*args: Any, **kwargs: Any) -> StateMachine:
        if not swaps:  # the writer's install, just before the first opening
            swaps.append(1)
            old = tmp_path / "state.old"
            os.replace(state, old)
            os.replace(newer, state)
            shutil.rmtree(old)
        return real(*args, **kwargs)

    monkeypatch.setattr(replica_view, "StateMachine", opening)
    view = StateReplicaView(state, group=1)
    with pytest.raises(RoadlogError) as e:
        view.current()
    assert e.value.code == Code.UNAVAILABLE and "being replaced" in e.value.message
    sm = view.current()
    assert _stored(sm) == 25
    assert view.current() is sm and _stored(view.current()) == 25
