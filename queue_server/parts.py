"""Publishes split across Raft groups (multi-raft, docs/multiraft.md): the
queue server's side, sans I/O.

Group 0's leader validates a publish to a topic placed in data groups and
answers with parts (``WorkResult.parts``): per data group, an AppendOp with
a span per publish that has pings there. The queue server hands each part
to its group's leader as an ``AppendPart`` write and, once every part is
answered, merges the answers into the client's: per publish, the offsets of
all its parts, ``duplicate`` only if every part was a retry of one stored
before, and each group's index as a fence (``group_fences``; the group 0
fence ``applied_index`` is 0, nothing being written there).

Invariant: a publish is answered OK only if every part it is in was
stored; otherwise with the first refusal among its parts (the others may
have stored theirs: a retry with the same producer id and sequence stores
each part once).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from roadlog.errors import Code, RoadlogError
from roadlog.v1 import client_pb2, command_pb2, work_pb2


@dataclass
class _Answer:
    """One publish's answer as its parts come in."""

    refused: tuple[int, str] | None = None
    offsets: list[client_pb2.PartitionOffsets] = field(default_factory=list)
    duplicates: list[bool] = field(default_factory=list)
    fences: dict[int, int] = field(default_factory=dict)

    def refuse(self, code: int, message: str) -> None:
        if self.refused is None:
            self.refused = (code, message)

    def response(self) -> client_pb2.PublishResponse:
        resp = client_pb2.PublishResponse(duplicate=bool(self.duplicates) and all(self.duplicates))
        resp.offsets.extend(sorted(self.offsets, key=lambda o: o.partition))
        for g in sorted(self.fences):
            resp.group_fences.add(group=g, applied_index=self.fences[g])
        return resp


def merge(
    lone: bool,
    refusals: bytes,
    parts: Sequence[work_pb2.WorkPart],
    results: Sequence[work_pb2.WorkResult],
) -> bytes:
    """The client's answer to a split publish: ``lone`` a Publish (a
    PublishResponse, or RoadlogError), else a PublishBatch (a
    PublishBatchResponse, a result per publish). ``refusals`` is group 0's
    answer (the publishes it refused; empty for a lone one), ``results``
    each part's, in the order of ``parts``."""
    if lone:
        answers = [_Answer()]
    else:
        batch = client_pb2.PublishBatchResponse.FromString(refusals)
        answers = [_Answer() for _ in batch.results]
        for a, r in zip(answers, batch.results, strict=True):
            if r.code:
                a.refuse(r.code, r.message)
    for part, result in zip(parts, results, strict=True):
        _take(answers, part, result)
    if lone:
        (a,) = answers
        if a.refused is not None:
            raise RoadlogError(Code.of(a.refused[0]), a.refused[1])
        return a.response().SerializeToString()
    out = client_pb2.PublishBatchResponse()
    for a in answers:
        if a.refused is not None:
            out.results.add(code=a.refused[0], message=a.refused[1])
        else:
            out.results.add(response=a.response())
    return out.SerializeToString()


def _take(answers: list[_Answer], part: work_pb2.WorkPart, result: work_pb2.WorkResult) -> None:
    """One part's answer into its publishes'."""
    if not all(0 <= m < len(answers) for m in part.members):
        raise RoadlogError(Code.INTERNAL, "a part names a publish the call does not have")
    if result.code:
        for m in part.members:
            answers[m].refuse(result.code, result.message)
        return
    try:
        spans = list(client_pb2.PublishBatchResponse.FromString(result.response).results)
    except DecodeError:
        spans = []
    if len(spans) != len(part.members):
        for m in part.members:
            answers[m].refuse(Code.INTERNAL, "a part's answer does not match its spans")
        return
    for m, span in zip(part.members, spans, strict=True):
        a = answers[m]
        if span.code:
            a.refuse(span.code, span.message)
            continue
        a.offsets.extend(span.response.offsets)
        a.duplicates.append(span.response.duplicate)
        told = [f.applied_index for f in span.response.group_fences if f.group == part.group]
        index = max([span.response.applied_index, *told])
        a.fences[part.group] = max(a.fences.get(part.group, 0), index)


def replayable_part(request: bytes) -> bool:
    """Whether a part may be handed to another node after the one that took
    it left: when every span names a producer id (stored once however often
    it is appended)."""
    try:
        op = command_pb2.AppendOp.FromString(request)
    except DecodeError:
        return True  # refused as malformed wherever it goes
    return bool(op.spans) and all(s.producer_id for s in op.spans)
