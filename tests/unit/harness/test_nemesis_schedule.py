"""The nemesis schedule: replayable from its seed, bounded, every kind
present in a short run, lanes independent of each other."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tests.nemesis.schedule import (
    DISRUPTIVE,
    KINDS,
    LANES,
    QUIET_KINDS,
    Fault,
    generate,
    load,
    save,
)

pytestmark = pytest.mark.unit


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    assert generate(7, 120) == generate(7, 120)
    assert generate(7, 120) != generate(8, 120)


def test_a_short_run_has_every_kind_and_everything_is_bounded() -> None:
    for seed in range(50):
        faults = generate(seed, 40)
        assert {f.kind for f in faults} == set(KINDS)
        for f in faults:
            lane = LANES[f.kind]
            assert 0 <= f.at < 40 and 0 < f.duration <= lane.duration[1]
            assert f.target in {t for t, _ in lane.targets}
        for kind in KINDS:  # a lane's faults never overlap
            mine = [f for f in faults if f.kind == kind]
            assert all(a.end <= b.at for a, b in itertools.pairwise(mine))
        per_kind = max(
            40 / (LANES[k].duration[0] + LANES[k].gap[0]) + 1 for k in KINDS
        )  # the bound of the docstring
        assert all(sum(f.kind == k for f in faults) <= per_kind for k in KINDS)


def test_a_lane_does_not_depend_on_the_others() -> None:
    alone = generate(3, 60, ("pause",))
    together = [f for f in generate(3, 60) if f.kind == "pause"]
    assert alone == together


def test_a_saved_schedule_replays(tmp_path: Path) -> None:
    faults = generate(11, 30)
    save(faults, tmp_path / "schedule.json", 11, 30)
    assert load(tmp_path / "schedule.json") == (11, 30, faults)


def test_pace_spaces_out_the_disruptive_kinds_only() -> None:
    normal = generate(7, 600.0)
    calm = generate(7, 600.0, pace=3.0)

    def count(faults: list[Fault], kind: str) -> int:
        return sum(f.kind == kind for f in faults)

    for kind in DISRUPTIVE:
        assert count(calm, kind) < 0.7 * count(normal, kind), kind
    for kind in set(KINDS) - set(DISRUPTIVE):
        assert count(calm, kind) == count(normal, kind), kind


def test_phases_keep_storms_and_calms_apart() -> None:
    storm, calm = 30.0, 30.0
    faults = generate(9, 900.0, phases=(storm, calm))
    for f in faults:
        into = f.at % (storm + calm)
        if f.kind in DISRUPTIVE:
            assert into < storm, f
        elif f.kind in QUIET_KINDS:
            assert into >= storm, f
    assert {f.kind for f in faults} == set(KINDS)
