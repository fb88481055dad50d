"""One wait for every tier: poll a condition until it holds, with a deadline.

``wait_for`` is the tests' (unit, integration, netns, lab): a condition
that does not hold by its deadline fails the test with an AssertionError
(``WaitTimeout``) naming what was waited for and how long. A test never
sleeps a fixed time and then judges; it waits for what it needs, at most
so long. ``wait_until`` is the same loop for code that goes on either way
(the nemesis's): whether the condition came true, and it can be stopped
early by an Event.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class WaitTimeout(AssertionError):
    """A condition ``wait_for`` waited for did not hold by its deadline."""


def wait_for(
    cond: Callable[[], object],
    timeout: float = 30.0,
    what: str = "condition",
    every: float = 0.05,
) -> None:
    """Call ``cond()`` every ``every`` seconds until it returns something
    true; ``WaitTimeout`` (an AssertionError) naming ``what`` and
    ``timeout`` if it has not within ``timeout`` seconds. ``cond`` is asked
    once more at the deadline, so a condition that came true during the last
    pause counts. What ``cond`` raises goes up to the caller as it is."""
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise WaitTimeout(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(min(every, left))


def wait_until(
    cond: Callable[[], object],
    timeout: float,
    stop: threading.Event | None = None,
    every: float = 0.3,
) -> bool:
    """Call ``cond()`` every ``every`` seconds until it returns something
    true (True), ``timeout`` seconds pass or ``stop`` is set (False). An
    exception from ``cond`` counts as not yet: for probes of a cluster
    under faults, where a refused connection is an ordinary answer."""
    deadline = time.monotonic() + timeout
    ev = stop or threading.Event()
    while True:
        try:
            if cond():
                return True
        except Exception:
            pass
        left = deadline - time.monotonic()
        if left <= 0 or ev.wait(min(every, left)):
            return False
