"""A discovery datagram flood gets bounded work (issue 19, finding 16): a
token bucket per source address and one for all sources, taken before any
MAC or JSON work; what they drop is counted and exported; the adapter stops
reading its socket while the budget is spent (on uvloop too)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
import uvloop
from prometheus_client import REGISTRY

import discovery.core
import discovery.protocol
from discovery.agent import UNREAD, DiscoveryAgent
from discovery.core import DiscoveryCore
from discovery.limits import (
    OVER_SOURCE_RATE,
    OVER_TOTAL_RATE,
    PER_SOURCE_BURST,
    TOTAL_BURST,
    Admission,
)
from discovery.protocol import Hello, encode

pytestmark = pytest.mark.unit

KEY = b"k" * 32
NOW = 1_800_000_000_000


def hello(node_id: int, ts_ms: int = NOW) -> bytes:
    h = Hello(cluster="munich", node_id=node_id, role="node", address="10.77.0.7:7400", ts_ms=ts_ms)
    return encode(h, KEY)


@pytest.fixture
def mac_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the datagrams that reach decode (the MAC check and JSON)."""
    calls: list[int] = []
    real = discovery.protocol.decode

    def counting(*args: Any, **kwargs: Any) -> Hello:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(discovery.core, "decode", counting)
    return calls


def test_one_source_flooding_gets_its_burst_and_others_still_get_in(mac_checks: list[int]) -> None:
    core = DiscoveryCore("munich", 1, "node", "10.77.0.1:7400")
    forged = encode(Hello("munich", 66, "node", "x:1", ts_ms=NOW), b"wrong-key" * 4)
    for _ in range(900):  # within one millisecond, under the total cap
        core.receive(forged, KEY, NOW, "10.0.0.66")
    assert len(mac_checks) == PER_SOURCE_BURST
    assert core.counters["rejected_bad_mac"] == PER_SOURCE_BURST
    assert core.counters[OVER_SOURCE_RATE] == 900 - PER_SOURCE_BURST
    # A real node at another address is heard meanwhile.
    assert core.receive(hello(2), KEY, NOW, "10.77.0.2") is not None
    # A second later the flooder has 20 tokens more, not 900.
    for _ in range(900):
        core.receive(forged, KEY, NOW + 1000, "10.0.0.66")
    assert core.counters["rejected_bad_mac"] == PER_SOURCE_BURST + 20
    # Over the total cap everyone is dropped, before any MAC work.
    for _ in range(2000):
        core.receive(forged, KEY, NOW + 1000, "10.0.0.66")
    assert core.receive(hello(3), KEY, NOW + 1000, "10.77.0.3") is None
    assert core.counters[OVER_TOTAL_RATE] >= 1 and len(mac_checks) == PER_SOURCE_BURST + 21


def test_forged_sources_hit_the_total_cap_and_reading_pauses(mac_checks: list[int]) -> None:
    core = DiscoveryCore("munich", 1, "node", "10.77.0.1:7400")
    junk = b"RLD\x01" + b"x" * 100
    assert core.admission.paused_until(NOW) is None
    for i in range(3000):
        core.receive(junk, KEY, NOW, f"10.{i // 250}.{i % 250}.1")
    assert len(mac_checks) == TOTAL_BURST
    assert core.counters[OVER_TOTAL_RATE] == 3000 - TOTAL_BURST
    resume = core.admission.paused_until(NOW)
    assert resume is not None and NOW < resume <= NOW + 2
    # Once it refills, datagrams are read again: rate x time, no more.
    assert core.admission.paused_until(NOW + 100) is None
    before = len(mac_checks)
    for i in range(500):
        core.receive(junk, KEY, NOW + 100, f"10.9.{i % 250}.{i // 250}")
    assert len(mac_checks) - before == 100  # 1000/s for 100 ms


def test_without_a_source_nothing_is_limited() -> None:
    """The sans-I/O callers that pass no address (simulations) are unchanged."""
    core = DiscoveryCore("munich", 1, "node", "10.77.0.1:7400")
    for i in range(int(TOTAL_BURST) + 10):
        core.receive(hello(2 + i % 30, NOW + i), KEY, NOW + i)
    assert core.counters["accepted"] == TOTAL_BURST + 10
    assert not core.counters[OVER_SOURCE_RATE] and not core.counters[OVER_TOTAL_RATE]


def test_the_table_of_sources_is_bounded() -> None:
    adm = Admission(max_sources=100)
    for i in range(1000):
        assert adm.admit(f"10.0.{i // 250}.{i % 250}", NOW + i) is None
        assert len(adm.sources) <= 100
    assert "10.0.3.249" in adm.sources and "10.0.0.0" not in adm.sources


def _wait(cond: Callable[[], bool], timeout: float, what: str) -> Any:
    async def wait() -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            await asyncio.sleep(0.005)

    return wait()


def _metric(outcome: str) -> float:
    value = REGISTRY.get_sample_value("roadlog_discovery_datagrams_total", {"outcome": outcome})
    return value or 0.0


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_the_agent_stops_reading_a_flood_and_counts_what_is_dropped(loop: str) -> None:
    """A real socket on loopback: of a burst far over the budget the agent
    reads the budget, then stops reading and reads again at the budget's
    rate; the datagrams the kernel drops meanwhile are exported as a metric."""
    rate = 10.0
    core = DiscoveryCore("munich", 1, "node", "127.0.0.1:7400")
    core.member = True  # no answers to send
    # The budget fills from the moment it is made: the bound below counts
    # from here (under load, seconds may pass before the burst is sent).
    t0 = time.monotonic()
    core.admission = Admission(
        per_source_rate=1e6, per_source_burst=1e6, total_rate=rate, total_burst=rate
    )
    reads: list[int] = []
    real_receive = core.receive

    def counting(*args: Any, **kwargs: Any) -> Hello | None:
        reads.append(1)
        return real_receive(*args, **kwargs)

    core.receive = counting  # type: ignore[method-assign]
    unread_before = _metric(UNREAD)

    async def main() -> None:
        agent = DiscoveryAgent(core, KEY, 0, broadcast="", bind="127.0.0.1")
        await agent.start()
        try:
            assert agent.sock is not None
            # A small buffer, so that the kernel drops most of the burst.
            agent.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32768)
            port = agent.sock.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as flood:
                for i in range(2000):  # sent before the loop runs again
                    flood.sendto(b"RLD\x01" + i.to_bytes(4, "big") + b"x" * 60, ("127.0.0.1", port))
            await _wait(lambda: agent._resume is not None, 10, "the agent to pause reading")
            assert len(reads) == rate, "read exactly the budget, then paused"
            await _wait(lambda: len(reads) >= rate + 3, 10, "reading to resume")
            elapsed = time.monotonic() - t0
            assert len(reads) <= rate + rate * elapsed + 1, (len(reads), elapsed)
            # Each datagram read was refused: by its MAC, or, when the
            # agent's clock and the budget's disagree by a tick under load,
            # by the budget itself. None got past both.
            refused = core.counters["rejected_bad_mac"] + core.counters[OVER_TOTAL_RATE]
            assert refused == len(reads), dict(core.counters)
            assert core.counters["rejected_bad_mac"] >= rate
            await _wait(lambda: _metric(UNREAD) - unread_before >= 1000, 10, "drops exported")
        finally:
            await agent.stop()
        assert agent.sock is None

    if loop == "uvloop":
        uvloop.run(main())
    else:
        asyncio.run(main())
