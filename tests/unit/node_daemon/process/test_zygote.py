"""The node's zygote (``zygote``, issue 41): a worker it forks is the
node's child (the node a subreaper, the middle process gone), named
WORKER_NAME and found as a worker (``bench.cpu.spawned_children``), the
zygote not; its exit status comes back through its pidfd; a SIGKILLed
node leaves neither its worker nor its zygote behind; a zygote gone is a
``ZygoteError`` (the pool spawns then) and is asked no more. Each case
runs a stand-in node of its own (``zygote_node``): the test process
stays no subreaper."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from node_daemon.process.zygote import WORKER_NAME
from tests.waiting import wait_for

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[4]


def _node(mode: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.unit.node_daemon.process.zygote_node", mode],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the stand-in node said nothing (exit {proc.poll()})"
    return proc, json.loads(line)


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie (nobody here reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_a_forked_worker_is_the_nodes_child_and_dies_with_it() -> None:
    proc, got = _node("hold")
    try:
        assert got["worker_says_parent"] == got["node"]
        assert got["comm"] == WORKER_NAME
        assert got["workers_found"] == [got["worker"]]  # the zygote is no worker
        assert not _gone(got["worker"]) and not _gone(got["zygote"])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    wait_for(lambda: _gone(got["worker"]), 20, "the worker to die with its node")
    wait_for(lambda: _gone(got["zygote"]), 20, "the zygote to die with its node")


def test_a_forked_workers_exit_status_comes_back() -> None:
    proc, got = _node("exit")
    proc.wait(30)
    assert got == {"alive": False, "exitcode": 3}


def test_a_zygote_gone_is_an_error_and_asked_no_more() -> None:
    proc, got = _node("gone")
    proc.wait(30)
    assert got["error"] and got["current"] is False


def test_the_bench_finds_workers_by_the_zygotes_name() -> None:
    from bench.cpu import WORKER_NAME as BENCH_NAME

    assert BENCH_NAME == WORKER_NAME
    assert len(WORKER_NAME.encode()) <= 15  # /proc/PID/comm keeps 15 bytes
