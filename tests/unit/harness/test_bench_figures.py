"""How the ingest benchmark turns rounds into figures."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import pytest

from bench.cpu import CpuMeter, cpu_seconds, spawned_children
from bench.ingest import compare, cpu_ratio, median_case
from bench.log_envs import separate, shared
from bench.plot_groups import curve, one_group_at
from bench.report import _ingest_tls, _spread, keep_written
from bench.round_cost import parse_case, per_round

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


def test_the_cpu_meter_counts_a_busy_process_and_not_an_idle_one() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        meter = CpuMeter({"busy": busy.pid, "idle": idle.pid})
        meter.start()
        start = cpu_seconds(busy.pid)
        deadline = time.monotonic() + 30
        while cpu_seconds(busy.pid) - start < 0.2:  # a condition, with a deadline
            assert time.monotonic() < deadline, "the busy process got no CPU in 30 s"
            time.sleep(0.01)
        out = meter.stop(pings=2_000_000)
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()
    assert out["server_cpu_s"] >= 0.2
    assert out["server_cpu_s_per_m_pings"] == pytest.approx(out["server_cpu_s"] / 2, abs=0.001)
    assert out["cores"]["busy"] > out["cores"]["idle"]
    assert out["cores"]["idle"] < 0.2


def test_a_process_that_is_gone_has_no_cpu_figure() -> None:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    with pytest.raises(ProcessLookupError):
        cpu_seconds(p.pid)


def test_the_cpu_ratio_is_roadlogs_cpu_per_ping_over_jetstreams() -> None:
    ours = {"server_cpu_s_per_m_pings": 3.0}
    assert cpu_ratio(ours, {"server_cpu_s_per_m_pings": 1.5}) == 2.0
    assert cpu_ratio(ours, {}) is None  # no figure on one side: no ratio


def test_systems_are_compared_within_one_tls_mode() -> None:
    def case(system: str, b: int, tls: bool, pps: float, cpu: float) -> dict[str, object]:
        return {
            "system": system,
            "pings_per_message": b,
            "tls": tls,
            "pings_per_s": pps,
            "server_cpu_s_per_m_pings": cpu,
        }

    cases = [
        case("roadlog", 100, False, 100.0, 6.0),
        case("jetstream", 100, False, 200.0, 3.0),
        case("roadlog", 100, True, 90.0, 6.6),
        case("jetstream", 100, True, 100.0, 5.5),
    ]
    assert compare(cases, [100], "roadlog", "jetstream", False) == ({"100": 0.5}, {"100": 2.0})
    assert compare(cases, [100], "roadlog", "jetstream", True) == ({"100": 0.9}, {"100": 1.2})


def test_the_tls_section_shows_each_system_both_ways() -> None:
    def case(system: str, tls: bool, pps: float, cpu: float) -> dict[str, object]:
        return {
            "system": system,
            "pings_per_message": 100,
            "tls": tls,
            "pings_per_s": pps,
            "server_cpu_s_per_m_pings": cpu,
        }

    doc = {
        "machine": {"cpu": "x", "cores": 2, "memory_gib": 1, "python": "3", "kernel": "k"},
        "when": "2026-11-23T00:00:00Z",
        "rounds": 3,
        "tls": "both",
        "systems": ["roadlog", "jetstream"],
        "cases": [
            case("roadlog", False, 150_000, 6.0),
            case("roadlog", True, 140_000, 6.6),
            case("jetstream", False, 220_000, 3.0),
            case("jetstream", True, 120_000, 5.4),
        ],
        "tls_cpu_cost": {"roadlog": {"100": 1.1}, "jetstream": {"100": 1.8}},
        "cpu_ratio_tls": {"100": 1.22},
    }
    text = "\n".join(_ingest_tls(doc))
    assert "| roadlog | 100 | 150,000 | 140,000 | 6.0 | 6.6 | 1.1 |" in text
    assert "| jetstream | 100 | 220,000 | 120,000 | 3.0 | 5.4 | 1.8 |" in text
    assert "over TLS: 1.22x at 100" in text


def _sleep_a_while(seconds: float) -> None:
    time.sleep(seconds)


def test_a_nodes_worker_processes_are_found_and_other_children_are_not() -> None:
    """``spawned_children``: the processes spawned by multiprocessing (a node's
    worker processes), each metered apart; a plain child is not one."""
    ctx = multiprocessing.get_context("spawn")
    worker = ctx.Process(target=_sleep_a_while, args=(30,))
    worker.start()
    other = subprocess.Popen(["sleep", "30"])
    try:
        # start() can return between the fork and the exec, while the child
        # still shows this process's command line: wait for the exec.
        deadline = time.monotonic() + 20
        while spawned_children(os.getpid()) != [worker.pid] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert spawned_children(os.getpid()) == [worker.pid]
        assert spawned_children(other.pid) == []
    finally:
        worker.kill()
        worker.join(10)
        other.kill()
        other.wait(10)
    assert spawned_children(os.getpid()) == []


def test_the_groups_curve_takes_each_groups_file_and_its_jetstream_figure(tmp_path: Path) -> None:
    def case(system: str, pings: int, pps: float) -> dict[str, object]:
        return {"system": system, "pings_per_message": pings, "pings_per_s": pps}

    for g, pps in ((1, 10.0), (3, 7.0), (2, 8.0)):
        cases = [case("roadlog", 100, pps), case("roadlog", 1000, pps * 3)]
        if g != 2:
            cases.append(case("jetstream", 100, 20.0 + g))
        (tmp_path / f"ingest-groups-{g}.json").write_text(json.dumps({"cases": cases}))
    other = [case("roadlog", 100, 99.0)]  # another setup: not on the curve
    (tmp_path / "ingest-groups-3-workers-2.json").write_text(json.dumps({"cases": other}))
    assert curve(tmp_path, 100) == [(1, 10.0, 21.0), (2, 8.0, None), (3, 7.0, 23.0)]
    assert curve(tmp_path, 1000) == [(1, 30.0, None), (2, 24.0, None), (3, 21.0, None)]


def test_the_per_group_curve_takes_the_runs_whose_publishers_grew_with_the_groups(
    tmp_path: Path,
) -> None:
    def doc(pps: float, js: float | None = None) -> str:
        cases: list[dict[str, object]] = [
            {"system": "roadlog", "pings_per_message": 100, "pings_per_s": pps}
        ]
        if js is not None:
            cases.append({"system": "jetstream", "pings_per_message": 100, "pings_per_s": js})
        return json.dumps({"cases": cases})

    files = {
        "ingest-groups-1.json": doc(10.0, 20.0),  # 32 publishers: on both curves
        "ingest-groups-2.json": doc(7.0),  # 32 in all: the standard curve only
        "ingest-groups-2-c64.json": doc(12.0, 22.0),
        "ingest-groups-3-c96.json": doc(14.0),
        "ingest-groups-3-c64.json": doc(99.0),  # neither 32 in all nor 32 a group
        "ingest-groups-1-c64.json": doc(11.0),
        "ingest-groups-1-c96.json": doc(13.0),
        "ingest-groups-1-c50.json": doc(98.0),  # not a multiple of 32
        "ingest-groups-3-workers-2-c96.json": doc(97.0),  # another setup
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert curve(tmp_path, 100) == [(1, 10.0, 20.0), (2, 7.0, None)]
    assert curve(tmp_path, 100, per_group=32) == [(1, 10.0, 20.0), (2, 12.0, 22.0), (3, 14.0, None)]
    assert one_group_at(tmp_path, 100, 32) == [(1, 10.0), (2, 11.0), (3, 13.0)]
    assert one_group_at(tmp_path, 1000, 32) == []


def test_a_rounds_cpu_is_each_processs_user_and_system_time_over_the_rounds() -> None:
    before = {"leader": (10.0, 2.0), "queue": (1.0, 0.5)}
    after = {"leader": (11.5, 2.25), "queue": (1.25, 0.75)}
    procs = per_round(before, after, seconds=5.0, rounds=500)
    assert procs["leader"] == {
        "user_cores": 0.3,
        "sys_cores": 0.05,
        "user_ms_per_round": 3.0,
        "sys_ms_per_round": 0.5,
        "ms_per_round": 3.5,
    }
    assert procs["queue"]["ms_per_round"] == 1.0
    assert per_round(before, after, 5.0, rounds=0)["queue"]["ms_per_round"] == 500.0  # no /0


def test_a_round_cost_case_is_groups_by_publishers() -> None:
    assert parse_case("6x32") == (6, 32)
    for bad in ("6", "x32", "0x32", "6x0", "6y32", "a x b"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_case(bad)


def test_both_log_layouts_store_every_groups_entries(tmp_path: Path) -> None:
    separate(tmp_path, groups=2, rounds=3, entry=b"x" * 100)
    shared(tmp_path, groups=2, rounds=3, entry=b"y" * 100)
    for g in range(2):
        env = lmdb.open(str(tmp_path / f"sep{g}"), max_dbs=4, readonly=True)
        with env.begin(db=env.open_db(b"log", create=False)) as txn:
            assert [v for _, v in txn.cursor()] == [b"x" * 100] * 3
        env.close()
    env = lmdb.open(str(tmp_path / "shared"), max_dbs=8, readonly=True)
    for g in range(2):
        with env.begin(db=env.open_db(b"log%d" % g, create=False)) as txn:
            assert [v for _, v in txn.cursor()] == [b"y" * 100] * 3
    env.close()


def test_the_report_keeps_what_was_written_by_hand() -> None:
    existing = (
        "# Benchmarks\n\nold intro\n\n"
        "## Ingest\n\nMachine: old box, 2026-01-01.\n\n| a | b |\n| 1 | 2 |\n\n"
        "A note written by hand.\n\n"
        "### Again at abc123\n\nA run recorded by hand.\n\n"
        "## Hand only\n\nA section the report does not write.\n\n"
        "## Failover\n\nMachine: old box.\n"
    )
    generated = (
        "# Benchmarks\n\nnew intro\n\n"
        "## Ingest\n\nMachine: new box, 2026-02-02.\n\n| a | b |\n| 3 | 4 |\n\n"
        "## Failover\n\nMachine: new box.\n"
    )
    out = keep_written(generated, existing)
    assert out == (
        "# Benchmarks\n\nnew intro\n\n"
        "## Ingest\n\nMachine: new box, 2026-02-02.\n\n| a | b |\n| 3 | 4 |\n\n"
        "A note written by hand.\n\n"
        "### Again at abc123\n\nA run recorded by hand.\n\n"
        "## Hand only\n\nA section the report does not write.\n\n"
        "## Failover\n\nMachine: new box.\n"
    )
    assert keep_written(generated, "") == generated
    assert keep_written(out, out) == out  # rendering again changes nothing
