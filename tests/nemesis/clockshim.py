"""Run a Python module with its wall clock offset by what a file says.

``python -m tests.nemesis.clockshim OFFSET_FILE MODULE [ARGS...]`` runs
MODULE as ``__main__`` with ``time.time`` and ``time.time_ns`` shifted by
the seconds written in OFFSET_FILE (re-read at most every 50 ms, so the
nemesis can jump the clock of a running node forward and back).

Why not libfaketime (Debian's ``faketime``, 0.9.10): with the monotonic
clock left alone (``FAKETIME_DONT_FAKE_MONOTONIC=1``) every ``time.sleep``
of Python 3.11 fails with EINVAL (libfaketime issue #426: its
``clock_nanosleep`` wrapper mangles TIMER_ABSTIME deadlines on
CLOCK_MONOTONIC); with the monotonic clock faked too, a backward jump
stalls every timer of the event loop, which is not what a stepped wall
clock does. The node reads the wall clock only through ``time.time()``
(command timestamps, ping validation, give-to-get, discovery, backups);
its Raft timing runs on the monotonic clock, which stays true here, as it
does on a host whose NTP steps the clock.

Invariant: only the wall clock moves; ``time.monotonic`` and
``time.perf_counter`` are untouched.
"""

from __future__ import annotations

import contextlib
import runpy
import sys
import time
from pathlib import Path

RECHECK_S = 0.05


def install(path: Path) -> None:
    """Shift ``time.time``/``time.time_ns`` by the offset in ``path``."""
    real_time, real_time_ns, monotonic = time.time, time.time_ns, time.monotonic
    state = {"checked": -1e9, "offset_ns": 0}

    def offset_ns() -> int:
        now = monotonic()
        if now - state["checked"] >= RECHECK_S:
            state["checked"] = now
            # A file being replaced reads badly for a moment: keep the last offset.
            with contextlib.suppress(OSError, ValueError):
                state["offset_ns"] = int(float(path.read_text().strip() or 0) * 1e9)
        return int(state["offset_ns"])

    def shifted_time() -> float:
        return real_time() + offset_ns() / 1e9

    def shifted_time_ns() -> int:
        return real_time_ns() + offset_ns()

    time.time = shifted_time
    time.time_ns = shifted_time_ns


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit("usage: python -m tests.nemesis.clockshim OFFSET_FILE MODULE [ARGS...]")
    install(Path(sys.argv[1]))
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
