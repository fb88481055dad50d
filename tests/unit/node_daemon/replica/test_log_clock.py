"""A leader's stamps follow its wall clock but never a step of it
(node_daemon/replica/log_clock.py; issue 21, nemesis finding 4)."""

from __future__ import annotations

from pathlib import Path

import pytest

from node_daemon.replica.log_clock import (
    CATCH_UP,
    SAVE_EVERY_S,
    LogClock,
    Reading,
    decode_reading,
    encode_reading,
)

pytestmark = pytest.mark.unit

T0 = 1_700_000_000.0  # a wall clock reading, seconds
HOUR = 3600.0


class Clocks:
    """A wall clock that can be stepped and a monotonic one that cannot."""

    def __init__(self) -> None:
        self.mono = 100.0
        self.offset = 0.0

    def wall(self) -> float:
        return T0 + self.mono + self.offset

    def monotonic(self) -> float:
        return self.mono

    def true_ms(self) -> int:
        return int((T0 + self.mono) * 1000)

    def log_clock(self, log_ms: int, anchor: Path | None = None, boot: str = "b1") -> LogClock:
        return LogClock(log_ms, anchor, self.wall, self.monotonic, lambda: boot)


def measured(c: Clocks) -> LogClock:
    """A clock that has learned a stamp since it started (a follower that
    applied the last leader's entries), at the true time."""
    lc = c.log_clock(0)
    lc.learn(c.true_ms())
    return lc


def test_stamps_follow_a_true_wall_clock() -> None:
    c = Clocks()
    lc = measured(c)
    for _ in range(5):
        c.mono += 1.5
        assert lc.stamp() == c.true_ms()


def test_a_step_ahead_is_not_believed_and_caught_up_only_as_fast_as_time_passes() -> None:
    c = Clocks()
    lc = measured(c)
    before = lc.stamp()
    c.offset = 3 * HOUR
    c.mono += 2.0
    stamp = lc.stamp()
    assert before < stamp <= before + int(2.0 * 1000 * (1 + CATCH_UP))
    for _ in range(100):  # stamps taken often gain no more than rarely
        c.mono += 0.01
        lc.stamp()
    assert lc.stamp() <= before + int(3.0 * 1000 * (1 + CATCH_UP)) + 1
    c.offset = 0.0  # set right again: the stamps stand still until time passes them
    c.mono += 0.5
    assert lc.stamp() == lc.last_ms and lc.last_ms > c.true_ms()
    c.mono += 10.0
    assert lc.stamp() == c.true_ms()


def test_a_wall_clock_ahead_for_good_is_caught_up_with() -> None:
    c = Clocks()
    lc = measured(c)
    c.offset = 60.0
    c.mono += 30.0
    assert lc.stamp() < c.true_ms() + 60_000
    c.mono += 60.0 / CATCH_UP
    assert lc.stamp() == c.true_ms() + 60_000


def test_a_step_back_stops_the_stamps_and_never_turns_them_back() -> None:
    c = Clocks()
    lc = measured(c)
    before = lc.stamp()
    c.offset = -3 * HOUR
    for _ in range(10):
        c.mono += 1.0
        assert lc.stamp() == before
    c.offset = 0.0
    assert lc.stamp() == c.true_ms()  # the time it stood still counts: no lag


def test_a_later_leader_goes_on_from_the_stamps_it_learned() -> None:
    c = Clocks()
    lc = measured(c)
    c.mono += 5.0
    lc.learn(c.true_ms() + 10_000)  # the last leader's clock ran 10 s ahead
    c.offset = 3 * HOUR
    c.mono += 1.0
    stamp = lc.stamp()
    assert c.true_ms() + 10_000 < stamp <= c.true_ms() + 10_000 + int(1000 * (1 + CATCH_UP))
    lc.learn(0)  # an older stamp teaches nothing
    assert lc.last_ms == stamp


def test_without_a_measure_since_the_start_the_wall_clock_is_taken() -> None:
    """A node started with the stamps on its disk and nothing learned since
    (a whole cluster restarted): no monotonic measure of the time that
    passed, so its wall clock, never below the log's clock."""
    c = Clocks()
    on_disk = c.true_ms() - 3_600_000
    assert c.log_clock(on_disk).stamp() == c.true_ms()
    c.offset = -2 * HOUR
    assert c.log_clock(on_disk).stamp() == on_disk


def test_a_restart_on_the_same_boot_keeps_the_measure(tmp_path: Path) -> None:
    """A leader killed while its clock was stepped ahead, started again:
    the monotonic clock ran on, and the file says where it stood."""
    c = Clocks()
    anchor = tmp_path / "log-clock"
    lc = c.log_clock(0, anchor)
    lc.learn(c.true_ms())
    c.mono += SAVE_EVERY_S
    last = lc.stamp()
    lc.save()
    c.offset = 3 * HOUR
    c.mono += 2.0  # down for two seconds
    again = c.log_clock(last, anchor)
    assert last < again.stamp() <= last + int(2.0 * 1000 * (1 + CATCH_UP))
    other_boot = c.log_clock(last, anchor, boot="b2")  # after a reboot: no measure
    assert other_boot.stamp() == c.true_ms() + 3 * 3_600_000
    anchor.write_text("b1 torn")
    assert c.log_clock(last, anchor).stamp() == c.true_ms() + 3 * 3_600_000


def test_the_measure_is_saved_at_most_every_second(tmp_path: Path) -> None:
    c = Clocks()
    anchor = tmp_path / "log-clock"
    lc = c.log_clock(0, anchor)
    lc.save()
    assert not anchor.exists()  # nothing measured yet
    lc.learn(c.true_ms())
    lc.save()
    first = anchor.read_text()
    c.mono += SAVE_EVERY_S / 10
    lc.stamp()
    lc.save()
    assert anchor.read_text() == first
    c.mono += SAVE_EVERY_S
    lc.stamp()
    lc.save()
    assert anchor.read_text() != first


def test_a_reading_is_what_the_node_would_stamp_and_changes_nothing() -> None:
    c = Clocks()
    lc = measured(c)
    c.mono += 2.0
    c.offset = 3 * HOUR
    r = lc.reading()
    assert r.measured and r.ms == c.true_ms() - 2000 + int(2000 * (1 + CATCH_UP))
    assert lc.last_ms == c.true_ms() - 2000  # a reading is no stamp
    bare = c.log_clock(0)
    assert bare.reading() == Reading(c.true_ms() + 3 * 3_600_000, False)
    for r in (Reading(123, True), Reading(-5, False), Reading(2**62, True)):
        assert decode_reading(encode_reading(r)) == r
    assert decode_reading(b"") is None  # a vote from a node that sends none
    assert decode_reading(b"X" + bytes(8)) is None


def test_a_rebooted_leader_takes_the_log_clock_from_a_measured_voter() -> None:
    """Nemesis finding 21 (seed 53, 1516 s): every node went down; one came
    back on a new boot with its wall clock 30 minutes ahead and won the
    election before anything was stamped. Its first stamp was its wall
    clock, the log's clock jumped 30 minutes, and clients that had published
    a minute before were refused heat maps. A voter that kept its measure
    (killed and restarted on the same boot) tells the true log time."""
    c = Clocks()
    on_disk = c.true_ms() - 5_000  # the last stamp, 5 s before the outage ended
    c.offset = 30 * 60.0  # the rebooted node's wall clock, 30 min ahead
    leader = c.log_clock(on_disk, boot="b2")
    assert not leader.measured
    voter = Reading(c.true_ms(), True)  # what a measured voter reads
    leader.lead([voter])
    assert leader.measured
    first = leader.stamp()
    assert first == c.true_ms(), "the leader stamped its stepped wall clock"
    c.mono += 10.0
    assert leader.stamp() <= first + int(10_000 * (1 + CATCH_UP))  # and catches up no faster
    leader.lead([Reading(c.true_ms() + 99 * 3_600_000, True)])  # once measured, kept
    assert leader.stamp() < c.true_ms() + 3_600_000


def test_with_no_measure_anywhere_the_lowest_wall_clock_of_the_majority_is_taken() -> None:
    """The whole cluster rebooted: no node has a measure. One clock stepped
    ahead is not believed while a voter of the majority reads true; a clock
    stepped back never takes the log's clock back (the floor)."""
    c = Clocks()
    on_disk = c.true_ms() - 60_000
    c.offset = 3 * HOUR
    ahead = c.log_clock(on_disk, boot="b2")
    ahead.lead([Reading(c.true_ms(), False)])
    assert ahead.stamp() == c.true_ms()
    behind = c.log_clock(on_disk, boot="b2")
    behind.lead([Reading(c.true_ms() - 2 * 3_600_000, False)])
    assert behind.stamp() == on_disk


def test_a_leader_with_no_voter_but_itself_takes_its_wall_clock() -> None:
    c = Clocks()
    c.offset = HOUR
    lc = c.log_clock(0, boot="b2")
    lc.lead([])
    assert not lc.measured
    assert lc.stamp() == c.true_ms() + 3_600_000
