"""The tiers' time budgets (tests/budget.py): a tier past its budget says
so in CI's output, its exit status stays the command's, every tier that
`make test` runs has a budget, and the whole suite ends with every tier's
line."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests import budget

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]


def test_a_tier_within_its_budget_says_how_much_it_used() -> None:
    line = budget.verdict("lab", 812.4, {"lab": 1100})
    assert line == "tier budget: lab took 812 s of its 1100 s"
    assert budget.EXCEEDED not in line


def test_a_tier_past_its_budget_says_so() -> None:
    line = budget.verdict("lab", 1900, {"lab": 1500})
    assert line == "TIER BUDGET EXCEEDED: lab took 1900 s, budget 1500 s"
    failed = budget.verdict("unit", 200, {"unit": 100}, rc=1)
    assert failed == "TIER BUDGET EXCEEDED: unit took 200 s, budget 100 s (exit status 1)"


def test_a_tier_without_a_budget_is_noticed() -> None:
    line = budget.verdict("new-tier", 5, {"lab": 1500})
    assert line.startswith(f"{budget.EXCEEDED}: new-tier took 5 s and has no budget")


def test_running_a_tier_prints_its_line_and_keeps_the_commands_exit_status(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(budget.TIMES_ENV, raising=False)
    # Any command takes more than no time at all: over a budget of 0 s.
    rc = budget.run("t", [sys.executable, "-c", "raise SystemExit(3)"], {"t": 0.0})
    assert rc == 3
    out = capsys.readouterr().out
    assert re.search(
        r"^TIER BUDGET EXCEEDED: t took \d+ s, budget 0 s \(exit status 3\)$", out, re.M
    )
    rc = budget.run("t", [sys.executable, "-c", "pass"], {"t": 3600.0})
    assert rc == 0
    assert re.search(r"^tier budget: t took \d+ s of its 3600 s$", capsys.readouterr().out, re.M)


def test_the_suite_ends_with_every_tiers_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The suite's run hands its tiers a file to record into (the tiers it
    runs are commands that run ``python -m tests.budget`` themselves)."""
    times = tmp_path / "times.jsonl"
    monkeypatch.setenv(budget.TIMES_ENV, str(times))
    times.write_text(
        '{"tier": "stale", "seconds": 1, "rc": 0, "line": "stale"}\n'
    )  # a previous run's
    inner = (
        "import sys; from tests import budget; "
        "budget.run('fast', [sys.executable, '-c', 'pass'], {'fast': 3600.0}); "
        "budget.run('slow', [sys.executable, '-c', 'pass'], {'slow': 0.0})"
    )
    budgets = {"fast": 3600.0, "slow": 0.0, "suite": 3600.0}
    rc = budget.run("suite", [sys.executable, "-c", inner], budgets)
    assert rc == 0
    out = capsys.readouterr().out.splitlines()
    at = out.index("time per tier (tests/budgets.toml):")
    tail = out[at + 1 :]
    assert [line.split(":")[0] for line in tail] == [
        "tier budget",
        budget.EXCEEDED,
        "tier budget",
    ], tail
    assert "fast took" in tail[0] and "slow took" in tail[1] and "suite took" in tail[2]
    assert "stale" not in "\n".join(tail)


def test_every_tier_make_test_runs_has_a_budget() -> None:
    makefile = (REPO / "Makefile").read_text()
    tiers = set(re.findall(r"\$\(BUDGET\) ([\w-]+) --", makefile))
    assert {"lint", "typecheck", "unit", "simulation", "integration", "netns", "lab"} <= tiers
    assert "suite" in tiers
    assert tiers <= set(budget.load()), tiers - set(budget.load())
