"""One /metrics for a node with worker processes (docs/multiraft.md step 5).

Each worker process keeps its own prometheus-client registry (its groups'
Raft figures, its peer links, its applies) and sends its exposition to the
main process every ``EVERY_S``; the main process's /metrics is its own
registry with every worker's families merged in, each worker's samples
labelled ``worker="<i>"``, so nothing of two processes is summed wrongly
or overwritten and ``sum by (...)`` gives the node's totals.

Invariant: a node-level gauge the main process sets (``roadlog_raft_role``,
disk figures: group 0's and the host's) is the main process's alone; a
worker's copy of it (never set there) is left out; a process's own figures
(``process_*``: its memory, CPU, open files) are each process's. A worker that died is
left out until it tells again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import REGISTRY, Collector

EVERY_S = 2.0  # a worker sends its metrics this often


class WorkerMetrics(Collector):
    """The main process's registry (``base``) and its workers' metrics."""

    def __init__(self, base: CollectorRegistry = REGISTRY) -> None:
        self.base = base
        self._texts: dict[int, str] = {}
        self._lock = threading.Lock()  # told on the event loop, read by the scrape thread

    def told(self, worker: int, text: str) -> None:
        with self._lock:
            self._texts[worker] = text

    def forget(self, worker: int) -> None:
        with self._lock:
            self._texts.pop(worker, None)

    def describe(self) -> list[Metric]:
        return []  # names are not checked: they repeat the base registry's

    def collect(self) -> Iterator[Metric]:
        own: dict[str, Metric] = {m.name: m for m in self.base.collect()}
        with self._lock:
            texts = sorted(self._texts.items())
        for worker, text in texts:
            try:
                families = list(text_string_to_metric_families(text))
            except ValueError:
                continue  # a torn message: the next one comes in EVERY_S
            for fam in families:
                if fam.name.endswith("_created"):
                    continue  # a counter's creation time: written with the counter's family
                mine = own.get(fam.name)
                if mine is None:
                    mine = own[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                main_has = (
                    {(s.name, tuple(sorted(s.labels.items()))) for s in mine.samples}
                    if fam.type == "gauge" and not fam.name.startswith("process_")
                    else set()
                )
                for s in fam.samples:
                    if s.name.endswith("_created"):
                        continue
                    if (s.name, tuple(sorted(s.labels.items()))) in main_has:
                        continue  # the node's own figure, set by the main process
                    mine.samples.append(s._replace(labels={**s.labels, "worker": str(worker)}))
        yield from own.values()


def merged_registry(workers: WorkerMetrics) -> CollectorRegistry:
    """A registry whose exposition is the main process's and its workers'."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(workers)
    return registry
