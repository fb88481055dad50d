"""Metrics read from the replicated state at scrape time: ingest per topic,
consumer-group lag and heat-map age (monitoring/, issue 20).

They are figures of the state machine, not events of this process, so they
are read when Prometheus asks (one LMDB read transaction on the metrics
thread, which LMDB allows beside the applier) instead of being kept up to
date on the write path. Every node that applied as far exports the same
values; dashboards and rules take ``max by (topic)`` / ``max by (group)``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from node_daemon.state.clients import MAX_CLIENTS, MAX_REGISTERED
from node_daemon.state.machine import ConsumerGroupFigures, StateMachine, TopicFigures

log = logging.getLogger("roadlog.node.metrics")


class StateCollector(Collector):
    """Exports the figures of the state machine it watches (none before
    ``watch``); registered once, in the default registry, at import."""

    def __init__(self) -> None:
        self._sm: StateMachine | None = None

    def watch(self, sm: StateMachine | None) -> None:
        """Export ``sm``'s figures from now on (``None``: nothing)."""
        self._sm = sm

    def describe(self) -> Iterable[Metric]:
        return _families([], []) + _identities(None, 0)

    def collect(self) -> Iterable[Metric]:
        sm = self._sm
        if sm is None:
            return _families([], []) + _identities(None, 0)
        try:
            topics, groups = sm.monitoring_figures()
            counts = sm.identity_counts()
        except Exception as e:  # a scrape must answer (e.g. during a snapshot install)
            log.warning("state metrics unavailable", extra={"error": str(e)})
            return _families([], []) + _identities(None, sm.forgotten)
        return _families(topics, groups) + _identities(counts, sm.forgotten)


def _identities(counts: tuple[int, int] | None, forgotten: int) -> list[Metric]:
    """Client identities by kind, against their caps (issue 39): a full
    ``registered`` cap refuses new registrations, never issued tokens."""
    held = GaugeMetricFamily(
        "roadlog_identities", "client identities the cluster holds, by kind", labels=["kind"]
    )
    cap = GaugeMetricFamily(
        "roadlog_identities_cap",
        "the most client identities of the kind the cluster holds (more are refused)",
        labels=["kind"],
    )
    ratio = GaugeMetricFamily(
        "roadlog_identity_cap_fill_ratio",
        "client identities of the kind over their cap (1: new ones refused)",
        labels=["kind"],
    )
    gone = CounterMetricFamily(
        "roadlog_identities_forgotten",
        "self-registered identities this node's applies forgot as idle "
        "(cluster setting registration_idle_days)",
    )
    if counts is not None:
        gone.add_metric([], forgotten)
        for kind, n, limit in zip(
            ("admin", "registered"), counts, (MAX_CLIENTS, MAX_REGISTERED), strict=True
        ):
            held.add_metric([kind], n)
            cap.add_metric([kind], limit)
            ratio.add_metric([kind], n / limit)
    return [held, cap, ratio, gone]


def _families(topics: list[TopicFigures], groups: list[ConsumerGroupFigures]) -> list[Metric]:
    appended = CounterMetricFamily(
        "roadlog_topic_appended_pings",
        "pings ever appended to the topic (the sum of its partitions' next offsets)",
        labels=["topic"],
    )
    kept = GaugeMetricFamily(
        "roadlog_topic_kept_pings",
        "pings of the topic still stored (after retention)",
        labels=["topic"],
    )
    computed = GaugeMetricFamily(
        "roadlog_heatmap_last_computed_seconds",
        "when the topic's latest heat map was computed (Unix time; absent before the first)",
        labels=["topic"],
    )
    window_end = GaugeMetricFamily(
        "roadlog_heatmap_last_window_end_seconds",
        "end of the window of the topic's latest heat map (Unix time)",
        labels=["topic"],
    )
    lag = GaugeMetricFamily(
        "roadlog_group_lag_pings",
        "pings of the group's topic past its committed offsets (not yet read and committed)",
        labels=["group", "topic"],
    )
    for t in topics:
        appended.add_metric([t.name], t.appended)
        kept.add_metric([t.name], t.kept)
        if t.heatmap_window_end_ms:
            # A heat map committed without its computation time counts as
            # computed when its window ended.
            done_ms = t.heatmap_computed_ms or t.heatmap_window_end_ms
            computed.add_metric([t.name], done_ms / 1000)
            window_end.add_metric([t.name], t.heatmap_window_end_ms / 1000)
    for g in groups:
        lag.add_metric([g.name, g.topic], g.lag)
    return [appended, kept, computed, window_end, lag]


STATE = StateCollector()
REGISTRY.register(STATE)
