"""A topic moved between two state machines as the mover does it
(issue 43, docs/federation.md "Topic moves"): the source fenced, its
batches imported at their offsets with its producers, consumer-group
offsets and heat-map rows; a producer's retry across the move answered as
a duplicate, nothing stored twice, a gap refused, the fence lifted again.
Real LMDB."""

from __future__ import annotations

from pathlib import Path

import pytest

from node_daemon.raft import Entry, EntryType
from node_daemon.state.machine import StateMachine, append_op
from roadlog.errors import Code
from roadlog.federation.move import moved_batches
from roadlog.partitioning import split_by_partition
from roadlog.v1 import client_pb2, clients_pb2, command_pb2, federation_pb2, groups_pb2
from tests.unit.node_daemon.state.test_state_machine import T0, Log, pings

pytestmark = pytest.mark.unit
PARTS = 4


def publish(
    log: Log, n: int, pid: int = 0, seq: int = 0, start: int = 0
) -> tuple[Code, bytes, str]:
    op = append_op("munich", split_by_partition(pings(n, start), PARTS), pid, seq, client_id="c")
    [res] = log.run(command_pb2.Command(leader_ms=T0 + start, ops=[op]))
    return res


def one(log: Log, op: command_pb2.Op) -> tuple[Code, bytes, str]:
    [res] = log.run(command_pb2.Command(leader_ms=T0, ops=[op]))
    return res


def fence(log: Log, lift: bool = False) -> tuple[Code, bytes, str]:
    req = federation_pb2.FenceTopicRequest(topic="munich", lift=lift)
    return one(log, command_pb2.Op(fence_topic=command_pb2.FenceTopicOp(request=req)))


def import_(log: Log, req: federation_pb2.ImportTopicRequest) -> federation_pb2.ImportTopicResponse:
    code, raw, msg = one(log, command_pb2.Op(import_topic=command_pb2.ImportTopicOp(request=req)))
    assert code == Code.OK, msg
    return federation_pb2.ImportTopicResponse.FromString(raw)


def batches_of(sm: StateMachine) -> list[federation_pb2.MovedBatch]:
    out = []
    for p in range(PARTS):
        resp = sm.fetch(client_pb2.FetchRequest(topic="munich", partition=p, max_pings=100_000))
        out.extend(moved_batches(p, resp))
    return out


def stored(sm: StateMachine) -> list[tuple[int, int, bytes]]:
    return [(b.partition, b.base_offset, b.batch) for b in batches_of(sm)]


def test_a_fenced_topic_moves_whole_with_its_producers_and_groups(tmp_path: Path) -> None:
    src, dst = Log(StateMachine(tmp_path / "src")), Log(StateMachine(tmp_path / "dst"))
    src.create("munich", PARTS)
    dst.create("munich", PARTS)
    assert src.issue(77, "c") == (Code.OK, "")
    for seq in range(1, 6):
        assert publish(src, 40, 77, seq, start=seq * 40)[0] == Code.OK
    assert publish(src, 25)[0] == Code.OK  # a plain publish too
    join = client_pb2.JoinGroupRequest(group="dash", topic="munich", member_id="m1")
    code, raw, _ = one(src, command_pb2.Op(join_group=command_pb2.JoinGroupOp(request=join)))
    gen = client_pb2.JoinGroupResponse.FromString(raw).generation
    commit = client_pb2.CommitOffsetsRequest(
        group="dash",
        member_id="m1",
        generation=gen,
        offsets=[groups_pb2.CommittedOffset(partition=1, offset=3)],
    )
    op = command_pb2.Op(commit_offsets=command_pb2.CommitOffsetsOp(request=commit))
    assert one(src, op)[0] == Code.OK

    # Bulk copy while the source still takes writes, then the fence.
    assert import_(
        dst, federation_pb2.ImportTopicRequest(topic="munich", batches=batches_of(src.sm))
    )
    assert publish(src, 30, 77, 6, start=400)[0] == Code.OK
    code, raw, _ = fence(src)
    assert code == Code.OK
    ends = list(federation_pb2.FenceTopicResponse.FromString(raw).next_offsets)
    assert sum(ends) == 5 * 40 + 25 + 30
    # Fenced: appends (plain or idempotent), commits and heat maps refused.
    for res in (publish(src, 5), publish(src, 5, 77, 7), one(src, op)):
        assert res[0] == Code.UNAVAILABLE and "moving" in res[2]
    # The leader's early answers (told before the apply) refuse it alike.
    plain = append_op("munich", split_by_partition(pings(5), PARTS))
    cmd = command_pb2.Command(leader_ms=T0, ops=[plain]).SerializeToString()
    told = src.sm.answers([Entry(1, src.index + 1, EntryType.NORMAL, cmd)])
    assert told is not None and told[0][0].code == Code.UNAVAILABLE

    # The tail and the state, as at the fence; an import retried stores nothing twice.
    tail = federation_pb2.ImportTopicRequest(topic="munich", batches=batches_of(src.sm))
    state = src.sm.export_topic_state("munich")
    assert [p.producer_id for p in state.producers] == [77]
    assert [g.group.name for g in state.groups] == ["dash"]
    for _ in range(2):
        got = import_(dst, tail)
    assert list(got.next_offsets) == ends
    full = federation_pb2.ImportTopicRequest(
        topic="munich", producers=state.producers, groups=state.groups, rows=state.rows
    )
    assert import_(dst, full).producers_unmapped == 0
    assert stored(dst.sm) == stored(src.sm)

    # The producer's last batch sent again at the target: a duplicate, the
    # original offsets; its next sequence stored once.
    code, raw, _ = publish(dst, 30, 77, 6, start=400)
    again = client_pb2.PublishResponse.FromString(raw)
    assert code == Code.OK and again.duplicate
    code, raw, _ = publish(dst, 10, 77, 7, start=500)
    assert code == Code.OK and not client_pb2.PublishResponse.FromString(raw).duplicate
    assert sum(p.next_offset for p in dst.sm.describe("munich").partitions) == sum(ends) + 10
    # The group resumes at its commit there.
    offsets = {o.partition: o.offset for o in dst.sm.describe_group("dash").offsets}
    assert offsets == {1: 3}

    # A batch that would leave a gap is refused.
    held = next(p.partition for p in dst.sm.describe("munich").partitions if p.next_offset)
    gap = federation_pb2.MovedBatch(partition=held, base_offset=10_000, count=1, batch=b"")
    req = federation_pb2.ImportTopicRequest(topic="munich", batches=[gap])
    code, _, msg = one(dst, command_pb2.Op(import_topic=command_pb2.ImportTopicOp(request=req)))
    assert code == Code.FAILED_PRECONDITION and "gap" in msg

    # The fence lifted (a move abandoned): the source takes writes again.
    assert fence(src, lift=True)[0] == Code.OK
    assert publish(src, 5, 77, 7, start=600)[0] == Code.OK


def test_a_bound_producer_is_mapped_by_its_owners_token_or_left_out(tmp_path: Path) -> None:
    dst = Log(StateMachine(tmp_path / "dst"))
    dst.create("munich", PARTS)
    ident = command_pb2.CreateClientOp(
        identity=clients_pb2.ClientIdentity(name="car", client_id="cl-here", scopes=["admin"]),
        token_hash=b"h" * 32,
    )
    assert one(dst, command_pb2.Op(create_client=ident))[0] == Code.OK
    known = federation_pb2.MovedProducer(
        producer_id=5, client_id="cl-there", bound=True, owner_token_hash=b"h" * 32
    )
    unknown = federation_pb2.MovedProducer(
        producer_id=6, client_id="cl-else", bound=True, owner_token_hash=b"x" * 32
    )
    req = federation_pb2.ImportTopicRequest(topic="munich", producers=[known, unknown])
    assert import_(dst, req).producers_unmapped == 1
    with dst.sm.env.begin() as txn:
        assert dst.sm.producers.refusal(txn, 5, "cl-here", cached=False) is None
        assert dst.sm.producers.refusal(txn, 6, "cl-else", cached=False) is not None


def test_a_topic_in_data_groups_does_not_move_yet(tmp_path: Path) -> None:
    log = Log(StateMachine(tmp_path / "sm"))
    log.create("munich", PARTS)
    with log.sm.env.begin(write=True) as txn:
        topic = log.sm.topics.get(txn, "munich")
        topic.partition_groups[:] = [1] * PARTS
        txn.put(b"munich", topic.SerializeToString(), db=log.sm.topics.records)
    code, _, msg = fence(log)
    assert code == Code.FAILED_PRECONDITION and "data groups" in msg
