"""The one wait of every tier (tests/waiting.py): ``wait_for`` returns once
its condition holds and fails with what it waited for and how long past its
deadline; ``wait_until`` says whether the condition came true, counts a
condition's exception as not yet, and ends early when its Event is set."""

from __future__ import annotations

import threading
import time

import pytest

from tests.waiting import WaitTimeout, wait_for, wait_until

pytestmark = pytest.mark.unit


def test_wait_for_returns_once_the_condition_holds() -> None:
    asked = []

    def third_time() -> bool:
        asked.append(1)
        return len(asked) == 3

    wait_for(third_time, 5, "the third call", every=0.001)
    assert len(asked) == 3


def test_wait_for_fails_naming_what_and_the_timeout_and_asks_at_the_deadline() -> None:
    asked = []
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after 0\.2 s waiting for the moon") as e:
        wait_for(lambda: asked.append(time.monotonic()), 0.2, "the moon", every=0.05)
    assert isinstance(e.value, WaitTimeout)
    assert asked[-1] - start >= 0.2  # a last look at the deadline
    assert len(asked) <= 6


def test_wait_for_lets_the_conditions_own_failure_through() -> None:
    def broken() -> bool:
        raise KeyError("gone")

    with pytest.raises(KeyError):
        wait_for(broken, 5, "a broken condition")


def test_wait_until_says_whether_the_condition_came_true() -> None:
    answers: list[bool | Exception] = [ConnectionError(), False, True]

    def probe() -> bool:
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    assert wait_until(probe, 5, every=0.001)
    assert not wait_until(lambda: False, 0.05, every=0.01)


def test_wait_until_ends_when_its_event_is_set() -> None:
    stop = threading.Event()
    threading.Timer(0.05, stop.set).start()
    start = time.monotonic()
    assert not wait_until(lambda: False, 30, stop)
    assert time.monotonic() - start < 5
