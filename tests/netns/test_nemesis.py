"""A short nemesis run (issue 21): 3 nodes and 2 queue servers as hosts in
network namespaces, the whole workload, 40 seconds of every kind of fault,
then the checker over the history. Every property must hold.

``--skip-known`` leaves out the faults that trigger findings not fixed yet
(RELIABILITY.md): a disk filled under a node that is catching up after a
wipe (finding 8). Wipes (finding 2) and clocks stepped ahead past the
contribution window (finding 4) were left out until they were fixed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.nemesis.schedule import CORRUPT, KINDS, MEMBER, WIPE
from tests.netns.conftest import REPO

pytestmark = pytest.mark.netns

SECONDS, SEED = 40, 21


def test_a_short_nemesis_run_keeps_every_property(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("the nemesis needs root (network namespaces, nftables, mounts)")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.nemesis.run", "--seconds", str(SECONDS),
         "--seed", str(SEED), "--skip-known", "--dir", str(run_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=SECONDS + 480,
    )  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    print(proc.stdout)
    assert proc.returncode == 0, (
        f"nemesis exit {proc.returncode}: {proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    assert len(lines) == 1 and lines[0].startswith(f"nemesis seed={SEED}"), proc.stdout
    assert "PASS" in lines[0]
    # Every kind was injected at least once; a wipe or a corruption only
    # starts with a leader known, every node a voter and every earlier wipe
    # repaired, and a membership change only when no other one is under way.
    for kind in KINDS:
        if kind not in (WIPE, MEMBER, CORRUPT):
            assert f"{kind}=" in lines[0], lines[0]
