"""Producer epochs (issue 19: producer ids issued as (id, epoch) to the
principal and fenced on append). An identity that holds a producer id may
take it again under its next epoch (a restarted producer resuming its id):
appends under the old epoch are refused from then on (the old instance is
fenced), the new epoch's sequences start afresh, and a retry within an
epoch is still answered as a duplicate. Group 0 checks the epoch it
records; a data group, which knows no epochs, learns a later one from its
own records. Real LMDB, replicas compared by digest."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from node_daemon.state.machine import StateMachine, append_op, trim_op
from node_daemon.state.producers import _parse_seq_record, _seq_record
from node_daemon.work.handler import WorkHandler
from roadlog import columnar
from roadlog.errors import Code
from roadlog.partitioning import split_by_partition
from roadlog.v1 import client_pb2, command_pb2, work_pb2
from tests.unit.node_daemon.state.test_state_machine import T0, Log, pings
from tests.unit.node_daemon.work.test_data_group_appends import Group, issue, publish, stored
from tests.unit.node_daemon.work.test_data_group_appends import groups as groups  # the fixture

pytestmark = pytest.mark.unit


def renew(log: Log, pid: int, client: str) -> tuple[Code, int, str]:
    """InitProducer for an id the client holds: (code, new epoch, message)."""
    op = command_pb2.InitProducerOp(client_id=client, producer_id=pid, next_epoch=True)
    [(code, raw, msg)] = log.run(
        command_pb2.Command(leader_ms=T0, ops=[command_pb2.Op(init_producer=op)])
    )
    epoch = client_pb2.InitProducerResponse.FromString(raw).epoch if code == Code.OK else -1
    return code, epoch, msg


def append(
    log: Log, pid: int, seq: int, epoch: int, client: str = "c", n: int = 5
) -> tuple[Code, client_pb2.PublishResponse, str]:
    op = append_op("munich", split_by_partition(pings(n), 4), pid, seq, client_id=client)
    op.append.spans[0].producer_epoch = epoch
    [(code, raw, msg)] = log.run(command_pb2.Command(leader_ms=T0, ops=[op]))
    return code, client_pb2.PublishResponse.FromString(raw), msg


def test_a_renewed_id_fences_the_old_epoch_and_starts_its_sequences_afresh(
    tmp_path: Path,
) -> None:
    replicas = [Log(StateMachine(tmp_path / name)) for name in ("a", "b")]
    for log in replicas:
        log.create()
        assert log.issue(77, "alice") == (Code.OK, "")
        code, first, _ = append(log, 77, 1, 0, "alice")
        assert code == Code.OK and not first.duplicate
        # alice's producer restarts and resumes its id under epoch 1.
        assert renew(log, 77, "alice")[:2] == (Code.OK, 1)
        # The old instance, still running, is refused: new pings and retries alike.
        code, _, msg = append(log, 77, 2, 0, "alice")
        assert code == Code.FAILED_PRECONDITION and "fenced" in msg and "epoch 1" in msg
        code, _, msg = append(log, 77, 1, 0, "alice")
        assert code == Code.FAILED_PRECONDITION and "fenced" in msg
        # Epoch 1 numbers from 1 again: not a duplicate of epoch 0's sequence 1.
        code, new, _ = append(log, 77, 1, 1, "alice")
        assert code == Code.OK and not new.duplicate
        assert new.offsets[0].base_offset > first.offsets[0].base_offset
        code, again, _ = append(log, 77, 1, 1, "alice")  # a retry within the epoch
        assert code == Code.OK and again.duplicate and list(again.offsets) == list(new.offsets)
        # An epoch nobody was given yet.
        code, _, msg = append(log, 77, 2, 2, "alice")
        assert code == Code.FAILED_PRECONDITION and "no epoch 2" in msg
    a, b = (log.sm for log in replicas)
    assert a.digest() == b.digest()
    stored_pings = sum(
        a.fetch(client_pb2.FetchRequest(topic="munich", partition=p)).end_offset for p in range(4)
    )
    assert stored_pings == 10  # epoch 0's one batch and epoch 1's one, nothing fenced


def test_only_the_holder_renews_a_known_id(tmp_path: Path) -> None:
    log = Log(StateMachine(tmp_path / "s"))
    log.create()
    assert log.issue(77, "alice") == (Code.OK, "")
    code, _, msg = renew(log, 77, "mallory")
    assert code == Code.PERMISSION_DENIED and "another client" in msg
    code, _, msg = renew(log, 78, "alice")
    assert code == Code.FAILED_PRECONDITION and "unknown producer id 78" in msg
    # Mallory's try changed nothing: alice's epoch 0 still appends.
    assert append(log, 77, 1, 0, "alice")[0] == Code.OK
    assert [renew(log, 77, "alice")[1] for _ in range(3)] == [1, 2, 3]


def test_records_keep_the_layout_of_before_epochs_at_epoch_0() -> None:
    recent = [(1, 0, 5), (2, 5, 3)]
    assert len(_seq_record(0, recent)) == 40  # as written before epochs: readable both ways
    assert _parse_seq_record(_seq_record(0, recent)) == (0, recent)
    assert _parse_seq_record(_seq_record(7, recent)) == (7, recent)
    assert _parse_seq_record(_seq_record(7, [])) == (7, [])


def test_records_of_a_renewed_id_expire_and_the_id_is_forgotten_with_them(
    tmp_path: Path,
) -> None:
    log = Log(StateMachine(tmp_path / "s"))
    log.create(retention_ms=1000)
    assert log.issue(77, "alice") == (Code.OK, "")
    assert renew(log, 77, "alice")[:2] == (Code.OK, 1)
    assert append(log, 77, 1, 1, "alice")[0] == Code.OK
    later = T0 + 10 * 86_400_000
    log.run(command_pb2.Command(leader_ms=later, ops=[trim_op()]))  # pings, then records
    assert log.sm.expirable_producers() == [77]  # renewed at T0: past its lifetime
    log.run(command_pb2.Command(leader_ms=later, ops=[trim_op(expired_producers=[77])]))
    assert not log.issued(77)
    assert renew(log, 77, "alice")[0] == Code.FAILED_PRECONDITION


def test_a_data_group_refuses_an_epoch_group_0_has_moved_past(
    groups: tuple[Group, Group],
) -> None:
    meta, data = groups
    issue(meta, 77, "alice")

    def send(seq: int, epoch: int) -> work_pb2.WorkResult:
        req = client_pb2.PublishRequest.FromString(publish(77, seq))
        req.producer_epoch = epoch

        async def go() -> work_pb2.WorkResult:
            item = work_pb2.WorkItem(
                id=1,
                method="Publish",
                request=req.SerializeToString(),
                principal="alice",
                group=1,
            )
            return await WorkHandler(data).run(item)  # type: ignore[arg-type]

        return asyncio.run(go())

    assert send(1, 0).code == 0
    op = command_pb2.InitProducerOp(client_id="alice", producer_id=77, next_epoch=True)
    assert meta.commit(command_pb2.Op(init_producer=op)).code == 0
    fenced = send(2, 0)  # the leader asks group 0's replica first
    assert fenced.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "fenced" in fenced.message
    assert send(1, 1).code == 0 and stored(data) == 12
    # An append of epoch 0 that passed the leader's check just before the
    # renewal, applied after epoch 1 wrote: the data group's records fence it.
    sent = client_pb2.PublishRequest.FromString(publish(77, 3))  # epoch 1's partitions
    cols = columnar.decode(sent.batch.SerializeToString())
    late = append_op("munich", split_by_partition(cols, 4), 77, 3, client_id="alice")
    late.append.spans[0].producer_epoch = 0
    result = data.commit(late)
    assert result.spans[0].code == Code.FAILED_PRECONDITION and "fenced" in result.spans[0].message
    assert stored(data) == 12
