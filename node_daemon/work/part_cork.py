"""Parts of split publishes corked per data group (issue 42), sans I/O.

A data group's leader takes each part of a split publish (``AppendPart``,
an AppendOp with a span per publish) as its own work item; the parts that
reach it together (one WorkItems frame, one turn of its loop) are merged
here into one AppendOp per topic, so one op carries the parts of many
publishes: the state machine stores one batch per partition, one heat
record, one op in the entry, instead of one per part.

The merged op's partitions are the parts' (in first-seen order); a
partition in several parts gets their batches joined in part order (one
part's batch is kept byte for byte); its spans are the parts' spans in part
order, each span's counts widened to the merged partitions (0 where its part
has none). So rows of a partition lie in span order, as the state machine
reads them, and each part's answer is its own slice of the op's spans.

Invariant: only parts that name the same topic and topic id, and whose own
layout is sound (``layout_ok``), are merged; a part that is not is proposed
alone, so a bad part is refused alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from roadlog import columnar
from roadlog.v1 import command_pb2


def layout_ok(op: command_pb2.AppendOp) -> bool:
    """Whether ``op``'s parts and spans agree (what the state machine's
    layout check refuses, short of the topic's partition count): each
    partition once, each span a count per part and not empty, each part's
    count the sum of its spans'."""
    width = len(op.parts)
    if not width or not op.spans:
        return False
    if len({p.partition for p in op.parts}) != width:
        return False
    sums = [0] * width
    for span in op.spans:
        if len(span.counts) != width or not any(span.counts):
            return False
        for i, c in enumerate(span.counts):
            sums[i] += c
    return all(p.count == s and s > 0 for p, s in zip(op.parts, sums, strict=True))


def cork_key(op: command_pb2.AppendOp) -> tuple[str, int]:
    """What parts must share to be merged: the topic and its id."""
    return op.topic, op.topic_id


def pings_of(op: command_pb2.AppendOp) -> int:
    return sum(p.count for p in op.parts)


def merge(ops: Sequence[command_pb2.AppendOp], out: command_pb2.AppendOp) -> list[range]:
    """Fill ``out`` (empty; in place, so that a wrapping Op need not copy
    the pings) with one AppendOp of ``ops`` (at least two; same
    ``cork_key``, each ``layout_ok``); returns, per op, the range of its
    spans in ``out``."""
    first = ops[0]
    order: list[int] = []  # partitions, first seen first
    batches: dict[int, list[bytes]] = {}
    counts: dict[int, int] = {}
    for op in ops:
        for part in op.parts:
            p = part.partition
            if p not in batches:
                order.append(p)
                batches[p], counts[p] = [], 0
            batches[p].append(part.batch)
            counts[p] += part.count
    column = {p: i for i, p in enumerate(order)}
    out.topic, out.topic_id = first.topic, first.topic_id
    for p in order:
        got = batches[p]
        batch = (
            got[0]
            if len(got) == 1
            else columnar.encode(columnar.join(list(map(columnar.parse, got))))
        )
        out.parts.add(partition=p, batch=batch, count=counts[p])
    ranges: list[range] = []
    width = len(order)
    for op in ops:
        at = [column[part.partition] for part in op.parts]
        start = len(out.spans)
        for span in op.spans:
            row = [0] * width
            for i, c in zip(at, span.counts, strict=True):
                row[i] = c
            out.spans.add(
                client_id=span.client_id,
                producer_id=span.producer_id,
                sequence=span.sequence,
                producer_epoch=span.producer_epoch,
                counts=row,
            )
        ranges.append(range(start, len(out.spans)))
    return ranges


def corks(ops: Sequence[command_pb2.AppendOp], max_pings: int) -> list[list[int]]:
    """The positions of ``ops`` grouped for merging: per ``cork_key``, in
    arrival order, up to ``max_pings`` pings a group (a bigger part alone);
    a part whose layout is not sound alone."""
    out: list[list[int]] = []
    open_: dict[tuple[str, int], tuple[list[int], int]] = {}
    for i, op in enumerate(ops):
        if not layout_ok(op):
            out.append([i])
            continue
        key, n = cork_key(op), pings_of(op)
        cur = open_.get(key)
        if cur is not None and cur[1] + n <= max_pings:
            cur[0].append(i)
            open_[key] = (cur[0], cur[1] + n)
            continue
        group = [i]
        out.append(group)
        open_[key] = (group, n)
    return out
