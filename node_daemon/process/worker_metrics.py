"""One /metrics for a node with worker processes (docs/multiraft.md step 5).

Each worker process keeps its own prometheus-client registry (its groups'
Raft figures, its peer links, its applies) and sends its exposition to the
main process when asked (``AskMetrics``); the main process's /metrics is its
own registry with every worker's families merged in, each worker's samples
labelled ``worker="<i>"``, so nothing of two processes is summed wrongly
or overwritten and ``sum by (...)`` gives the node's totals.

Invariant (idle cost): a worker's exposition is made only for a scrape. A
scrape asks every running worker (``asks_with``) and waits, at most
``ASK_WAIT_S``, until each one asked has answered (or died); a worker that
does not answer in time is shown with the exposition it told last (none
before its first answer). Nothing is sent on a timer: a node nobody scrapes
makes no exposition at all (before, each worker made and sent its whole
registry every 2 s).

Invariant: a node-level gauge the main process sets (``roadlog_raft_role``,
disk figures: group 0's and the host's) is the main process's alone; a
worker's copy of it (never set there) is left out; a process's own figures
(``process_*``: its memory, CPU, open files) are each process's. A worker that died is
left out until it tells again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import REGISTRY, Collector

ASK_WAIT_S = 1.0  # a scrape waits this long at most for the workers' answers


class WorkerMetrics(Collector):
    """The main process's registry (``base``) and its workers' metrics."""

    def __init__(self, base: CollectorRegistry = REGISTRY) -> None:
        self.base = base
        self._texts: dict[int, str] = {}
        # Told on the event loop, read by the scrape thread. Reentrant: an
        # asker may say whom it asked (``asked``) before returning.
        self._lock = threading.Condition(threading.RLock())
        self._scrape = threading.Lock()  # one ask at a time
        self._ask: Callable[[], None] | None = None
        self._waiting: set[int] | None = None  # asked, not answered yet (None: not asked yet)

    def asks_with(self, ask: Callable[[], None]) -> None:
        """``ask()``, callable from any thread, has every running worker
        asked for its metrics and then ``asked`` called with their indexes."""
        self._ask = ask

    def asked(self, workers: Iterable[int]) -> None:
        """The scrape under way waits for these workers' answers."""
        with self._lock:
            self._waiting = set(workers)
            self._lock.notify_all()

    def told(self, worker: int, text: str) -> None:
        with self._lock:
            self._texts[worker] = text
            if self._waiting is not None:
                self._waiting.discard(worker)
            self._lock.notify_all()

    def forget(self, worker: int) -> None:
        with self._lock:
            self._texts.pop(worker, None)
            if self._waiting is not None:
                self._waiting.discard(worker)
            self._lock.notify_all()

    def refresh(self) -> bool:
        """Ask the workers and wait for their answers (``ASK_WAIT_S`` at
        most): True when every worker asked answered in time."""
        ask = self._ask
        if ask is None:
            return True
        with self._scrape, self._lock:
            self._waiting = None
            ask()
            return self._lock.wait_for(
                lambda: self._waiting is not None and not self._waiting, ASK_WAIT_S
            )

    def describe(self) -> list[Metric]:
        return []  # names are not checked: they repeat the base registry's

    def collect(self) -> Iterator[Metric]:
        self.refresh()
        own: dict[str, Metric] = {m.name: m for m in self.base.collect()}
        with self._lock:
            texts = sorted(self._texts.items())
        for worker, text in texts:
            try:
                families = list(text_string_to_metric_families(text))
            except ValueError:
                continue  # a torn message: the next scrape asks again
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
