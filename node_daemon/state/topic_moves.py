"""A member cluster's side of a topic move (issue 43, docs/federation.md,
"Topic moves"): the source's fence and export, the target's import.

- ``fence``: the topic's record marked ``moving`` (or unmarked: ``lift``).
  From the fence's index on, every append and offset commit of the topic is
  refused UNAVAILABLE where applied (``topics.check_topic_id``, the commit's
  apply), so the ends the fence answers are final while it holds: nothing
  is stored at the source after them.
- ``export``: the topic's producers (ids, holders, epochs, records), its
  consumer groups' committed offsets, its heat maps and contributions.
- ``import_topic``: batches stored at the offsets they had at the source
  (a batch already here, from an import retried, is skipped; one that
  would leave a gap is refused FAILED_PRECONDITION), then the state. A
  bound producer's holder is mapped by its owner's token to this cluster's
  identity of that token (identities are per cluster until step 5); one
  with no such identity is left out and counted (``producers_unmapped``).

Only a topic held in group 0 moves (a cluster of one data group, or a
topic made before groups); a topic placed in data groups is refused
FAILED_PRECONDITION (its parts' fences are the next step). Every decision
is made from stored state only, so every replica applies alike.
"""

from __future__ import annotations

from typing import Any

from node_daemon.state.clients import ClientTables
from node_daemon.state.consumer_groups import ConsumerGroupTables
from node_daemon.state.heatmaps import HeatmapTables
from node_daemon.state.pings import PingTables
from node_daemon.state.producers import ProducerTables
from node_daemon.state.topics import PartitionState, TopicTables
from roadlog.errors import Code, RoadlogError
from roadlog.v1 import federation_pb2, topics_pb2

OPS = frozenset({"fence_topic", "import_topic"})


def _in_group_0(topic: topics_pb2.Topic) -> topics_pb2.Topic:
    if topic.partition_groups:
        raise RoadlogError(
            Code.FAILED_PRECONDITION,
            f"topic {topic.spec.name!r} is placed in data groups: only a topic held in "
            "group 0 moves yet (docs/federation.md, 'Topic moves')",
        )
    return topic


class TopicMoves:
    """The move's reads and applies over the state machine's tables."""

    def __init__(
        self,
        topics: TopicTables,
        pings: PingTables,
        producers: ProducerTables,
        groups: ConsumerGroupTables,
        heat: HeatmapTables,
        clients: ClientTables,
    ) -> None:
        self.topics, self.pings, self.producers = topics, pings, producers
        self.groups, self.heat, self.clients = groups, heat, clients

    def ends(self, txn: Any, topic: topics_pb2.Topic) -> list[int]:
        return [
            self.topics.part_state(txn, topic.id, p).next_offset
            for p in range(topic.spec.partitions)
        ]

    # ------------------------------------------------------------ applying

    def fence(self, txn: Any, req: federation_pb2.FenceTopicRequest, index: int) -> bytes:
        """The topic fenced for its move (or the fence lifted): its ends."""
        topic = _in_group_0(self.topics.get(txn, req.topic))
        if topic.moving != (not req.lift):
            topic.moving = not req.lift
            txn.put(req.topic.encode(), topic.SerializeToString(), db=self.topics.records)
        return federation_pb2.FenceTopicResponse(
            applied_index=index, next_offsets=self.ends(txn, topic)
        ).SerializeToString()

    def import_topic(
        self, txn: Any, req: federation_pb2.ImportTopicRequest, log_ms: int, index: int
    ) -> bytes:
        """``req``'s batches at their offsets, then its state (see the module's doc)."""
        topic = _in_group_0(self.topics.get(txn, req.topic))
        tid, nparts = topic.id, topic.spec.partitions
        for b in req.batches:
            if b.partition >= nparts or not b.count:
                raise RoadlogError(Code.INVALID_ARGUMENT, f"no partition {b.partition}")
            st = self.topics.part_state(txn, tid, b.partition)
            if st.first_offset == st.next_offset and st.next_offset < b.base_offset:
                # An empty partition starts where the source's retained pings do.
                st = PartitionState(b.base_offset, b.base_offset, st.last_append_ms)
            if st.next_offset >= b.base_offset + b.count:
                continue  # imported before (a retried import)
            if st.next_offset != b.base_offset:
                raise RoadlogError(
                    Code.FAILED_PRECONDITION,
                    f"partition {b.partition} ends at {st.next_offset} here: a batch at "
                    f"{b.base_offset} would leave a gap",
                )
            append_ms = max(b.append_ms, st.last_append_ms)
            self.pings.store(txn, tid, b.partition, st, b.count, append_ms, b.batch, None)
        unmapped = 0
        for mp in req.producers:
            if mp.bound:
                ident = self.clients.by_hash(txn, mp.owner_token_hash)
                if ident is None:
                    unmapped += 1
                    continue
                mapped = federation_pb2.MovedProducer()
                mapped.CopyFrom(mp)
                mapped.client_id = ident.client_id
                mp = mapped
            self.producers.import_producer(txn, mp, tid)
        for mg in req.groups:
            if mg.group.topic != req.topic:
                raise RoadlogError(Code.INVALID_ARGUMENT, "a moved group of another topic")
            self.groups.import_group(txn, mg, log_ms)
        self.heat.import_rows(txn, tid, req.rows)
        return federation_pb2.ImportTopicResponse(
            applied_index=index, next_offsets=self.ends(txn, topic), producers_unmapped=unmapped
        ).SerializeToString()

    # --------------------------------------------------------------- reads

    def export(self, txn: Any, name: str) -> federation_pb2.ExportTopicStateResponse:
        """The topic's state besides its pings (see the module's doc)."""
        topic = _in_group_0(self.topics.get(txn, name))
        out = federation_pb2.ExportTopicStateResponse()
        hashes: dict[str, bytes] | None = None
        for mp in self.producers.export_topic(txn, topic.id):
            if mp.bound:
                if hashes is None:
                    hashes = self.clients.token_hashes(txn)
                mp.owner_token_hash = hashes.get(mp.client_id, b"")
            out.producers.append(mp)
        out.groups.extend(self.groups.export_topic(txn, name))
        out.rows.extend(self.heat.export_rows(txn, topic.id))
        return out
