"""A wiped node must not help elect a leader that lacks acknowledged writes
(issue 21, found by the nemesis: seed 1, 30 s, with wipes).

A node with static peers whose data directory is empty bootstraps a new
cluster (entry 1, term 1) and comes back as a voter that has forgotten
its log and its vote. With one more fault that is enough to lose
acknowledged writes: a publish is acknowledged by the leader and the one
follower up (the third node is down); that follower is wiped and the
leader goes down; the third node and the wiped one are a majority, the
third node's log is the more up to date of the two, so it is elected
without the publish; when the old leader returns its log is cut back to
the new leader's, and the publish is gone: the old leader applied it, the
others never will (the nemesis saw indexes acknowledged twice, reads of
pings later lost and a replica whose state differs for good; here the new
leader also stops, "index 5 is not in the log", when the old one returns
with a longer log).

The fix (node_daemon/replica/replica.py, ``Config.catching_up`` in the Raft core): a
node that starts with an empty log neither votes nor campaigns until every
other static peer says it is new too (a brand-new cluster), or a leader has
caught it up; meanwhile leaders count it in no commit quorum. Here b learns from
c that the cluster ran, so c gets no vote from it; a comes back and leads.
"""

from __future__ import annotations

import contextlib
import shutil

import grpc
import pytest

from roadlog.client import Connection, Consumer, Producer, RoadlogError
from roadlog.runtime.processes import alive
from roadlog.tools.localcluster import LocalCluster
from tests.integration.conftest import create_topic, make_pings, wait_for
from tests.integration.test_replicated_log import digest

pytestmark = pytest.mark.integration


def _leader(lc: LocalCluster) -> int:
    try:
        return int(lc.status()["leader"])
    except Exception:
        return 0


def test_a_wiped_voter_and_a_lagging_one_cannot_elect_a_leader_without_an_acked_write(
    make_cluster: object,
) -> None:
    lc: LocalCluster = make_cluster(nodes=3)  # type: ignore[operator]
    with Connection(lc.servers, timeout=30) as conn:
        create_topic(conn)
        a = _leader(lc)
        b, c = (n.id for n in lc.nodes if n.id != a)
        lc.kill(c)  # down before the write: it never gets it
        producer = Producer(conn, "munich", client="p", deadline_s=30)
        cols = make_pings("p", 0, 100)
        ack = producer.send_batch(cols)  # on a and b only
        lc.kill(b)
        shutil.rmtree(lc.node(b).data_dir)  # b's disk replaced: empty
        lc.kill(a)  # the only other copy of the write goes down
        lc.start(c)
        lc.start(b)
        # Safe behaviour: no leader can be made of c and b (b knows nothing,
        # c lacks the write), so none is; unsafe: c is elected. Either way
        # the old leader returns, and the write must be there.
        with contextlib.suppress(AssertionError):  # no leader in time: the safe outcome
            wait_for(lambda: _leader(lc) in (b, c), 20, "a leader made of c and b")
        lc.start(a)
        wait_for(lambda: _leader(lc) != 0, 60, "a leader once all three are back")
        want = set(zip(cols.device_of().tolist(), cols.ts_ms.tolist(), strict=True))

        def read_back() -> set[tuple[str, int]]:
            c_ = Consumer(conn, "munich")
            c_.min_applied_index = ack.applied_index
            got: set[tuple[str, int]] = set()
            for p in range(4):
                for batch in c_.read_to_end(p):
                    dev, ts = batch.pings.device_of().tolist(), batch.pings.ts_ms.tolist()
                    got |= set(zip(dev, ts, strict=True))
            return got

        def readable() -> bool:
            try:
                read_back()
                return True
            except RoadlogError:
                return False

        wait_for(readable, 60, "a read at the write's index")
        assert want <= read_back(), "an acknowledged publish was lost"
        # Every node still runs, and every replica holds it: the same state.
        stopped = [n.name for n in lc.nodes if not alive(n.pid)]
        assert not stopped, f"{stopped} stopped on a failure (see their logs)"
        seen: list[set[tuple[int, bytes]]] = []

        def one_index() -> bool:
            try:
                seen[:] = [{digest(n.address) for n in lc.nodes}]
            except grpc.RpcError:
                return False
            return len({index for index, _ in seen[0]}) == 1

        wait_for(one_index, 15, "every replica at the same applied index")
        assert len(seen[0]) == 1, "the replicas differ at the same applied index"
