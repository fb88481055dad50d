"""The state machine's append as it was before apply remembered topics and
partition states and skipped unread answers (commit 5fa7681), kept verbatim
as the reference ``test_apply_equivalence`` compares the current one with:
``ReferenceStateMachine`` is today's ``StateMachine`` with the old
``_append``, ``_check_layout`` and producer sequence bookkeeping, which
read everything from the transaction every time (its reads and writes of
topics, partition states and producer records go through today's tables).
Not used outside the tests."""

from __future__ import annotations

from typing import Any

from node_daemon.state.heatmaps import DEFAULT_CONTRIBUTION_WINDOW_MS
from node_daemon.state.machine import StateMachine
from node_daemon.state.pings import _BATCH, _BATCH_HDR, _TIME, kept_rows
from node_daemon.state.producers import _PROD, _SEQ, RECENT_SEQUENCES
from node_daemon.state.responses import OpResult
from node_daemon.state.topics import _PART, _PART_VAL
from roadlog.errors import Code, RoadlogError
from roadlog.v1 import client_pb2, command_pb2


class ReferenceStateMachine(StateMachine):
    def _append(
        self,
        txn: Any,
        op: command_pb2.AppendOp,
        leader_ms: int,
        index: int,
        wanted: bool = True,
        at: object = None,  # where batches lie in the entry: the reference stores bytes
    ) -> list[OpResult]:
        """Store the op's parts; one result per span. A span that is a retry
        of a stored (producer, sequence) is answered with its original
        offsets and its pings are left out of what is stored."""
        topic = self.topics.get(txn, op.topic)
        tid, nparts = topic.id, topic.spec.partitions
        _old_check_layout(op, nparts)
        states = [self.topics.part_state(txn, tid, part.partition) for part in op.parts]
        nxt = [st.next_offset for st in states]
        kept: list[bool] = []
        results: list[OpResult] = []
        for span in op.spans:
            try:
                dup = self._duplicate(txn, span, op, tid)
            except RoadlogError as err:
                kept.append(False)
                results.append(OpResult(err.code, err.message))
                continue
            if dup is not None:
                kept.append(False)
                dup.duplicate = True
                # A fence at this entry: it is past where the original was
                # stored, so a read at it sees the write (read your writes
                # holds for an answer that came from a retry too).
                dup.applied_index = index
                results.append(OpResult(response=dup.SerializeToString()))
                continue
            kept.append(True)
            resp = client_pb2.PublishResponse(applied_index=index)  # a read fence
            for i, part in enumerate(op.parts):
                count = span.counts[i]
                if not count:
                    continue
                resp.offsets.add(partition=part.partition, base_offset=nxt[i], count=count)
                if span.producer_id:
                    self._remember_sequence(
                        txn, span.producer_id, tid, part.partition, span.sequence, nxt[i], count
                    )
                nxt[i] += count
            results.append(OpResult(response=resp.SerializeToString()))
        pings: dict[str, int] = {}  # contributions as runs of pings (issue 39)
        for s, k in zip(op.spans, kept, strict=True):
            if k:
                pings[s.client_id] = pings.get(s.client_id, 0) + sum(s.counts)
        window = topic.spec.contribution_window_ms or DEFAULT_CONTRIBUTION_WINDOW_MS
        self.heat.record(txn, tid, pings, leader_ms, window)
        for i, part in enumerate(op.parts):
            st = states[i]
            count = nxt[i] - st.next_offset
            if not count:
                continue
            batch = part.batch
            if not all(kept):
                batch = kept_rows(batch, [span.counts[i] for span in op.spans], kept)
            p, base = part.partition, st.next_offset
            append_ms = max(leader_ms, st.last_append_ms)  # monotonic per partition
            txn.put(
                _BATCH.pack(tid, p, base),
                _BATCH_HDR.pack(count, append_ms) + batch,
                db=self.pings.batches,
            )
            txn.put(_TIME.pack(tid, p, append_ms, base), b"", db=self.pings.timeidx)
            txn.put(
                _PART.pack(tid, p),
                _PART_VAL.pack(st.first_offset, base + count, append_ms),
                db=self.topics.parts,
            )
        return results

    def _duplicate(
        self, txn: Any, span: command_pb2.AppendSpan, op: command_pb2.AppendOp, tid: int
    ) -> client_pb2.PublishResponse | None:
        """The original answer if the span's (producer, sequence) was stored before."""
        if not span.producer_id:
            return None
        resp = client_pb2.PublishResponse()
        for part, count in zip(op.parts, span.counts, strict=True):
            if not count:
                continue
            seen = self._ref_sequences(txn, span.producer_id, tid, part.partition)
            match = [s for s in seen if s[0] == span.sequence]
            if match:
                _, base, stored = match[0]
                resp.offsets.add(partition=part.partition, base_offset=base, count=stored)
            elif seen and span.sequence < seen[-1][0]:
                raise RoadlogError(
                    Code.FAILED_PRECONDITION,
                    f"sequence {span.sequence} of producer {span.producer_id} is older than "
                    f"the last {RECENT_SEQUENCES} it stored",
                )
            else:
                return None
        return resp

    def _ref_sequences(self, txn: Any, pid: int, tid: int, p: int) -> list[tuple[int, int, int]]:
        raw = txn.get(_PROD.pack(pid, tid, p), db=self.producers.records)
        if not raw:
            return []
        return [_SEQ.unpack_from(raw, i) for i in range(0, len(raw), _SEQ.size)]

    def _remember_sequence(
        self, txn: Any, pid: int, tid: int, p: int, seq: int, base: int, count: int
    ) -> None:
        recent = [*self._ref_sequences(txn, pid, tid, p), (seq, base, count)][-RECENT_SEQUENCES:]
        txn.put(
            _PROD.pack(pid, tid, p),
            b"".join(_SEQ.pack(*s) for s in recent),
            db=self.producers.records,
        )


def _old_check_layout(op: command_pb2.AppendOp, nparts: int) -> None:
    """Refuse (on every replica alike) an op whose parts and spans disagree."""
    if not op.spans:
        raise RoadlogError(Code.INVALID_ARGUMENT, "an append without spans")
    sums = [0] * len(op.parts)
    for span in op.spans:
        if len(span.counts) != len(op.parts):
            raise RoadlogError(Code.INVALID_ARGUMENT, "a span without a count per part")
        if not any(span.counts):
            raise RoadlogError(Code.INVALID_ARGUMENT, "an empty span")
        for i, c in enumerate(span.counts):
            sums[i] += c
    seen = set()
    for part, total in zip(op.parts, sums, strict=True):
        if part.partition >= nparts:
            raise RoadlogError(Code.INVALID_ARGUMENT, f"no partition {part.partition}")
        if part.partition in seen:
            raise RoadlogError(Code.INVALID_ARGUMENT, f"partition {part.partition} twice")
        seen.add(part.partition)
        if part.count == 0 or part.count != total:
            raise RoadlogError(Code.INVALID_ARGUMENT, "part counts disagree with spans")
