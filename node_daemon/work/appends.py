"""Publish requests to append operations (server-side group commit).

Publishes that reach the leader together are merged per topic: each request
is parsed on its own (a malformed one fails alone), the pings of all of
them become one set of columns at once (``columnar.join``: one array per
column), are checked at once and split by partition in one pass (each
ping's partition once, one stable permutation, each column gathered once,
each partition's PingBatch written from slices of the permuted columns),
and one AppendOp carries them with one span per request. A request with a
bad ping is refused alone, with ping indexes relative to its own batch; the
others still go in. So many small publishes cost one validation, one split
and one encoding, and one set of LMDB writes on every replica.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from roadlog import columnar
from roadlog.columnar import ColumnBytes
from roadlog.geo import Region
from roadlog.partitioning import device_facts, permuted, plan_split
from roadlog.v1 import client_pb2, command_pb2
from roadlog.validation import (
    MAX_DEVICE_ID_BYTES,
    BatchRejected,
    check_size,
    ping_reasons,
    raise_if_bad,
)

MAX_PINGS_PER_OP = 50_000  # about 2 MB of pings: keeps Raft entries bounded

TopicLookup = Callable[[str], tuple[int, Region]]  # name -> (partitions, region)


class MalformedRequest(ValueError):
    """A publish request that is not a PublishRequest or not a PingBatch."""


@dataclass(frozen=True)
class PreparedAppend:
    """One append operation and, per span in span order, the position of the
    request it came from."""

    op: command_pb2.Op
    members: list[int]


@dataclass(eq=False, slots=True)
class _Request:  # one per publish: slotted, unfrozen (cheaper to make); never changed
    position: int
    view: client_pb2.PublishRequestView
    pings: ColumnBytes  # decoded together with the rest of its chunk (columnar.join)


def prepare_appends(
    requests: Sequence[bytes],
    lookup: TopicLookup,
    now_ms: int,
    max_pings_per_op: int = MAX_PINGS_PER_OP,
    clients: Sequence[str] = (),
) -> tuple[list[PreparedAppend], dict[int, Exception]]:
    """Merge serialized PublishRequests into append ops. Returns the ops and,
    by request position, why each refused request was refused. Every
    position is in exactly one of the two. ``clients``: by position, the
    authenticated client id that sent it, which replaces the one the
    request declares ("" or none given: the declared one)."""
    errors: dict[int, Exception] = {}
    by_topic: dict[str, list[_Request]] = {}
    for i, raw in enumerate(requests):
        try:
            view = client_pb2.PublishRequestView.FromString(raw)
            if i < len(clients) and clients[i]:
                view.client_id = clients[i]
            pings = columnar.parse(view.batch)
            check_size(pings.n)
        except (DecodeError, columnar.BatchDecodeError) as e:
            errors[i] = MalformedRequest(f"malformed request: {e}")
            continue
        except BatchRejected as e:
            errors[i] = e
            continue
        by_topic.setdefault(view.topic, []).append(_Request(i, view, pings))
    out: list[PreparedAppend] = []
    for topic, reqs in by_topic.items():
        try:
            partitions, region = lookup(topic)
        except Exception as e:
            for r in reqs:
                errors[r.position] = e
            continue
        for chunk in _chunks(reqs, max_pings_per_op):
            prepared = _merge(topic, partitions, region, chunk, now_ms, errors)
            if prepared is not None:
                out.append(prepared)
    return out, errors


def _chunks(reqs: list[_Request], max_pings: int) -> list[list[_Request]]:
    chunks: list[list[_Request]] = [[]]
    pings = 0
    for r in reqs:
        if chunks[-1] and pings + r.pings.n > max_pings:
            chunks.append([])
            pings = 0
        chunks[-1].append(r)
        pings += r.pings.n
    return chunks


def _merge(
    topic: str,
    partitions: int,
    region: Region,
    chunk: list[_Request],
    now_ms: int,
    errors: dict[int, Exception],
) -> PreparedAppend | None:
    merged = columnar.join([r.pings for r in chunk])
    facts = device_facts(merged.device_ids)
    ids_ok = not facts.fields or (facts.shortest >= 1 and facts.longest <= MAX_DEVICE_ID_BYTES)
    reasons = ping_reasons(merged, region, now_ms, ids_ok)
    keep: list[_Request] = chunk
    if reasons.any():
        keep = []
        lo = 0
        for r in chunk:
            hi = lo + r.pings.n
            try:
                raise_if_bad(reasons[lo:hi])
                keep.append(r)
            except BatchRejected as e:
                errors[r.position] = e
            lo = hi
    if not keep:
        return None
    lengths = [r.pings.n for r in keep]
    if len(keep) < len(chunk):
        kept_at = {r.position for r in keep}
        kept = np.repeat([r.position in kept_at for r in chunk], [r.pings.n for r in chunk])
        merged = merged.take(np.flatnonzero(kept))  # its dictionary: the ids still used
        facts = device_facts(merged.device_ids)
    # One pass: each ping's partition once, one stable permutation, each
    # column gathered once, each partition's batch written from slices.
    split = plan_split(facts.partitions(partitions), merged.device_index, partitions)
    fields = facts.fields
    grouped = [fields[i] for i in split.devices.tolist()]
    batches = columnar.encode_runs(
        permuted(merged, split), split.bounds, [grouped[lo:hi] for lo, hi in split.device_ranges]
    )
    if len(keep) == 1:
        span_counts = [split.sizes]
    else:
        row_span = np.repeat(np.arange(len(keep)), lengths)
        cells = row_span * partitions + split.ping_partition
        counts = np.bincount(cells, minlength=len(keep) * partitions)
        span_counts = counts.reshape(len(keep), partitions)[:, split.partitions].tolist()
    wrapper = command_pb2.Op()
    op = wrapper.append  # filled in place: wrapping it afterwards would copy the pings
    op.topic = topic
    for p, batch, size in zip(split.partitions, batches, split.sizes, strict=True):
        op.parts.add(partition=p, batch=batch, count=size)
    for r, row in zip(keep, span_counts, strict=True):
        op.spans.add(
            client_id=r.view.client_id,
            producer_id=r.view.producer_id,
            sequence=r.view.sequence,
            counts=row,
            producer_epoch=r.view.producer_epoch,
        )
    return PreparedAppend(wrapper, [r.position for r in keep])


def split_by_group(
    op: command_pb2.AppendOp, groups: Sequence[int], topic_id: int = 0
) -> list[tuple[int, command_pb2.AppendOp, list[int]]]:
    """An append op's parts regrouped by the Raft group that holds each
    partition (``groups[partition]``, a placed topic's map): per group, in
    group order, an AppendOp with that group's parts (their batches as they
    are: parts are per partition already) and the spans that have pings
    there, each span's counts cut to those parts, and the indexes in
    ``op.spans`` of those spans. Every ping is in exactly one group's op;
    each op carries ``topic_id`` (the group refuses it for another topic of
    the same name)."""
    by_group: dict[int, list[int]] = {}
    for i, part in enumerate(op.parts):
        by_group.setdefault(int(groups[part.partition]), []).append(i)
    out: list[tuple[int, command_pb2.AppendOp, list[int]]] = []
    for g in sorted(by_group):
        idx = by_group[g]
        sub = command_pb2.AppendOp(topic=op.topic, topic_id=topic_id)
        sub.parts.extend(op.parts[i] for i in idx)
        members: list[int] = []
        for j, span in enumerate(op.spans):
            counts = [span.counts[i] for i in idx]
            if not any(counts):
                continue
            sub.spans.add(
                client_id=span.client_id,
                producer_id=span.producer_id,
                sequence=span.sequence,
                producer_epoch=span.producer_epoch,
                counts=counts,
            )
            members.append(j)
        out.append((g, sub, members))
    return out
