"""Parts of split publishes corked per data group (issue 42), sans I/O.

A data group's leader takes each part of a split publish (``AppendPart``,
an AppendOp with a span per publish) as its own work item; the parts that
reach it together (one WorkItems frame, one turn of its loop) are merged
here into one AppendOp per topic when their partitions do not overlap, so
one op carries the parts of many publishes: one op in the entry, one heat
record, instead of one per part. Parts that share a partition are not
merged (they go as separate ops of the same entry, as before): joining a
partition's batches re-encodes them on the leader, which cost the leader
more than the one op saved each replica (``bench/part_cork_cost.py``,
bench/profiles/store-cork.md).

The merged op's parts are the parts' parts, batches byte for byte, in part
order; its spans are the parts' spans in part order, each span's counts
widened to the merged parts (0 where its part has none). So each part's
answer is its own slice of the op's spans.

Invariant: only parts that name the same topic and topic id, whose own
layout is sound (``layout_ok``) and whose partitions are disjoint, are
merged; a part that is not sound is proposed alone, so it is refused alone.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    ``cork_key``, each ``layout_ok``, their partitions disjoint: ``corks``);
    returns, per op, the range of its spans in ``out``."""
    first = ops[0]
    out.topic, out.topic_id = first.topic, first.topic_id
    width = sum(len(op.parts) for op in ops)
    ranges: list[range] = []
    at = 0  # where the op's parts begin in ``out.parts``
    for op in ops:
        out.parts.extend(op.parts)
        start = len(out.spans)
        before, after = [0] * at, [0] * (width - at - len(op.parts))
        for span in op.spans:
            out.spans.add(
                client_id=span.client_id,
                producer_id=span.producer_id,
                sequence=span.sequence,
                producer_epoch=span.producer_epoch,
                counts=[*before, *span.counts, *after],
            )
        ranges.append(range(start, len(out.spans)))
        at += len(op.parts)
    return ranges


def corks(ops: Sequence[command_pb2.AppendOp], max_pings: int) -> list[list[int]]:
    """The positions of ``ops`` grouped for merging: per ``cork_key``, in
    arrival order, a part joining the key's open group if it shares no
    partition with it and the group stays within ``max_pings`` pings (else
    it opens the key's next group); a part whose layout is not sound alone."""
    out: list[list[int]] = []
    open_: dict[tuple[str, int], tuple[list[int], set[int], int]] = {}
    for i, op in enumerate(ops):
        if not layout_ok(op):
            out.append([i])
            continue
        key, n = cork_key(op), pings_of(op)
        mine = {p.partition for p in op.parts}
        cur = open_.get(key)
        if cur is not None and cur[2] + n <= max_pings and not cur[1] & mine:
            cur[0].append(i)
            open_[key] = (cur[0], cur[1] | mine, cur[2] + n)
            continue
        group = [i]
        out.append(group)
        open_[key] = (group, mine, n)
    return out
