"""The queue server's sans-I/O core: leader-only writes, fenced stealable
reads, credit, requeue on disconnect, deadlines and bounds."""

from __future__ import annotations

import itertools

import pytest

from queue_server.queues import MAX_STREAM_BREAKS, Item, Kind, QueueFull, WorkQueues
from roadlog.v1 import client_pb2

pytestmark = pytest.mark.unit
_ids = itertools.count(1)
# A write that may be handed to another node when its node leaves (see
# queues.replayable): what these tests move around; "m" stands for any read.
W = "Heartbeat"


def item(kind: Kind, fence: int = 0, deadline: float = 100.0) -> Item:
    return Item(next(_ids), kind, W if kind == Kind.WRITE else "m", b"", deadline, 0.0, fence)


def test_writes_go_only_to_the_leader() -> None:
    q = WorkQueues()
    q.connect(1, node_id=1)
    q.connect(2, node_id=2)
    for w in (1, 2):
        q.grant(w, writes=10, reads=10)
    q.submit(item(Kind.WRITE))
    assert q.dispatch(0) == []  # no leader yet: it waits
    q.update(2, is_leader=True, term=3, applied=5)
    [(w, _)] = q.dispatch(0)
    assert w == 2


def test_reads_wait_for_a_node_that_reached_the_fence() -> None:
    q = WorkQueues()
    q.connect(1, 1)
    q.connect(2, 2)
    q.grant(1, 0, 5)
    q.grant(2, 0, 5)
    q.update(1, False, 1, applied=10)
    q.update(2, False, 1, applied=3)
    got = q.dispatch(0) or None
    assert got is None
    q.submit(item(Kind.READ, fence=7))
    [(w, _)] = q.dispatch(0)
    assert w == 1
    q.submit(item(Kind.READ, fence=50))
    assert q.dispatch(0) == [] and q.depth(Kind.READ) == 1


def test_an_idle_node_steals_more_reads_than_a_busy_one() -> None:
    q = WorkQueues()
    q.connect(1, 1)
    q.connect(2, 2)
    q.grant(1, 0, 2)  # busy: little credit
    q.grant(2, 0, 8)
    for _ in range(10):
        q.submit(item(Kind.READ))
    taken = [w for w, _ in q.dispatch(0)]
    assert taken.count(2) == 8 and taken.count(1) == 2


def test_credit_bounds_what_a_node_is_given() -> None:
    q = WorkQueues()
    q.connect(1, 1)
    q.update(1, True, 1, 0)
    q.grant(1, writes=2, reads=0)
    for _ in range(5):
        q.submit(item(Kind.WRITE))
    assert len(q.dispatch(0)) == 2
    q.grant(1, 1, 0)
    assert len(q.dispatch(0)) == 1


def test_work_of_a_lost_node_goes_back_to_the_front_in_order() -> None:
    q = WorkQueues()
    q.connect(1, 1)
    q.update(1, True, 1, 0)
    q.grant(1, 3, 0)
    items = [item(Kind.WRITE) for _ in range(4)]
    for it in items:
        q.submit(it)
    taken = [it.id for _, it in q.dispatch(0)]
    assert taken == [i.id for i in items[:3]]
    q.complete(1, items[0].id)
    back = q.disconnect(1, now=0)
    assert [it.id for it in back] == [items[1].id, items[2].id]
    q.connect(2, 2)
    q.update(2, True, 2, 0)
    q.grant(2, 10, 0)
    assert [it.id for _, it in q.dispatch(0)] == [i.id for i in items[1:]]


def test_retry_requeues_for_another_worker() -> None:
    q = WorkQueues()
    q.connect(1, 1)
    q.update(1, True, 1, 0)
    q.grant(1, 1, 0)
    q.submit(item(Kind.WRITE))
    [(_, it)] = q.dispatch(0)
    q.update(1, False, 2, 0)
    assert q.retry(1, it.id) is it and it.attempts == 1
    assert q.depth(Kind.WRITE) == 1


def test_deadlines_expire_with_a_reason() -> None:
    q = WorkQueues()
    q.submit(item(Kind.WRITE, deadline=1.0))
    q.submit(item(Kind.WRITE, deadline=5.0))
    [e] = q.expire(2.0)
    assert e.reason == "not done before the deadline: no node is connected to this queue server"
    q.connect(1, 1)
    [e] = q.expire(6.0)
    assert e.reason.startswith("not done before the deadline: no leader")
    assert q.depth(Kind.WRITE) == 0


def test_a_write_held_by_a_node_that_left_is_reported_once_not_as_a_deadline() -> None:
    """Each reason says what happened, once (the queue server answers it as
    it is): a deadline that passed while its node held it, or an outcome
    nobody knows (a write that must not be done again)."""
    q = WorkQueues()
    q.connect(1, 1)
    q.update(1, True, 1, applied=0)
    q.grant(1, 10, 0)
    late = item(Kind.WRITE, deadline=1.0)
    # a publish without a producer id: done twice it would be stored twice
    once = client_pb2.PublishRequest(topic="t").SerializeToString()
    unknown = Item(next(_ids), Kind.WRITE, "Publish", once, 50.0, 0.0, 0)
    q.submit(late)
    q.submit(unknown)
    assert [it.id for _, it in q.dispatch(0.5)] == [late.id, unknown.id]
    assert q.disconnect(1, now=2.0) == []
    reasons = {e.item.id: e.reason for e in q.expire(2.0)}
    assert reasons[late.id] == "not done before the deadline: its node left"
    assert reasons[unknown.id].startswith("the node that took it left before answering")


def test_bounded_queues_refuse_when_full() -> None:
    q = WorkQueues(max_writes=2, max_reads=1)
    q.submit(item(Kind.WRITE))
    q.submit(item(Kind.WRITE))
    with pytest.raises(QueueFull, match="write queue is full"):
        q.submit(item(Kind.WRITE))
    q.submit(item(Kind.READ))
    with pytest.raises(QueueFull):
        q.submit(item(Kind.READ))


def test_cancel_removes_a_queued_item() -> None:
    q = WorkQueues()
    it = item(Kind.READ)
    q.submit(it)
    assert q.cancel(it.id) and not q.cancel(it.id)
    assert q.depth(Kind.READ) == 0


def test_the_newest_leader_wins_when_two_claim() -> None:
    q = WorkQueues()
    q.connect(1, 1)
    q.connect(2, 2)
    q.update(1, True, 3, 0)
    q.update(2, True, 4, 0)
    for w in (1, 2):
        q.grant(w, 5, 0)
    q.submit(item(Kind.WRITE))
    [(w, _)] = q.dispatch(0)
    assert w == 2


def test_one_client_flooding_neither_fills_the_queue_nor_delays_others() -> None:
    q = WorkQueues(max_writes=100, max_per_client=10)
    flood = [Item(next(_ids), Kind.WRITE, W, b"", 100.0, 0.0, client="flood") for _ in range(10)]
    for it in flood:
        q.submit(it)
    with pytest.raises(QueueFull, match="'flood' has 10 requests waiting"):
        q.submit(Item(next(_ids), Kind.WRITE, W, b"", 100.0, 0.0, client="flood"))
    phone = Item(next(_ids), Kind.WRITE, W, b"", 100.0, 0.0, client="phone")
    q.submit(phone)  # another client still gets in
    q.connect(1, 1)
    q.update(1, True, 1, 0)
    q.grant(1, writes=2, reads=0)
    order = [it.id for _, it in q.dispatch(0)]
    assert order == [flood[0].id, phone.id]  # served in turn, not after the flood
    q.grant(1, writes=100, reads=0)
    rest = [it.id for _, it in q.dispatch(0)]
    assert rest == [it.id for it in flood[1:]]  # each client's own order kept


def test_work_handed_back_is_served_first_in_its_order() -> None:
    q = WorkQueues()
    q.connect(1, 1)
    q.update(1, True, 1, 0)
    q.grant(1, writes=3, reads=0)
    items = [Item(next(_ids), Kind.WRITE, W, b"", 100.0, 0.0, client=c) for c in "abc"]
    for it in items:
        q.submit(it)
    assert len(q.dispatch(0)) == 3
    q.submit(Item(next(_ids), Kind.WRITE, W, b"", 100.0, 0.0, client="d"))
    back = q.disconnect(1, now=0)
    assert [it.id for it in back] == [it.id for it in items]
    q.connect(2, 2)
    q.update(2, True, 2, 0)
    q.grant(2, writes=10, reads=0)
    got = [it.id for _, it in q.dispatch(0)]
    assert got[:3] == [it.id for it in items] and len(got) == 4


def test_reads_fenced_beyond_every_commit_are_dropped_after_a_grace() -> None:
    q = WorkQueues()
    early = Item(next(_ids), Kind.READ, "m", b"", 100.0, 1.0, fence=900)
    late = Item(next(_ids), Kind.READ, "m", b"", 100.0, 5.0, fence=900)
    fine = Item(next(_ids), Kind.READ, "m", b"", 100.0, 1.0, fence=40)
    for it in (early, late, fine):
        q.submit(it)
    dropped = q.drop_unreachable_fences(commit_index=50, queued_before=3.0)
    assert [it.id for it in dropped] == [early.id]  # late gets its grace, fine can be served
    assert q.depth(Kind.READ) == 2


def _reader(q: WorkQueues, worker: int) -> None:
    q.connect(worker, node_id=worker)
    q.update(worker, is_leader=False, term=1, applied=10)
    q.grant(worker, writes=0, reads=10)


def test_an_item_that_breaks_every_stream_is_given_up_not_circled() -> None:
    """Finding 7 of issue 19: a read whose answer broke each node's stream
    went back to the front and out again, forever."""
    q = WorkQueues()
    poison = item(Kind.READ)
    q.submit(poison)
    for w in range(1, MAX_STREAM_BREAKS + 1):
        _reader(q, w)
        [(got, it)] = q.dispatch(0)
        assert (got, it.id) == (w, poison.id)
        back = q.disconnect(w, now=0)
        assert back == ([poison] if w < MAX_STREAM_BREAKS else [])
    assert q.depth(Kind.READ) == 0
    [e] = q.expire(0)
    assert e.item is poison and e.gave_up and f"after {MAX_STREAM_BREAKS} nodes" in e.reason
    assert q.expire(0) == []  # reported once


def test_work_past_its_deadline_is_not_requeued_nor_handed_out() -> None:
    q = WorkQueues()
    _reader(q, 1)
    held = item(Kind.READ, deadline=5.0)
    q.submit(held)
    assert [it.id for _, it in q.dispatch(0)] == [held.id]
    assert q.disconnect(1, now=6.0) == []  # its deadline passed while the node held it
    [e] = q.expire(6.0)
    assert e.item is held and not e.gave_up
    stale = item(Kind.READ, deadline=5.0)
    q.submit(stale)
    _reader(q, 2)
    assert q.dispatch(6.0) == []  # never handed out late
    [e] = q.expire(6.0)
    assert e.item is stale


def test_an_item_the_client_gave_up_on_is_not_requeued() -> None:
    q = WorkQueues()
    _reader(q, 1)
    it = item(Kind.READ)
    q.submit(it)
    assert len(q.dispatch(0)) == 1
    assert not q.cancel(it.id)  # not queued: held by worker 1
    assert q.disconnect(1, now=0) == []
    assert q.depth(Kind.READ) == 0


def test_queues_are_bounded_in_bytes_in_all_and_per_client() -> None:
    """Issue 19, finding 8: 16 queued 32 MiB publishes took a queue server to
    2.1 GB; memory is now bounded by bytes, not only by request count."""
    mib = 1 << 20
    q = WorkQueues(max_bytes=64 * mib)  # a client may hold a quarter: 16 MiB

    def big(client: str, size: int = 6 * mib) -> Item:
        return Item(next(_ids), Kind.WRITE, W, b"x" * size, 100.0, 0.0, client=client)

    q.submit(big("a"))
    q.submit(big("a"))
    with pytest.raises(QueueFull, match="'a' has 12582912 bytes waiting"):
        q.submit(big("a"))
    for c in "bcdefgh":
        try:
            q.submit(big(c))
            q.submit(big(c))
        except QueueFull as e:
            assert "bytes waiting, at most 67108864" in str(e)
            break
    assert q.queues[Kind.WRITE].bytes <= 64 * mib
    q.connect(1, 1)
    q.update(1, True, 1, 0)
    q.grant(1, writes=100, reads=0)
    taken = q.dispatch(0)
    assert taken and q.queues[Kind.WRITE].bytes == 0  # handed out: no longer held
    q.disconnect(1, now=0)  # handed back: held again, though over no bound
    assert q.queues[Kind.WRITE].bytes == sum(it.size for _, it in taken)
    q.submit(Item(next(_ids), Kind.WRITE, W, b"", 100.0, 0.0, client="z"))  # small still fits
    q.expire(1000.0)
    assert q.queues[Kind.WRITE].bytes == 0 and q.depth(Kind.WRITE) == 0


def test_not_the_leader_answers_are_no_broken_streams() -> None:
    """A leader crash looks like a few "not the leader" answers and then one
    broken stream: the write must go back to the queue, not be given up."""
    q = WorkQueues()
    q.connect(1, 1)
    q.update(1, True, 1, 0)
    q.grant(1, writes=10, reads=0)
    w = item(Kind.WRITE)
    q.submit(w)
    for _ in range(MAX_STREAM_BREAKS):
        [(_, got)] = q.dispatch(0)
        assert got is w
        q.retry(1, w.id)  # UNAVAILABLE: not the leader any more
    [(_, got)] = q.dispatch(0)
    assert q.disconnect(1, now=0) == [w]  # one broken stream: requeued
    assert q.expire(0) == [] and q.depth(Kind.WRITE) == 1


def test_reads_waiting_for_their_fence_keep_their_place_and_their_clients_bounds() -> None:
    """A read no node can take yet used to go to the shared front lane on
    every dispatch, escaping its client's bounds and jumping ahead of others."""
    mib = 1 << 20
    q = WorkQueues(max_bytes=64 * mib)  # a client may hold 16 MiB
    _reader(q, 1)  # applied 10, 10 read credits

    def read(client: str, fence: int, size: int = 4 * mib) -> Item:
        return Item(next(_ids), Kind.READ, "m", b"x" * size, 100.0, 0.0, fence, client=client)

    held = [read("a", fence=50) for _ in range(4)]  # 16 MiB: a's whole share
    for it in held:
        q.submit(it)
        assert q.dispatch(0) == []  # fenced beyond node 1: it waits
    with pytest.raises(QueueFull, match="'a' has 16777216 bytes waiting"):
        q.submit(read("a", fence=50))
    fine = read("b", fence=5)
    q.submit(fine)  # another client is not crowded out
    assert [it.id for _, it in q.dispatch(0)] == [fine.id]
    q.update(1, is_leader=False, term=1, applied=50)
    assert [it.id for _, it in q.dispatch(0)] == [it.id for it in held]  # a's order kept


def _publish(producer_id: int) -> Item:
    req = client_pb2.PublishRequest(topic="t", client_id="c", producer_id=producer_id, sequence=1)
    return Item(next(_ids), Kind.WRITE, "Publish", req.SerializeToString(), 100.0, 0.0)


def test_a_write_its_node_may_have_done_is_not_handed_to_another() -> None:
    """Found by the nemesis (issue 21, seed 4): a leader took an HTTP publish
    (no producer id), proposed it and was killed; the queue server handed it
    to the next leader, and the pings one request carried were stored
    twice. A write whose repetition is not harmless, held by a node that
    left, is answered as unknown instead; an idempotent publish (stored
    once however often it comes), and reads, still go to the next node."""
    q = WorkQueues()
    q.connect(1, 1)
    q.update(1, True, 1, 0)
    q.grant(1, writes=10, reads=10)
    plain, create = _publish(0), item(Kind.WRITE)
    create.method = "CreateTopic"
    idempotent = _publish(7)
    batch = Item(
        next(_ids),
        Kind.WRITE,
        "PublishBatch",
        client_pb2.PublishBatchRequest(
            requests=[
                client_pb2.PublishRequest(producer_id=7, sequence=2),
                client_pb2.PublishRequest(producer_id=0),
            ]
        ).SerializeToString(),
        100.0,
        0.0,
    )
    for it in (plain, create, idempotent, batch):
        q.submit(it)
    assert len(q.dispatch(0)) == 4
    back = q.disconnect(1, now=0)
    assert [it.id for it in back] == [idempotent.id]  # stored once however often it comes
    dropped = q.expire(0)
    assert sorted(e.item.id for e in dropped) == sorted([plain.id, create.id, batch.id])
    assert all("unknown" in e.reason and not e.gave_up for e in dropped)
    q.connect(2, 2)
    q.update(2, True, 2, 0)
    q.grant(2, writes=10, reads=0)
    assert [it.id for _, it in q.dispatch(0)] == [idempotent.id]  # nothing else twice


# --------------------------------------------------------- Raft groups


def grouped(kind: Kind, group: int, fence: int = 0, client: str = "c") -> Item:
    it = item(kind, fence)
    it.group, it.client = group, client
    return it


def three_leaders() -> WorkQueues:
    """Workers 1..3 (nodes 1..3); node 1 leads group 0, node 2 group 1,
    node 3 group 2; each applied 10 in group 0, and in its data groups its
    own number times 10."""
    q = WorkQueues()
    for w in (1, 2, 3):
        q.connect(w, w)
        q.grant(w, writes=10, reads=10)
    for w in (1, 2, 3):
        groups = [(g, g == w - 1, 4, w * 10) for g in (1, 2)]
        q.update(w, w == 1, 3, 10, groups)
    return q


def test_each_write_goes_to_the_leader_of_its_group() -> None:
    q = three_leaders()
    for g in (0, 1, 2, 2, 1, 0):
        q.submit(grouped(Kind.WRITE, g))
    got = [(w, it.group) for w, it in q.dispatch(0)]
    assert sorted(got) == [(1, 0), (1, 0), (2, 1), (2, 1), (3, 2), (3, 2)]
    assert q.leader(1) is q.workers[2] and q.leader(2) is q.workers[3]


def test_a_group_without_a_leader_holds_its_writes_not_the_others() -> None:
    q = three_leaders()
    q.update(3, False, 3, 10, [(1, False, 4, 30), (2, False, 5, 30)])  # lost group 2
    q.submit(grouped(Kind.WRITE, 2, client="a"))
    q.submit(grouped(Kind.WRITE, 1, client="b"))
    assert [(w, it.group) for w, it in q.dispatch(0)] == [(2, 1)]
    assert q.depth(Kind.WRITE) == 1
    # Its reason names the group when the deadline passes.
    [gone] = q.expire(1000.0)
    assert "no leader of group 2" in gone.reason
    # A newer term's leader of a group wins over a stale one's claim.
    q.submit(grouped(Kind.WRITE, 1, client="b"))
    q.update(1, True, 3, 10, [(1, True, 9, 10), (2, False, 5, 10)])
    assert [(w, it.group) for w, it in q.dispatch(0)] == [(1, 1)]


def test_a_leader_without_credit_holds_only_its_groups_writes() -> None:
    q = three_leaders()
    q.workers[2].write_credit = 0
    for g, c in ((1, "a"), (2, "b"), (0, "c")):
        q.submit(grouped(Kind.WRITE, g, client=c))
    assert sorted((w, it.group) for w, it in q.dispatch(0)) == [(1, 0), (3, 2)]
    q.grant(2, writes=1, reads=0)
    assert [(w, it.group) for w, it in q.dispatch(0)] == [(2, 1)]


def test_a_clients_writes_keep_their_order_across_groups() -> None:
    q = three_leaders()
    q.workers[2].write_credit = 0  # group 1's leader is busy
    first, second = grouped(Kind.WRITE, 1), grouped(Kind.WRITE, 2)
    q.submit(first)
    q.submit(second)
    assert q.dispatch(0) == []  # the second waits behind the first
    q.grant(2, writes=1, reads=0)
    assert [it.id for _, it in q.dispatch(0)] == [first.id, second.id]


def test_a_reads_fence_is_of_its_group() -> None:
    q = three_leaders()
    q.submit(grouped(Kind.READ, 2, fence=25))  # only node 3 applied 30 in group 2
    [(w, _)] = q.dispatch(0)
    assert w == 3
    q.submit(grouped(Kind.READ, 1, fence=35))  # nobody has: it waits
    assert q.dispatch(0) == []
    # A group no node runs is never read by anyone.
    q.submit(grouped(Kind.READ, 7))
    assert q.dispatch(0) == [] and q.depth(Kind.READ) == 2


def test_unreachable_fences_are_judged_by_their_groups_commit() -> None:
    q = three_leaders()
    reads = [grouped(Kind.READ, 0, 99), grouped(Kind.READ, 1, 99), grouped(Kind.READ, 2, 20)]
    for it in reads:
        q.submit(it)
    q.submit(grouped(Kind.READ, 5, 10**6))  # a group nobody told of: left alone
    dropped = q.drop_unreachable_fences(50, queued_before=1.0, group_commits={1: 60, 2: 30})
    assert [it.id for it in dropped] == [reads[0].id, reads[1].id]


def test_a_worker_process_link_serves_its_data_groups_only() -> None:
    """Node 1's main process (link 1) runs group 0; its worker process (link
    4, ``runs_group_0`` False) runs group 1 and leads it. Group 1's writes
    and reads go to the worker, group 0's never do, though the worker's
    group-0 fields (unset: 0) would let a read fenced at 0 through, and a
    worker claiming group 0's lead is not taken for its leader."""
    q = WorkQueues()
    q.connect(1, 1)
    q.connect(4, 1, runs_group_0=False)
    for w in (1, 4):
        q.grant(w, writes=10, reads=10)
    q.update(1, True, 3, 10)
    q.update(4, True, 99, 0, [(1, True, 5, 20)])  # a bogus group-0 claim, ignored
    assert q.leader(0) is q.workers[1] and q.leader(1) is q.workers[4]
    assert q.workers[4].applied_in(0) == -1
    for g in (0, 1, 0, 1):
        q.submit(grouped(Kind.WRITE, g))
    assert sorted((w, it.group) for w, it in q.dispatch(0)) == [(1, 0), (1, 0), (4, 1), (4, 1)]
    for _ in range(6):
        q.submit(grouped(Kind.READ, 0, fence=0))
    q.submit(grouped(Kind.READ, 1, fence=15))
    got = sorted((w, it.group) for w, it in q.dispatch(0))
    assert got == [(1, 0)] * 6 + [(4, 1)]
    # A group-0 read fenced beyond what the main process applied waits for it,
    # not for the worker's.
    q.submit(grouped(Kind.READ, 0, fence=11))
    assert q.awaited_fence() == 11
    q.update(1, True, 3, 11)
    assert q.awaited_fence() == 0
