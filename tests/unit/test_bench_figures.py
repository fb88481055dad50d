"""How the ingest benchmark turns rounds into figures."""

from __future__ import annotations

import pytest

from bench.ingest import median_case
from bench.report import _spread

pytestmark = pytest.mark.unit


def _run(pps: float, p50: float) -> dict[str, float]:
    return {"pings_per_s": pps, "ack_p50_ms": p50, "ack_p99_ms": 2 * p50, "messages": 1}


def test_a_case_is_its_median_round_with_that_rounds_latencies() -> None:
    runs = [_run(150.0, 9.0), _run(100.0, 20.0), _run(130.0, 11.0)]
    case = median_case("roadlog", 100, runs)
    assert case["pings_per_s"] == 130.0 and case["ack_p50_ms"] == 11.0
    assert case["rounds_pings_per_s"] == [150.0, 100.0, 130.0]  # in the order run
    assert case["system"] == "roadlog" and case["pings_per_message"] == 100


def test_an_even_number_of_rounds_takes_the_lower_middle() -> None:
    case = median_case("jetstream", 1, [_run(4.0, 1), _run(1.0, 1), _run(3.0, 1), _run(2.0, 1)])
    assert case["pings_per_s"] == 2.0


def test_the_spread_is_shown_only_for_several_rounds() -> None:
    assert _spread({"rounds_pings_per_s": [131_000.0, 152_400.0, 127_000.0]}) == " (127k-152k)"
    assert _spread({"rounds_pings_per_s": [812_000.0, 1_080_000.0]}) == " (812k-1.08M)"
    assert _spread({"rounds_pings_per_s": [1735.0]}) == ""
    assert _spread({}) == ""
