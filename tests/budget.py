"""Each tier's time budget in CI (tests/budgets.toml), and the check that
keeps the suite within it: ``python -m tests.budget TIER -- COMMAND...``
runs the tier's command, then prints how long it took against its budget,
and a line that starts ``TIER BUDGET EXCEEDED`` when it took longer. The
exit status is the command's: a slow tier is said loudly, never failed
(how long something takes is a benchmark's verdict, not a test's).

Every tier's line is also appended to the file named by
``$ROADLOG_TIER_TIMES`` when it is set; the run of the whole suite
(``make test``, tier ``suite``) sets it, and ends with every tier's line
together, so CI's last lines show where the minutes went.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

BUDGETS = Path(__file__).resolve().parent / "budgets.toml"
TIMES_ENV = "ROADLOG_TIER_TIMES"
EXCEEDED = "TIER BUDGET EXCEEDED"


def load(path: Path = BUDGETS) -> dict[str, float]:
    """{tier: seconds} from the budgets file."""
    with open(path, "rb") as f:
        table = tomllib.load(f)["budgets"]
    return {str(k): float(v) for k, v in table.items()}


def verdict(tier: str, seconds: float, budgets: dict[str, float], rc: int = 0) -> str:
    """The line a tier ends with: its time against its budget (a tier with
    none is said to have none, so a new tier is noticed)."""
    outcome = "" if rc == 0 else f" (exit status {rc})"
    budget = budgets.get(tier)
    if budget is None:
        return f"{EXCEEDED}: {tier} took {seconds:.0f} s and has no budget in {BUDGETS.name}"
    if seconds > budget:
        return f"{EXCEEDED}: {tier} took {seconds:.0f} s, budget {budget:.0f} s{outcome}"
    return f"tier budget: {tier} took {seconds:.0f} s of its {budget:.0f} s{outcome}"


def record(path: Path, tier: str, seconds: float, rc: int, line: str) -> None:
    row = {"tier": tier, "seconds": round(seconds, 1), "rc": rc, "line": line}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def summary(path: Path) -> list[str]:
    """Every tier's line recorded in ``path``, in the order they ended."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [str(r["line"]) for r in rows]


def run(tier: str, command: list[str], budgets: dict[str, float]) -> int:
    """Run a tier's command, print its verdict, record it; its exit status."""
    times = os.environ.get(TIMES_ENV)
    whole = tier == "suite"
    if whole:  # the whole suite: the tiers record into a file of its own
        times = times or str(Path("out") / "tier-times.jsonl")
        Path(times).parent.mkdir(parents=True, exist_ok=True)
        Path(times).unlink(missing_ok=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(command, env={**os.environ, TIMES_ENV: times} if times else None)
    try:
        rc = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        rc = proc.wait()
    seconds = time.monotonic() - t0
    line = verdict(tier, seconds, budgets, rc)
    if whole and times:
        print("\n".join(["", "time per tier (tests/budgets.toml):", *summary(Path(times)), line]))
    else:
        if times:
            record(Path(times), tier, seconds, rc, line)
        print(line, flush=True)
    return rc


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3 or args[1] != "--":
        print("usage: python -m tests.budget TIER -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    return run(args[0], args[2:], load())


if __name__ == "__main__":
    sys.exit(main())
