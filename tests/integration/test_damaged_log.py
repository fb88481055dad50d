"""A node whose disk damaged its Raft log while it was down (issue 21: a
byte of an entry flipped, or the file cut short) must neither serve nor
vote from it, nor die of it: at start it finds the damage (each entry's
checksum, the file's size against LMDB's meta page), sets the log, state and
snapshots aside under ``corrupt-<time>/`` and rejoins as a wiped node,
catching up from the leader until its state is byte-identical again."""

from __future__ import annotations

import signal
import urllib.request
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest

from node_daemon.storage.raft_log import LmdbLogStorage
from roadlog.client import Connection, Producer
from roadlog.tools.localcluster import LocalCluster, NodeInfo
from tests.integration.conftest import create_topic, make_pings, read_topic, wait_for
from tests.integration.test_replicated_log import digest

pytestmark = pytest.mark.integration


def _flip_an_entry(raft: Path) -> int:
    """Flip a byte in the middle of the log's newest entry; its index."""
    env = lmdb.open(str(raft), max_dbs=4, map_size=1 << 34)
    try:
        db = env.open_db(b"log")
        with env.begin(write=True, db=db) as txn:
            cur = txn.cursor()
            assert cur.last()
            key, raw = bytes(cur.key()), bytearray(cur.value())
            raw[len(raw) // 2] ^= 0x10
            txn.put(key, bytes(raw))
    finally:
        env.close()
    return int.from_bytes(key, "big")


def _cut_short(raft: Path) -> int:
    data = raft / "data.mdb"
    size = data.stat().st_size
    keep = max(2 * 4096, size // 2 // 4096 * 4096)
    data.write_bytes(data.read_bytes()[:keep])
    return keep


def _same_state(lc: LocalCluster) -> bool:
    try:
        return len({digest(n.address) for n in lc.nodes}) == 1
    except Exception:
        return False


def _metric(lc: LocalCluster, node: NodeInfo, name: str) -> float:
    with urllib.request.urlopen(lc.metrics_url(node), context=lc.ssl_context(), timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))  # fmt: skip


@pytest.mark.parametrize("damage", ["entry", "truncate"])
def test_a_damaged_log_is_set_aside_and_the_node_catches_up(
    make_cluster: Callable[..., LocalCluster], damage: str
) -> None:
    lc = make_cluster(nodes=3)
    with Connection(lc.servers, timeout=30) as conn:
        create_topic(conn)
        producer = Producer(conn, "munich", client="p", deadline_s=30)
        for k in range(20):
            producer.send_batch(make_pings("p", 100 * k, 100))
        wait_for(lambda: _same_state(lc), 30, "every replica applied the writes")
        victim = next(n for n in lc.nodes if n.id != lc.status()["leader"])
        lc.kill(victim.id)
        raft = Path(victim.data_dir) / "raft"
        if damage == "entry":
            assert _flip_an_entry(raft) > 1
        else:
            _cut_short(raft)
        lc.start(victim.id)
        for k in range(20, 30):  # writes go on meanwhile
            producer.send_batch(make_pings("p", 100 * k, 100))
        wait_for(lambda: _same_state(lc), 60, "the damaged node caught up, byte-identical")
        log = Path(victim.log).read_text()
        assert "the log is damaged: set aside" in log, log[-3000:]
        [aside] = Path(victim.data_dir).glob("corrupt-*")
        assert (aside / "raft" / "data.mdb").exists()
        why = (aside / "why").read_text()
        assert ("entry" in why) if damage == "entry" else ("truncated" in why), why
        assert _metric(lc, victim, "roadlog_damaged_logs_set_aside_total") == 1
        stored = read_topic(conn, "munich")
        assert sum(len(v) for v in stored.values()) == 3000
    lc.kill(victim.id, signal.SIGTERM)
    store = LmdbLogStorage(raft)  # what it holds now is sound
    try:
        assert store.verify() == 0 and store.last_index() > 0
    finally:
        store.close()
