"""The pings of each partition in the state machine: their batches, the
time index, reads and retention.

- ``batches``: topic id, partition, base offset -> header (count, append
  ms) + the PingBatch bytes, the bytes past a page in ``batchmore``
  (``batch_store``), or a reference into the Raft log entry that carried
  them (``batch_refs``)
- ``timeidx``: topic id, partition, append ms, base offset -> b""

A partition's offsets are dense: each batch stored starts where the one
before ended (its state in ``topics.TopicTables``), and retention deletes
batches from the oldest on, moving the partition's first offset past them.
Only what an apply committed is read.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from typing import Any

import lmdb
import numpy as np

from node_daemon.raft.errors import MissingEntryError
from node_daemon.state import batch_refs, batch_store
from node_daemon.state.batch_refs import EntrySource
from node_daemon.state.topics import PartitionState, TopicTables
from node_daemon.storage import kept_log
from roadlog import columnar
from roadlog.errors import Code, RoadlogError
from roadlog.v1 import client_pb2, command_pb2

_PART = struct.Struct(">II")  # a partition's key prefix
_BATCH = struct.Struct(">IIQ")
_TIME = struct.Struct(">IIQQ")  # unsigned: keys must sort numerically
_BATCH_HDR = batch_store.HEADER  # count, append ms


class PingTables:
    """The partitions' batches in ``batches`` (and ``more``: ``batchmore``,
    None until it is open) and their time index in ``timeidx``; ``topics``
    holds the partitions' states; ``entries``: the node's Raft log, where
    batches stored as references lie."""

    def __init__(
        self,
        batches: Any,
        more: Any,
        timeidx: Any,
        topics: TopicTables,
        entries: EntrySource | None,
    ) -> None:
        self.batches = batches
        self.more = more
        self.timeidx = timeidx
        self.topics = topics
        self.entries = entries

    # ------------------------------------------------------------- applying

    def store(
        self,
        txn: Any,
        tid: int,
        p: int,
        st: PartitionState,
        count: int,
        append_ms: int,
        batch: bytes,
        ref: bytes | None,
    ) -> PartitionState:
        """Store ``count`` pings (``batch``, or ``ref`` to where its bytes
        lie in the log) at the end of partition ``p`` of topic ``tid``, whose
        state is ``st``: the partition's state after."""
        base = st.next_offset
        key = _BATCH.pack(tid, p, base)
        if ref is not None:
            batch_store.put_ref(txn, self.batches, key, count, append_ms, ref)
        else:
            batch_store.put_batch(txn, self.batches, self.more, key, count, append_ms, batch)
        txn.put(_TIME.pack(tid, p, append_ms, base), b"", db=self.timeidx)
        after = PartitionState(st.first_offset, base + count, append_ms)
        self.topics.put_state(txn, tid, p, after)
        return after

    def trim_partition(self, txn: Any, tid: int, p: int, cutoff_ms: int) -> bool:
        """Delete the partition's batches appended before ``cutoff_ms``;
        whether one of them was a reference into the log (which the log may
        then let go)."""
        released = False
        st = self.topics.part_state(txn, tid, p)
        cur = txn.cursor(db=self.timeidx)
        first = st.first_offset
        if not cur.set_range(_TIME.pack(tid, p, 0, 0)):
            return released
        doomed = []
        for key, _ in cur:
            t, q, append_ms, base = _TIME.unpack(key)
            if (t, q) != (tid, p) or append_ms >= cutoff_ms:
                break
            doomed.append((key, base))
        for key, base in doomed:
            raw = batch_store.delete_batch(txn, self.batches, self.more, _BATCH.pack(tid, p, base))
            if raw is not None:
                first = max(first, base + _BATCH_HDR.unpack_from(raw)[0])
                if batch_refs.is_ref(raw, _BATCH_HDR.size):
                    released = True
            txn.delete(key, db=self.timeidx)
        if first != st.first_offset:
            self.topics.put_state(
                txn, tid, p, PartitionState(first, st.next_offset, st.last_append_ms)
            )
        return released

    # ---------------------------------------------------------------- reads

    def read_range(
        self, txn: Any, name: str, partition: int, start: int, end: int, max_pings: int
    ) -> tuple[list[client_pb2.StoredBatchView], int]:
        """Batches covering offsets [start, end) from ``start`` on, cut to
        exactly that range, up to about ``max_pings``; and the offset to go on
        from (``end`` when done). Offsets trimmed by retention are skipped."""
        req = client_pb2.FetchRequest(
            topic=name, partition=partition, offset=start, max_pings=max_pings
        )
        resp, counts = self.fetch(txn, req)
        out: list[client_pb2.StoredBatchView] = []
        nxt = max(start, resp.first_offset)
        for b, count in zip(resp.batches, counts, strict=True):
            if b.base_offset >= end:
                break
            if b.base_offset + count > end:  # cut the last batch at the range's end
                cols = columnar.decode(b.batch)
                cols = cols.take(np.arange(end - b.base_offset))
                b.batch = columnar.encode(cols)
                count = end - b.base_offset
            out.append(b)
            nxt = b.base_offset + count
        if not out or nxt >= resp.end_offset:
            nxt = end
        return out, min(nxt, end)

    def fetch(
        self, txn: Any, req: client_pb2.FetchRequest, max_default: int = 10_000
    ) -> tuple[client_pb2.FetchResponseView, list[int]]:
        """Pings of one partition from ``req.offset`` on, whole batches up to
        ``max_pings`` (the first batch cut to start exactly at the offset),
        and the number of pings of each batch. Each batch is the PingBatch
        bytes as stored (only a cut one is encoded anew)."""
        limit = req.max_pings or max_default
        counts: list[int] = []
        topic = self.topics.get(txn, req.topic)
        if req.partition >= topic.spec.partitions:
            raise RoadlogError(Code.INVALID_ARGUMENT, f"no partition {req.partition}")
        tid, p = topic.id, req.partition
        st = self.topics.part_state(txn, tid, p)
        resp = client_pb2.FetchResponseView(end_offset=st.next_offset, first_offset=st.first_offset)
        offset = max(req.offset, st.first_offset)
        if req.offset > st.next_offset:
            raise RoadlogError(
                Code.OUT_OF_RANGE,
                f"offset {req.offset} is beyond the end {st.next_offset}",
            )
        total = 0
        for base, append_ms, count, batch in self._batches_from(txn, tid, p, offset):
            if total and total + count > limit:
                break
            sb = resp.batches.add(append_ms=append_ms)
            if base < offset:  # the first batch starts before the offset: cut it
                cols = columnar.decode(batch)
                skip = offset - base
                cols = cols.take(np.arange(skip, count))
                sb.base_offset, count = offset, count - skip
                sb.batch = columnar.encode(cols)
            else:
                sb.base_offset = base
                sb.batch = batch
            counts.append(count)
            total += count
            offset = sb.base_offset + count
            if total >= limit:
                break
        resp.next_offset = offset
        return resp, counts

    def _batches_from(
        self, txn: Any, tid: int, p: int, offset: int
    ) -> Iterator[tuple[int, int, int, bytes]]:
        """(base, append ms, count, PingBatch bytes) of the partition's
        batches from the one holding ``offset`` on."""
        prefix = _PART.pack(tid, p)
        start = _BATCH.pack(tid, p, offset)
        cur = txn.cursor(db=self.batches)
        found = cur.set_range(start)
        if not found or cur.key() != start:
            # The batch holding ``offset`` starts before it: step back one.
            moved = cur.prev() if found else cur.last()
            if (not moved or not cur.key().startswith(prefix)) and not cur.set_range(start):
                return
        for key, value in cur:
            if not key.startswith(prefix):
                return
            base = _BATCH.unpack(key)[2]
            count, append_ms = _BATCH_HDR.unpack_from(value)
            if base + count <= offset:
                continue
            try:
                data = batch_store.batch_bytes(txn, self.more, key, value, self.entries)
            except batch_store.PiecesNotOpen:
                raise RoadlogError(
                    Code.UNAVAILABLE, "this replica's batches are not readable yet: try again"
                ) from None
            except MissingEntryError as e:
                # Retention released it while this read was under way (or
                # the log was replaced by a snapshot): read again.
                raise RoadlogError(
                    Code.UNAVAILABLE, f"a batch's log entry is no longer here ({e}): try again"
                ) from None
            yield base, append_ms, count, data

    def offsets_for_window(
        self, txn: Any, name: str, partition: int, start_ms: int, end_ms: int
    ) -> tuple[int, int]:
        """[first offset, end offset) of the batches appended in [start, end)."""
        topic = self.topics.get(txn, name)
        tid = topic.id
        st = self.topics.part_state(txn, tid, partition)

        def first_at(ms: int) -> int:
            cur = txn.cursor(db=self.timeidx)
            if cur.set_range(_TIME.pack(tid, partition, max(ms, 0), 0)):
                t, q, _, base = _TIME.unpack(cur.key())
                if (t, q) == (tid, partition):
                    return int(base)
            return st.next_offset

        return first_at(start_ms), first_at(end_ms)


def check_layout(op: command_pb2.AppendOp, counts: list[list[int]], nparts: int) -> None:
    """Refuse (on every replica alike) an op whose parts and spans disagree;
    ``counts`` are the spans' counts."""
    if not counts:
        raise RoadlogError(Code.INVALID_ARGUMENT, "an append without spans")
    width = len(op.parts)
    for row in counts:
        if len(row) != width:
            raise RoadlogError(Code.INVALID_ARGUMENT, "a span without a count per part")
        if not any(row):
            raise RoadlogError(Code.INVALID_ARGUMENT, "an empty span")
    sums = [sum(column) for column in zip(*counts, strict=True)] if width else []
    seen = set()
    for part, total in zip(op.parts, sums, strict=True):
        if part.partition >= nparts:
            raise RoadlogError(Code.INVALID_ARGUMENT, f"no partition {part.partition}")
        if part.partition in seen:
            raise RoadlogError(Code.INVALID_ARGUMENT, f"partition {part.partition} twice")
        seen.add(part.partition)
        if part.count == 0 or part.count != total:
            raise RoadlogError(Code.INVALID_ARGUMENT, "part counts disagree with spans")


def oldest_ref(txn: Any, parts: Any, batches: Any) -> int | None:
    """The lowest log index a batch in ``batches`` refers to, None if none
    does. Batches lie in offset order within a partition, and so in log
    order: each partition's first reference is its lowest."""
    lowest: int | None = None
    cur = txn.cursor(db=batches)
    for key in txn.cursor(db=parts).iternext(values=False):
        if not cur.set_range(key):
            break
        for k, v in cur:
            if not k.startswith(key):
                break
            if batch_refs.is_ref(v, _BATCH_HDR.size):
                index = batch_refs.decode_ref(v, _BATCH_HDR.size)[0]
                lowest = index if lowest is None else min(lowest, index)
                break
    return lowest


def oldest_ref_in_snapshot(snapshot_file: str | os.PathLike[str]) -> int | None:
    """``StateMachine.oldest_entry_ref`` of a state snapshot file."""
    env = kept_log.open_snapshot_file(snapshot_file)
    try:
        try:
            parts, batches = (
                env.open_db(b"parts", create=False),
                env.open_db(b"batches", create=False),
            )
        except lmdb.NotFoundError:
            return None
        with env.begin() as txn:
            return oldest_ref(txn, parts, batches)
    finally:
        env.close()


def ref_to(
    at: tuple[bytes, list[tuple[int, int]]] | None, part: int, batch: bytes, index: int
) -> bytes | None:
    """A reference to part ``part``'s batch in entry ``index``'s data, if
    ``at`` says where it lies and those bytes are the batch; else None."""
    if at is None:
        return None
    data, spans = at
    if part >= len(spans):
        return None
    offset, length = spans[part]
    if length != len(batch) or not length or not data.startswith(batch, offset):
        return None
    return batch_refs.encode_ref(index, offset, length)


def kept_rows(batch: bytes, counts: list[int], kept: list[bool]) -> bytes:
    """The batch without the rows of spans not kept (spans are consecutive)."""
    cols = columnar.decode(batch)
    mask = np.repeat(np.array(kept, dtype=bool), counts)
    return columnar.encode(cols.take(np.flatnonzero(mask)))
