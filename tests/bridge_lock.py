"""One user of the bridge subnet 10.77.0.0/24 on this machine at a time.

The lab tier (tests/lab) and the netns tier (tests/netns) each make a bridge
on that subnet, and each first clears what a previous run left there: two of
them at once end each other's hosts. Each takes this lock (an exclusive
flock) for its whole session; a second run waits for the first to end, with
a deadline, saying who holds it. ``make test`` runs them one after the other
(the Makefile's bridge side), so there it never waits.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

# Set in the environment of the holder, and so of the processes it starts.
HELD = "ROADLOG_BRIDGE_HELD"
LOCK = Path(os.environ.get("ROADLOG_BRIDGE_LOCK", "/run/lock/roadlog-bridge-10.77.0.lock"))


def holder() -> str:
    """Who holds (or last held) the lock: pid, tier and directory."""
    try:
        return LOCK.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


@contextlib.contextmanager
def bridge_subnet(
    what: str, timeout: float = 3600, say: Callable[[str], None] = print
) -> Iterator[None]:
    """Hold the bridge subnet for the block (``what``: the tier, for the
    record). Waits up to ``timeout`` seconds for another holder to end
    (TimeoutError after); the lock goes with this process's file. A process
    started by the holder (the netns tier's nemesis run) holds it already:
    the holder marks its environment (``HELD``), and the block runs at once."""
    if os.environ.get(HELD):
        yield
        return
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{what}: the bridge subnet is still held after {timeout:.0f} s "
                        f"by {holder()} ({LOCK})"
                    ) from None
                if not told:
                    say(f"{what}: waiting for the bridge subnet, held by {holder()} ({LOCK})")
                    told = True
                time.sleep(1)
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}, {what}, in {os.getcwd()}\n".encode())
        os.environ[HELD] = f"{os.getpid()} {what}"
        try:
            yield
        finally:
            os.environ.pop(HELD, None)
    finally:
        os.close(fd)


def held_by_another() -> str | None:
    """Who holds the lock now (None: nobody). For the lab's command line,
    which leaves its hosts running and so cannot hold it past itself."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return holder()
        return None
    finally:
        os.close(fd)
