"""The bridge subnet's lock (tests/bridge_lock.py): the lab and netns tiers
never run on it at once; a second waits, with a deadline, naming the first."""

from __future__ import annotations

import os
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
        with (
            pytest.raises(TimeoutError, match=r"still held after 0 s by pid .*, lab"),
            bridge_lock.bridge_subnet("netns", timeout=0.1, say=said.append),
        ):
            pass
        assert said == [
            f"netns: waiting for the bridge subnet, held by {held} ({tmp_path}/bridge.lock)"
        ]
    # Released with its holder: the next one gets it at once.
    assert bridge_lock.held_by_another() is None
    with bridge_lock.bridge_subnet("netns", timeout=0, say=said.append):
        assert "netns" in str(bridge_lock.held_by_another())
    assert len(said) == 1
