"""What a node exports for monitoring from its state: per topic and per
consumer group, read in one transaction (``StateMachine.monitoring_figures``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from node_daemon.state.consumer_groups import ConsumerGroupTables
from node_daemon.state.heatmaps import HeatmapTables
from node_daemon.state.topics import PartitionState, TopicTables
from roadlog.v1 import topics_pb2


@dataclass(frozen=True, slots=True)
class TopicFigures:
    """A topic as monitoring sees it."""

    name: str
    appended: int  # pings ever appended: the sum of its partitions' next offsets
    kept: int  # pings still stored (retention trimmed the others)
    heatmap_computed_ms: int  # when its latest heat map was computed; 0: none yet
    heatmap_window_end_ms: int  # the end of that heat map's window; 0: none yet


@dataclass(frozen=True, slots=True)
class ConsumerGroupFigures:
    """A consumer group as monitoring sees it."""

    name: str
    topic: str
    lag: int  # pings of its topic past its committed offsets (not yet read and committed)


def monitoring_figures(
    txn: Any, topic_tables: TopicTables, heat: HeatmapTables, groups: ConsumerGroupTables
) -> tuple[list[TopicFigures], list[ConsumerGroupFigures]]:
    """Every topic's and consumer group's figures as ``txn`` sees them."""
    topics: dict[str, tuple[topics_pb2.Topic, list[PartitionState]]] = {}
    out_topics: list[TopicFigures] = []
    out_groups: list[ConsumerGroupFigures] = []
    for topic in topic_tables.each(txn):
        parts = range(topic.spec.partitions)
        states = [topic_tables.part_state(txn, topic.id, p) for p in parts]
        topics[topic.spec.name] = (topic, states)
        windows = heat.windows(txn, topic.id)
        hm = heat.get(txn, topic.id, windows[-1]) if windows else None
        out_topics.append(
            TopicFigures(
                name=topic.spec.name,
                appended=sum(st.next_offset for st in states),
                kept=sum(st.next_offset - st.first_offset for st in states),
                heatmap_computed_ms=hm.computed_ms if hm else 0,
                heatmap_window_end_ms=hm.window_end_ms if hm else 0,
            )
        )
    for name in groups.names(txn):
        d = groups.describe(txn, name)
        if d.group.topic not in topics:
            continue
        committed = {o.partition: o.offset for o in d.offsets}
        states = topics[d.group.topic][1]
        lag = sum(
            max(0, st.next_offset - max(committed.get(p, 0), st.first_offset))
            for p, st in enumerate(states)
        )
        out_groups.append(ConsumerGroupFigures(name=name, topic=d.group.topic, lag=lag))
    return out_topics, out_groups
