"""The bridge subnet's lock (tests/bridge_lock.py): the lab and netns tiers
never run on it at once; a second waits, with a deadline, naming the first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import bridge_lock

pytestmark = pytest.mark.unit


def test_a_second_user_of_the_bridge_subnet_waits_for_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bridge_lock, "LOCK", tmp_path / "bridge.lock")
    said: list[str] = []
    assert bridge_lock.held_by_another() is None
    with bridge_lock.bridge_subnet("lab", say=said.append):
        held = bridge_lock.held_by_another()
        assert held == f"pid {os.getpid()}, lab, in {os.getcwd()}"
        # As another process would (one the holder did not start: no mark
        # in its environment).
        mark = os.environ.pop(bridge_lock.HELD)
        try:
            with (
                pytest.raises(TimeoutError, match=r"still held after 0 s by pid .*, lab"),
                bridge_lock.bridge_subnet("netns", timeout=0.1, say=said.append),
            ):
                pass
        finally:
            os.environ[bridge_lock.HELD] = mark
        assert said == [
            f"netns: waiting for the bridge subnet, held by {held} ({tmp_path}/bridge.lock)"
        ]
    # Released with its holder: the next one gets it at once.
    assert bridge_lock.held_by_another() is None
    with bridge_lock.bridge_subnet("netns", timeout=0, say=said.append):
        assert "netns" in str(bridge_lock.held_by_another())
    assert len(said) == 1


CHILD = """
from tests import bridge_lock
with bridge_lock.bridge_subnet("nemesis", timeout=0.5):
    print("ran")
"""


def test_a_process_the_holder_started_holds_it_already(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The netns tier holds the lock and runs the nemesis as a child, which
    takes the lock too: it must run at once, not wait for its parent."""
    lock = tmp_path / "bridge.lock"
    monkeypatch.setattr(bridge_lock, "LOCK", lock)
    env = {**os.environ, "ROADLOG_BRIDGE_LOCK": str(lock)}
    env.pop(bridge_lock.HELD, None)
    with bridge_lock.bridge_subnet("netns", say=lambda m: None):
        child = subprocess.run(
            [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60,
            env={**env, bridge_lock.HELD: os.environ[bridge_lock.HELD]},
        )  # fmt: skip
        assert (child.returncode, child.stdout.strip()) == (0, "ran"), child.stderr
        # Not started by it: waits, and its deadline passes.
        stranger = subprocess.run(
            [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, env=env
        )
        assert stranger.returncode != 0 and "still held" in stranger.stderr, stranger.stderr
    assert bridge_lock.HELD not in os.environ
