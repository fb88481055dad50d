"""A long nemesis run stops early on a signal and still judges what ran:
the first SIGTERM or SIGINT ends the faults (the run heals and checks), a
second aborts."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from tests.nemesis.history import Recorder, load
from tests.nemesis.run import stop_on_signals

pytestmark = pytest.mark.unit


def test_the_first_signal_stops_the_faults_and_the_second_aborts(tmp_path: Path) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    rec = Recorder(tmp_path / "history.jsonl")
    stop = threading.Event()
    try:
        stop_on_signals(stop, rec)
        os.kill(os.getpid(), signal.SIGTERM)  # handled before kill() returns here
        assert stop.is_set()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        for s, h in before.items():
            signal.signal(s, h)
        rec.close()
    [ev] = [e for e in load(tmp_path / "history.jsonl") if e.get("f") == "stopped"]
    assert ev["signal"] == "SIGTERM"


@pytest.mark.parametrize(
    "args",
    [
        ["--max-batch", "0"],
        ["--max-batch", "10001"],
        ["--pace", "0"],
        ["--phases", "5"],
        ["--nodes", "4"],
    ],
)
def test_the_runs_knobs_out_of_range_are_refused_before_anything_starts(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.nemesis import run

    with pytest.raises(SystemExit) as e:
        run.main(args)
    assert e.value.code == 2
    assert args[0] in capsys.readouterr().err
