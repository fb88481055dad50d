"""A node's /metrics with worker processes (multi-raft step 5): the main
process's figures and each worker's, labelled ``worker``, in one valid
exposition; a node-level gauge only the main process sets is not shadowed
by a worker's unset copy; a worker's own process figures stay; a torn
text is skipped; a worker forgotten is left out."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from node_daemon.process import worker_metrics
from node_daemon.process.worker_metrics import WorkerMetrics, merged_registry

pytestmark = pytest.mark.unit


def _process(registry: CollectorRegistry, role: int, group: str | None, appended: int) -> None:
    Gauge("roadlog_raft_role", "role", registry=registry).set(role)
    g = Gauge("roadlog_raft_group_role", "role by group", ["group"], registry=registry)
    if group is not None:
        g.labels(group).set(3)
    Counter("roadlog_raft_appended_entries", "appended", registry=registry).inc(appended)
    Gauge("process_resident_memory_bytes", "rss", registry=registry).set(1000 + appended)


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(names) == len(set(names)), "a metric family written twice"
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if not s.name.endswith("_created")
    }


def test_the_main_process_and_its_workers_in_one_exposition() -> None:
    main, w0, w1 = CollectorRegistry(), CollectorRegistry(), CollectorRegistry()
    _process(main, role=3, group=None, appended=5)
    _process(w0, role=0, group="1", appended=7)
    _process(w1, role=0, group="2", appended=11)
    merged = WorkerMetrics(main)
    registry = merged_registry(merged)
    merged.told(0, generate_latest(w0).decode())
    merged.told(1, generate_latest(w1).decode())
    merged.told(2, "roadlog_raft_role{torn")  # half a message: skipped
    got = _samples(registry)
    assert got[("roadlog_raft_role", ())] == 3
    assert not any(n == "roadlog_raft_role" and labels for n, labels in got)
    assert got[("roadlog_raft_group_role", (("group", "1"), ("worker", "0")))] == 3
    assert got[("roadlog_raft_group_role", (("group", "2"), ("worker", "1")))] == 3
    appended = {labels: v for (n, labels), v in got.items() if n.startswith("roadlog_raft_app")}
    assert appended == {(): 5, (("worker", "0"),): 7, (("worker", "1"),): 11}
    rss = {labels: v for (n, labels), v in got.items() if n == "process_resident_memory_bytes"}
    assert rss == {(): 1005, (("worker", "0"),): 1007, (("worker", "1"),): 1011}
    merged.forget(1)
    assert not any(("worker", "1") in labels for _, labels in _samples(registry))


def test_a_scrape_asks_the_workers_and_shows_their_answers() -> None:
    """Nothing comes on a timer: each scrape asks, and what the workers
    answer to that ask is what it shows."""
    main, w0 = CollectorRegistry(), CollectorRegistry()
    _process(main, role=3, group=None, appended=5)
    _process(w0, role=0, group="1", appended=7)
    merged = WorkerMetrics(main)
    registry = merged_registry(merged)
    asks: list[int] = []

    def ask() -> None:  # a worker that answers at once, from another thread
        asks.append(1)
        merged.asked([0])
        threading.Thread(target=merged.told, args=(0, generate_latest(w0).decode())).start()

    merged.asks_with(ask)
    got = _samples(registry)
    assert len(asks) == 1
    assert got[("roadlog_raft_appended_entries_total", (("worker", "0"),))] == 7
    Counter("roadlog_x", "x", registry=w0).inc(2)  # moved since: the next scrape shows it
    got = _samples(registry)
    assert len(asks) == 2 and got[("roadlog_x_total", (("worker", "0"),))] == 2


def test_a_worker_that_does_not_answer_in_time_shows_what_it_told_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(worker_metrics, "ASK_WAIT_S", 0.05)
    main, w0 = CollectorRegistry(), CollectorRegistry()
    _process(w0, role=0, group="1", appended=7)
    merged = WorkerMetrics(main)
    merged.told(0, generate_latest(w0).decode())
    merged.asks_with(lambda: merged.asked([0, 1]))  # neither answers
    assert not merged.refresh()
    got = _samples(merged_registry(merged))
    assert got[("roadlog_raft_appended_entries_total", (("worker", "0"),))] == 7

    # A worker asked that dies meanwhile is not waited for.
    def ask_then_answer_and_die() -> None:
        merged.asked([0, 1])
        merged.told(0, "x 1\n")
        merged.forget(1)

    merged.asks_with(ask_then_answer_and_die)
    assert merged.refresh()
