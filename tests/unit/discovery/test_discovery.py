"""Discovery: the HELLO datagram (every way a datagram can be bad) and the
founding rule, driven deterministically: seeded nodes that start at random
times on a lossy broadcast network must form exactly one cluster."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from discovery.core import DiscoveryCore, Found, Join
from discovery.protocol import (
    MAX_DATAGRAM,
    MAX_SKEW_MS,
    Hello,
    Member,
    Rejected,
    ReplayGuard,
    decode,
    encode,
)

pytestmark = pytest.mark.unit

KEY = b"k" * 32
NOW = 1_800_000_000_000


def hello(**kw: object) -> Hello:
    base: dict[str, object] = {
        "cluster": "munich",
        "node_id": 7,
        "role": "node",
        "address": "10.77.0.7:7400",
        "ts_ms": NOW,
    }
    base.update(kw)
    return Hello(**base)  # type: ignore[arg-type]


def test_a_hello_round_trips() -> None:
    h = hello(
        state="member",
        leader=3,
        leader_address="10.77.0.3:7400",
        term=4,
        members=(Member(3, "10.77.0.3:7400", True), Member(7, "10.77.0.7:7400", False)),
        seen=(3, 7),
        vote=(3, 7),
        vote_age_ms=1200,
    )
    assert decode(encode(h, KEY), KEY, "munich", NOW, ReplayGuard()) == h


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: encode(hello(), b"wrong key" * 4), "bad_mac"),
        (lambda: encode(hello(cluster="vienna"), KEY), "foreign_cluster"),
        (lambda: encode(hello(ts_ms=NOW - MAX_SKEW_MS - 1), KEY), "stale"),
        (lambda: encode(hello(ts_ms=NOW + MAX_SKEW_MS + 1), KEY), "stale"),
        (lambda: b"RLD" + b"\x01" + b"x" * (MAX_DATAGRAM + 10), "oversized"),
        (lambda: b"hello there, this is not ours at all........", "garbage"),
        (lambda: b"", "garbage"),
        (lambda: b"RLD\x09" + bytes(40), "version"),
        (lambda: _signed(b"[1, 2]"), "malformed"),
        (lambda: _signed(b"{not json"), "malformed"),
        (lambda: _signed(b'{"c": "munich"}'), "malformed"),
        (lambda: _signed(_body(id=-1)), "malformed"),
        (lambda: _signed(_body(id=True)), "malformed"),
        (lambda: _signed(_body(r="spy")), "malformed"),
        (lambda: _signed(_body(seen=list(range(1, 100)))), "malformed"),
        (lambda: _signed(_body(m=[[1, "a"]])), "malformed"),
        (lambda: _signed(b"[" * 1300), "malformed"),
    ],
)
def test_bad_datagrams_are_rejected_with_a_reason(make: object, reason: str) -> None:
    with pytest.raises(Rejected) as e:
        decode(make(), KEY, "munich", NOW, ReplayGuard())  # type: ignore[operator]
    assert e.value.reason == reason


def _body(**kw: object) -> bytes:
    import json

    body: dict[str, object] = {
        "c": "munich", "id": 7, "r": "node", "a": "x:1", "s": "new", "x": 3, "seen": [],
        "vote": [], "va": 0, "l": 0, "la": "", "t": 0, "m": [], "ts": NOW, "n": "ab",
    }  # fmt: skip
    body.update(kw)
    return json.dumps(body).encode()


def _signed(body: bytes) -> bytes:
    import hashlib
    import hmac

    head = b"RLD\x01" + body
    return head + hmac.new(KEY, head, hashlib.sha256).digest()


def test_a_replayed_datagram_is_rejected() -> None:
    guard = ReplayGuard()
    data = encode(hello(), KEY)
    decode(data, KEY, "munich", NOW, guard)
    with pytest.raises(Rejected) as e:
        decode(data, KEY, "munich", NOW + 10, guard)
    assert e.value.reason == "replayed"


def test_the_core_counts_what_it_rejects_and_ignores_its_own_echo() -> None:
    core = DiscoveryCore("munich", 7, "node", "10.77.0.7:7400", expect=3)
    assert core.receive(encode(core.hello(NOW), KEY), KEY, NOW) is None  # own broadcast
    assert core.receive(b"junk", KEY, NOW) is None
    assert core.receive(encode(hello(node_id=9), b"x" * 32), KEY, NOW) is None
    assert core.receive(encode(hello(node_id=9), KEY), KEY, NOW) is not None
    assert core.counters == {
        "own": 1,
        "rejected_garbage": 1,
        "rejected_bad_mac": 1,
        "accepted": 1,
    }


def test_a_new_node_that_hears_a_cluster_joins_it() -> None:
    core = DiscoveryCore("munich", 9, "node", "10.77.0.9:7400", expect=3)
    member = hello(node_id=2, state="member", leader=1, leader_address="10.77.0.1:7400", term=2)
    core.receive(encode(member, KEY), KEY, NOW)
    assert core.decide(NOW) == Join(1, "10.77.0.1:7400", term=2)
    assert core.addresses(NOW) == {2: "10.77.0.7:7400"}


def test_queue_servers_are_found_from_their_announcements() -> None:
    core = DiscoveryCore("munich", 9, "node", "10.77.0.9:7400")
    q = hello(node_id=1, role="queue", address="10.77.0.50:7500")
    core.receive(encode(q, KEY), KEY, NOW)
    assert core.queue_servers(NOW) == ["10.77.0.50:7500"]
    assert core.queue_servers(NOW + 60_000) == []  # forgotten when silent


# ------------------------------------------------------------ simulation


@dataclass
class SimNode:
    core: DiscoveryCore
    start_ms: int
    cluster: int = 0  # the founder of the cluster it ended in


@dataclass
class Sim:
    """Nodes on one broadcast domain with a seeded clock, start times and
    loss. A founder becomes leader of its cluster at once; a joiner becomes
    a member of the cluster whose leader it asks (as the node daemon does)."""

    nodes: dict[int, SimNode]
    loss: float
    rng: random.Random
    clusters: dict[int, list[int]] = field(default_factory=dict)

    def run(self, until_ms: int, step_ms: int = 50) -> None:
        t = 0
        while t <= until_ms:
            now = NOW + t
            for n in self.nodes.values():
                if t < n.start_ms:
                    continue
                h = n.core.due(now)
                if h is not None:
                    data = encode(h, KEY)
                    for other in self.nodes.values():
                        if other is n or t < other.start_ms or self.rng.random() < self.loss:
                            continue
                        other.core.receive(data, KEY, now)
                d = n.core.decide(now)
                if isinstance(d, Found):
                    self.clusters[n.core.node_id] = [n.core.node_id]
                    n.cluster = n.core.node_id
                    self._announce(n.core.node_id, now)
                elif isinstance(d, Join) and d.leader in self.clusters:
                    self.clusters[d.leader].append(n.core.node_id)
                    n.cluster = d.leader
                    self._announce(d.leader, now)
            t += step_ms

    def _announce(self, founder: int, now: int) -> None:
        ids = self.clusters[founder]
        members = tuple(Member(i, f"10.77.0.{i}:7400", True) for i in ids)
        for i in ids:
            self.nodes[i].core.set_member(founder, f"10.77.0.{founder}:7400", 1, members)


def simulate(seed: int, n: int, expect: int, loss: float, spread_ms: int) -> Sim:
    rng = random.Random(seed)
    ids = rng.sample(range(1, 1000), n)
    nodes = {
        i: SimNode(
            DiscoveryCore("munich", i, "node", f"10.77.0.{i}:7400", expect=expect),
            start_ms=rng.randrange(spread_ms + 1),
        )
        for i in ids
    }
    for node in nodes.values():  # each node's first HELLO at its own phase
        node.core._next_hello_ms = NOW + node.start_ms + rng.randrange(1000)
    sim = Sim(nodes, loss, rng)
    sim.run(120_000)
    return sim


@pytest.mark.parametrize(
    ("n", "expect", "loss", "spread_ms"),
    [(3, 3, 0.0, 5000), (5, 3, 0.0, 5000), (5, 5, 0.0, 3000), (3, 3, 0.3, 8000), (5, 3, 0.3, 8000)],
)
def test_seeded_starts_form_exactly_one_cluster(
    n: int, expect: int, loss: float, spread_ms: int
) -> None:
    for seed in range(60):
        sim = simulate(seed, n, expect, loss, spread_ms)
        assert len(sim.clusters) == 1, (seed, sim.clusters)
        [(founder, ids)] = sim.clusters.items()
        assert sorted(ids) == sorted(sim.nodes), (seed, sim.clusters)  # everyone got in
        assert founder in sim.nodes


def test_a_node_with_the_wrong_secret_is_ignored_and_counted() -> None:
    good = DiscoveryCore("munich", 1, "node", "a:1", expect=1)
    rogue = DiscoveryCore("munich", 2, "node", "b:1", expect=1)
    for t in range(0, 5000, 100):
        h = rogue.due(NOW + t)
        if h is not None:
            good.receive(encode(h, b"not the secret" * 3), KEY, NOW + t)
    assert good.counters["rejected_bad_mac"] == 5
    assert good.addresses(NOW + 5000) == {}
