"""Round trace: timestamps at the hops of the write path, to see where a
replication round's latency goes (``bench/round_timeline.py``).

Off unless the process starts with ``ROADLOG_ROUND_TRACE`` naming a
directory (or calls ``start``): then ``mark(tag)`` records the monotonic
clock and the tag, at most MAX_MARKS a process, and the marks are written to
``<directory>/<pid>.marks`` every DUMP_EVERY marks and at exit. Off, a mark
is a call and one global read. The monotonic clock is the machine's, so the
marks of a client, its queue server and the nodes on one machine line up.

Invariants: never raises (a trace that cannot be written is dropped); never
holds more than MAX_MARKS marks.
"""

from __future__ import annotations

import atexit
import os
import time
from pathlib import Path

ENV = "ROADLOG_ROUND_TRACE"
MAX_MARKS = 400_000
DUMP_EVERY = 2_000

_dir: Path | None = None
_marks: list[tuple[int, str]] = []
_written = 0  # the marks already in the file


def start(directory: str | Path) -> None:
    """Record marks from now on, into ``directory``."""
    global _dir
    _dir = Path(directory)
    _dir.mkdir(parents=True, exist_ok=True)


def mark(tag: str) -> None:
    """Record that this process passed ``tag`` now (when tracing)."""
    if _dir is None or len(_marks) >= MAX_MARKS:
        return
    _marks.append((time.perf_counter_ns(), tag))
    if len(_marks) % DUMP_EVERY == 0:
        dump()


def dump() -> None:
    """Append this process's marks not written yet to its file (one
    ``<ns> <tag>`` line each)."""
    global _written
    if _dir is None or _written >= len(_marks):
        return
    try:
        with open(_dir / f"{os.getpid()}.marks", "a") as f:
            f.writelines(f"{t} {tag}\n" for t, tag in _marks[_written:])
        _written = len(_marks)
    except OSError:
        pass


if os.environ.get(ENV):
    start(os.environ[ENV])
atexit.register(dump)
