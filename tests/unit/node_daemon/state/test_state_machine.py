"""The replicated state machine on real LMDB: topics, appends with dense
offsets, idempotent producers, fetch by offset, retention, time windows,
digests and snapshots."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from node_daemon.raft import Entry, EntryType
from node_daemon.state.machine import StateMachine, append_op
from node_daemon.state.responses import OpResult
from node_daemon.storage.raft_log import LmdbLogStorage
from roadlog import columnar
from roadlog.columnar import PingColumns
from roadlog.errors import Code
from roadlog.geo import bbox_region
from roadlog.partitioning import split_by_partition
from roadlog.v1 import client_pb2, command_pb2, topics_pb2

pytestmark = pytest.mark.unit

REGION = bbox_region(11.4, 48.05, 11.75, 48.25).geojson
T0 = 1_800_000_000_000


class Log:
    """Feeds commands to a state machine as consecutive committed entries."""

    def __init__(self, sm: StateMachine) -> None:
        self.sm = sm
        self.index = sm.applied_index

    def results(self, cmd: command_pb2.Command) -> list[OpResult]:
        self.index += 1
        entry = Entry(1, self.index, EntryType.NORMAL, cmd.SerializeToString())
        if isinstance(self.sm.entries, LmdbLogStorage):  # the node's order: logged, then applied
            self.sm.entries.save(None, [entry])
        [res] = self.sm.apply([entry])
        return res

    def run(self, cmd: command_pb2.Command) -> list[tuple[Code, bytes, str]]:
        """One (code, response, message) per op; an append op's single span's."""
        out = []
        for r in self.results(cmd):
            if r.spans:
                [r] = r.spans
            out.append((r.code, r.response, r.message))
        return out

    def create(
        self, name: str = "munich", partitions: int = 4, retention_ms: int = 0
    ) -> topics_pb2.TopicDescription:
        spec = topics_pb2.TopicSpec(
            name=name, region_geojson=REGION, partitions=partitions, retention_ms=retention_ms
        )
        op = command_pb2.Op(create_topic=command_pb2.CreateTopicOp(spec=spec))
        [(code, raw, msg)] = self.run(command_pb2.Command(leader_ms=T0, ops=[op]))
        assert code == Code.OK, msg
        return topics_pb2.TopicDescription.FromString(raw)

    def issue(self, pid: int, client: str = "c") -> tuple[Code, str]:
        op = command_pb2.Op(
            init_producer=command_pb2.InitProducerOp(client_id=client, producer_id=pid)
        )
        [(code, _, msg)] = self.run(command_pb2.Command(leader_ms=T0, ops=[op]))
        return code, msg

    def issued(self, pid: int) -> bool:
        with self.sm.env.begin() as txn:
            return self.sm.producers.issued(txn, pid)

    def append(
        self,
        cols: PingColumns,
        at_ms: int = T0,
        producer: int = 0,
        seq: int = 0,
        topic: str = "munich",
        issue: bool = True,
    ) -> tuple[Code, client_pb2.PublishResponse, str]:
        """Append; a producer id is issued first (as InitProducer does) unless
        ``issue`` is False."""
        if producer and issue and not self.issued(producer):
            self.issue(producer)
        op = append_op(topic, split_by_partition(cols, 4), producer, seq)
        cmd = command_pb2.Command(leader_ms=at_ms, ops=[op])
        [(code, raw, msg)] = self.run(cmd)
        return code, client_pb2.PublishResponse.FromString(raw), msg


def pings(n: int, start: int = 0, devices: int = 5) -> PingColumns:
    return PingColumns.from_columns(
        [f"car-{i % devices}" for i in range(start, start + n)],
        [T0 + i for i in range(start, start + n)],
        [48.1] * n,
        [11.5] * n,
        speed_mps=[float(i % 30) for i in range(start, start + n)],
    )


@pytest.fixture(params=["bytes", "refs"])
def sm(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[StateMachine]:
    """A state alone (batches stored as bytes), and one with its node's Raft
    log (batches stored as references into the log's entries)."""
    log = LmdbLogStorage(tmp_path / "raft", map_size=64 << 20) if request.param == "refs" else None
    s = StateMachine(tmp_path / "sm", map_size=64 << 20, entries=log)
    yield s
    s.close()
    if log is not None:
        log.close()


def read_all(sm: StateMachine, partition: int, offset: int = 0, max_pings: int = 0) -> list[int]:
    resp = sm.fetch(
        client_pb2.FetchRequest(
            topic="munich", partition=partition, offset=offset, max_pings=max_pings
        )
    )
    out: list[int] = []
    for b in resp.batches:
        cols = columnar.decode(b.batch)
        assert b.base_offset == offset + len(out)
        out += cols.ts_ms.tolist()
    return out


def test_topics_come_in_pages_by_count_and_by_bytes(sm: StateMachine) -> None:
    log = Log(sm)
    names = [f"city{i:02d}" for i in range(7)]
    for name in reversed(names):
        log.create(name)
    pages, token = [], ""
    while True:
        page, token = sm.topics_page(token, limit=3, max_bytes=1 << 20)
        pages.append([t.topic.spec.name for t in page])
        if not token:
            break
    assert pages == [names[0:3], names[3:6], names[6:7]]  # name order, each once
    one = sm.describe(names[0]).ByteSize()
    page, token = sm.topics_page("", limit=100, max_bytes=2 * one)
    assert [t.topic.spec.name for t in page] == names[:2] and token == names[1]
    page, token = sm.topics_page("", limit=100, max_bytes=1)  # always at least one
    assert len(page) == 1 and token == names[0]
    assert sm.topics_page(names[-1], limit=3, max_bytes=1 << 20) == ([], "")
    assert sm.topics_page("zzz", limit=3, max_bytes=1 << 20) == ([], "")


def test_create_describe_and_list(sm: StateMachine) -> None:
    log = Log(sm)
    created = log.create()
    assert created.applied_index == log.index  # a read fence for what follows
    d = sm.describe("munich")
    assert d.topic.spec.partitions == 4 and d.topic.spec.h3_resolution == 9
    assert [p.next_offset for p in d.partitions] == [0, 0, 0, 0]
    assert [t.topic.spec.name for t in sm.list_topics()] == ["munich"]
    log.create()  # the same request again is fine
    spec = topics_pb2.TopicSpec(name="munich", region_geojson=REGION, partitions=2)
    [(code, _, msg)] = log.run(
        command_pb2.Command(ops=[command_pb2.Op(create_topic=command_pb2.CreateTopicOp(spec=spec))])
    )
    assert code == Code.ALREADY_EXISTS and "exists" in msg


def test_offsets_are_dense_and_keep_the_order_sent(sm: StateMachine) -> None:
    log = Log(sm)
    log.create()
    sent: dict[int, list[int]] = {}
    for k in range(10):
        code, resp, _ = log.append(pings(50, start=k * 50))
        assert code == Code.OK
        for o in resp.offsets:
            sent.setdefault(o.partition, [])
            assert o.base_offset == sum(1 for _ in sent[o.partition])
            sent[o.partition] += [0] * o.count
    for p in range(4):
        ts = read_all(sm, p)
        assert len(ts) == len(sent.get(p, []))
        assert ts == sorted(ts)  # each device's pings, in the order sent
    assert sum(len(read_all(sm, p)) for p in range(4)) == 500


def test_fetch_from_the_middle_of_a_batch_and_with_a_limit(sm: StateMachine) -> None:
    log = Log(sm)
    log.create()
    for k in range(4):
        log.append(pings(100, start=k * 100, devices=1))
    p = next(o.partition for o in log.append(pings(1, start=999, devices=1))[1].offsets)
    full = read_all(sm, p)
    assert read_all(sm, p, offset=150) == full[150:]
    resp = sm.fetch(client_pb2.FetchRequest(topic="munich", partition=p, offset=30, max_pings=150))
    got = sum(len(columnar.decode(b.batch)) for b in resp.batches)
    assert resp.batches[0].base_offset == 30 and got == 70  # whole batches, up to the limit
    assert resp.next_offset == 100 and resp.end_offset == 401


def test_a_producer_id_never_issued_is_refused_and_cannot_hijack_one(sm: StateMachine) -> None:
    """Finding 3 of issue 19: producer ids were handed out in order and
    taken unchecked, so a stranger could pre-write a victim's sequences (the
    victim then got duplicate=True for pings never stored) or block future
    ids. Now an id must have been issued, at random, to be used."""
    log = Log(sm)
    log.create()
    before = sum(len(read_all(sm, p)) for p in range(4))
    code, _, msg = log.append(pings(5), producer=424242, seq=1, issue=False)
    assert code == Code.FAILED_PRECONDITION and "unknown producer id 424242" in msg
    code, _, msg = log.append(pings(5), producer=2**63 - 1, seq=2**63, issue=False)
    assert code == Code.FAILED_PRECONDITION
    assert sum(len(read_all(sm, p)) for p in range(4)) == before  # nothing stored
    # Issued, it works; its sequences are its own.
    assert log.issue(424242) == (Code.OK, "")
    code, first, _ = log.append(pings(5), producer=424242, seq=1)
    assert code == Code.OK and not first.duplicate
    # The same id again (a clash the leader's draw would have to hit): refused.
    code, msg = log.issue(424242)
    assert code == Code.ABORTED and "taken" in msg
    # Ids of the old counter stay valid: entries from before random ids.
    legacy = command_pb2.Op(init_producer=command_pb2.InitProducerOp(client_id="old"))
    [(code, raw, _)] = log.run(command_pb2.Command(leader_ms=T0, ops=[legacy]))
    old_id = client_pb2.InitProducerResponse.FromString(raw).producer_id
    assert code == Code.OK and old_id == 1
    assert log.append(pings(5, start=5), producer=old_id, seq=1, issue=False)[0] == Code.OK
    assert log.append(pings(5, start=9), producer=old_id + 1, seq=1, issue=False)[0] != Code.OK


def test_a_retried_batch_is_stored_once_with_its_original_offsets(sm: StateMachine) -> None:
    log = Log(sm)
    log.create()
    _, first, _ = log.append(pings(20), producer=7, seq=1)
    _, again, _ = log.append(pings(20), producer=7, seq=1)
    assert again.duplicate and list(again.offsets) == list(first.offsets)
    # The retry's answer is a read fence that covers the stored original.
    assert again.applied_index > first.applied_index > 0
    _, nxt, _ = log.append(pings(20, start=20), producer=7, seq=2)
    assert not nxt.duplicate
    assert sum(len(read_all(sm, p)) for p in range(4)) == 40
    # A pipelined older batch retried after a newer one is still recognised.
    _, old, _ = log.append(pings(20), producer=7, seq=1)
    assert old.duplicate and list(old.offsets) == list(first.offsets)


def test_unknown_topic_and_partition_are_clear_errors(sm: StateMachine) -> None:
    log = Log(sm)
    code, _, msg = log.append(pings(3), topic="nowhere")
    assert code == Code.NOT_FOUND and "nowhere" in msg
    log.create()
    with pytest.raises(Exception, match="no partition"):
        sm.fetch(client_pb2.FetchRequest(topic="munich", partition=99))
    with pytest.raises(Exception, match="beyond the end"):
        sm.fetch(client_pb2.FetchRequest(topic="munich", partition=0, offset=5))


def test_retention_trims_old_batches_and_moves_the_first_offset(sm: StateMachine) -> None:
    log = Log(sm)
    log.create(retention_ms=60_000)
    for k in range(5):
        log.append(pings(10, start=k * 10, devices=1), at_ms=T0 + k * 30_000)
    p = next(o.partition for o in log.append(pings(1, devices=1), at_ms=T0 + 150_000)[1].offsets)
    trim = command_pb2.Command(
        leader_ms=T0 + 150_000, ops=[command_pb2.Op(trim=command_pb2.TrimOp())]
    )
    log.run(trim)
    d = sm.describe("munich").partitions[p]
    assert d.first_offset == 30 and d.next_offset == 51  # batches older than 60 s are gone
    resp = sm.fetch(client_pb2.FetchRequest(topic="munich", partition=p, offset=0))
    assert resp.batches[0].base_offset == 30


def test_time_window_to_offsets(sm: StateMachine) -> None:
    log = Log(sm)
    log.create()
    for k in range(5):
        log.append(pings(10, devices=1), at_ms=T0 + k * 1000)
    p = next(o.partition for o in log.append(pings(1, devices=1), at_ms=T0 + 9000)[1].offsets)
    assert sm.offsets_for_window("munich", p, T0 + 1000, T0 + 3000) == (10, 30)
    assert sm.offsets_for_window("munich", p, T0 + 50_000, T0 + 60_000) == (51, 51)


def test_delete_topic_removes_its_data(sm: StateMachine) -> None:
    log = Log(sm)
    log.create()
    log.append(pings(30), producer=3, seq=1)
    [(code, raw, _)] = log.run(
        command_pb2.Command(
            ops=[command_pb2.Op(delete_topic=command_pb2.DeleteTopicOp(name="munich"))]
        )
    )
    deleted = client_pb2.DeleteTopicResponse.FromString(raw)
    assert code == Code.OK and deleted.deleted and deleted.applied_index == log.index
    assert sm.list_topics() == []
    log.create()
    assert all(p.next_offset == 0 for p in sm.describe("munich").partitions)


def test_replicas_that_applied_the_same_entries_are_identical(tmp_path: Path) -> None:
    a, b = StateMachine(tmp_path / "a"), StateMachine(tmp_path / "b")
    for sm in (a, b):
        log = Log(sm)
        log.create()
        for k in range(5):
            log.append(pings(40, start=k * 40), producer=1, seq=k + 1)
    assert a.digest() == b.digest()
    Log(b).append(pings(1))
    assert a.digest() != b.digest()
    a.close()
    b.close()


def test_reopen_keeps_the_applied_state_and_skips_reapplied_entries(tmp_path: Path) -> None:
    sm = StateMachine(tmp_path / "sm")
    log = Log(sm)
    log.create()
    log.append(pings(10))
    sm.checkpoint()
    index, digest = sm.applied_index, sm.digest()
    sm.close()
    again = StateMachine(tmp_path / "sm")
    assert again.applied_index == index and again.digest() == digest
    # Entries at or below the applied index (replayed after a crash) change nothing.
    cmd = command_pb2.Command(leader_ms=T0, ops=[append_op("munich", [(0, pings(3))])])
    again.apply([Entry(1, index, EntryType.NORMAL, cmd.SerializeToString())])
    assert again.digest() == digest
    again.close()


def test_snapshot_round_trip(tmp_path: Path) -> None:
    src = StateMachine(tmp_path / "src")
    log = Log(src)
    log.create()
    for k in range(20):
        log.append(pings(100, start=k * 100))
    snap = tmp_path / "snap.mdb"
    index, _ = src.write_snapshot(snap)
    assert index == src.applied_index
    dst = StateMachine(tmp_path / "dst")
    Log(dst).create("other")
    dst.install_snapshot(snap)
    assert dst.applied_index == index
    assert dst.digest() == src.digest()
    assert [t.topic.spec.name for t in dst.list_topics()] == ["munich"]
    src.close()
    dst.close()


def test_a_snapshot_taken_while_another_thread_applies_is_consistent_at_its_index(
    tmp_path: Path,
) -> None:
    """The node takes snapshots on a thread of their own while it goes on
    applying: each copy must be exactly the state at the index it reports."""
    import threading

    src = StateMachine(tmp_path / "src")
    log = Log(src)
    log.create()
    created = src.applied_index
    done = threading.Event()

    def apply_more() -> None:
        try:
            for k in range(400):
                log.append(pings(20, start=k * 20))
        finally:
            done.set()

    applier = threading.Thread(target=apply_more)
    applier.start()
    seen: list[int] = []
    try:
        for n in range(50):  # bounded: a few snapshots while the applier runs
            snap = tmp_path / f"snap-{n}.mdb"
            index, _ = src.write_snapshot(snap)
            dst = StateMachine(tmp_path / f"dst-{n}")
            dst.install_snapshot(snap)
            stored = sum(p.next_offset for p in dst.describe("munich").partitions)
            assert dst.applied_index == index
            assert stored == 20 * (index - created), (index, stored)
            dst.close()
            seen.append(index)
            if done.is_set():
                break
    finally:
        applier.join(timeout=60)
    assert not applier.is_alive()
    assert len(set(seen)) > 1  # the copies were taken at different points of the run
    src.close()


def test_undecodable_commands_and_config_entries_change_nothing(sm: StateMachine) -> None:
    before = sm.digest()
    res = sm.apply(
        [Entry(1, 1, EntryType.NORMAL, b"\xff\xff"), Entry(1, 2, EntryType.CONFIG, b"x")]
    )
    assert res[0][0].code == Code.INTERNAL and res[1] == []
    assert sm.applied_index == 2
    assert sm.digest() != before  # only the applied index moved
    assert sm.list_topics() == []


def test_fetched_pings_equal_what_was_sent(sm: StateMachine) -> None:
    log = Log(sm)
    log.create()
    cols = pings(64, devices=1)
    _, resp, _ = log.append(cols)
    [o] = resp.offsets
    r = sm.fetch(client_pb2.FetchRequest(topic="munich", partition=o.partition))
    back = columnar.decode(r.batches[0].batch)
    assert np.array_equal(back.ts_ms, cols.ts_ms) and np.array_equal(back.speed_mps, cols.speed_mps)


def test_a_fetch_hands_out_the_stored_batch_bytes_as_they_were_appended(sm: StateMachine) -> None:
    """One wire boundary: the bytes encoded for the append are the bytes a
    reader decodes (no parse and re-serialize on the way out), and the view
    reads as a FetchResponse for clients that parse the full message."""
    log = Log(sm)
    log.create(partitions=4)
    cols = pings(40)
    [(p, part)] = [(p, c) for p, c in split_by_partition(cols, 4) if len(c)][:1]
    op = append_op("munich", [(p, part)], 0, 0)
    [res] = log.results(command_pb2.Command(leader_ms=T0, ops=[op]))
    assert res.code == Code.OK
    view = sm.fetch(client_pb2.FetchRequest(topic="munich", partition=p))
    [b] = view.batches
    assert b.batch == op.append.parts[0].batch  # byte for byte what was appended
    full = client_pb2.FetchResponse.FromString(view.SerializeToString())
    parsed = columnar.decode(full.batches[0].batch.SerializeToString())
    assert parsed.ts_ms.tolist() == columnar.decode(b.batch).ts_ms.tolist() == part.ts_ms.tolist()
    assert full.end_offset == view.end_offset == len(part)
