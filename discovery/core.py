"""Discovery, sans-I/O: who is out there, and whether this node founds a
cluster, joins one, or waits.

Time is passed in (``now_ms``); datagrams come in as bytes and go out as
``Hello`` objects for the adapter to encode and send.

Founding a cluster with ``bootstrap_expect = N`` (every node configured
alike):

1. Each new node announces the ids of the new nodes it hears (``seen``).
2. Once its ``seen`` has N or more ids and has not changed for
   ``settle`` intervals, a node votes for the N lowest ids, if it is among
   them. If it hears a vote already cast that includes it, it adopts the
   lowest such vote instead; if it only hears votes that leave it out, it
   does not vote (a cluster is forming without it: it will join). A vote
   is sticky: a node never votes for two different sets while it waits
   (but see 4).
3. The lowest id of a vote founds the cluster (alone, as its first voter;
   the others then join it one at a time) once every node of the vote has
   announced that very vote, the agreement has held for ``settle``
   intervals, every vote is younger than ``vote_ttl_ms - vote_margin_ms``,
   and no existing cluster has been heard.
4. A vote that led to nothing for ``vote_ttl_ms`` (a deadlock of crossed
   votes, or a founder that died) is withdrawn and cast afresh.

Why one cluster: votes are sticky, so two founders need two disjoint
unanimous votes, which needs at least 2N new nodes that did not hear each
other's votes, or a node that withdrew a vote its founder acted on without
hearing the founder announce the cluster for ``vote_margin_ms`` (votes
announce their age; a founder acts only on votes that have that much life
left). Any node that hears an existing cluster stops voting and joins it.
As a last line, a member that hears a leader of another membership under
the same cluster name counts it as ``split_brain`` (alarm, not repair).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from discovery.limits import Admission
from discovery.protocol import Hello, Member, Rejected, ReplayGuard, decode

DEFAULT_INTERVAL_MS = 1000
PEER_TTL_MS = 10_000
SETTLE_INTERVALS = 2
VOTE_TTL_MS = 20_000
VOTE_MARGIN_MS = 8_000


@dataclass(frozen=True)
class Found:
    """Found the cluster: bootstrap with this node as the only voter, then
    add ``others`` (the rest of the vote) as they ask to join."""

    others: tuple[int, ...]


@dataclass(frozen=True)
class Join:
    """Ask the cluster's leader to add this node."""

    leader: int
    leader_address: str
    term: int = 0
    members: tuple[int, ...] = ()  # as the freshest announcement says


@dataclass
class _Peer:
    hello: Hello
    heard_ms: int


@dataclass
class DiscoveryCore:
    cluster: str
    node_id: int
    role: str
    address: str
    expect: int = 0
    interval_ms: int = DEFAULT_INTERVAL_MS
    settle: int = SETTLE_INTERVALS
    vote_ttl_ms: int = VOTE_TTL_MS
    vote_margin_ms: int = VOTE_MARGIN_MS
    counters: Counter[str] = field(default_factory=Counter)
    peers: dict[int, _Peer] = field(default_factory=dict)
    vote: tuple[int, ...] = ()
    vote_ms: int = 0
    member: bool = False
    leader: int = 0
    leader_address: str = ""
    term: int = 0
    members: tuple[Member, ...] = ()
    admission: Admission = field(default_factory=Admission)
    _replay: ReplayGuard = field(default_factory=ReplayGuard)
    _seen_changed_ms: int = 0
    _last_seen: tuple[int, ...] = ()
    _agreed_since_ms: int = 0
    _next_hello_ms: int = 0

    # ------------------------------------------------------------ inputs

    def receive(
        self, data: bytes, key: bytes, now_ms: int, source: str | None = None
    ) -> Hello | None:
        """A datagram arrived: accepted (and remembered) or counted. With
        its ``source`` address it must first get a token of the admission
        budgets (all sources, then its own), before any MAC or JSON work."""
        if source is not None:
            dropped = self.admission.admit(source, now_ms)
            if dropped is not None:
                self.counters[dropped] += 1
                return None
        try:
            h = decode(data, key, self.cluster, now_ms, self._replay)
        except Rejected as e:
            self.counters[f"rejected_{e.reason}"] += 1
            return None
        if h.node_id == self.node_id and h.role == self.role:
            self.counters["own"] += 1  # our own broadcast, looped back
            return None
        self.counters["accepted"] += 1
        self.peers[h.node_id if h.role == "node" else -h.node_id] = _Peer(h, now_ms)
        if self.member and h.state == "member" and h.role == "node" and self.members:
            mine = {m.node_id for m in self.members}
            theirs = {m.node_id for m in h.members}
            if h.leader and h.leader not in mine and not mine & theirs:
                self.counters["split_brain"] += 1
        return h

    def set_member(
        self, leader: int, leader_address: str, term: int, members: tuple[Member, ...]
    ) -> None:
        """This node is in a cluster now (the node daemon tells us)."""
        self.member = True
        self.vote = ()
        self.leader, self.leader_address, self.term = leader, leader_address, term
        self.members = members

    # ----------------------------------------------------------- outputs

    def due(self, now_ms: int) -> Hello | None:
        """The HELLO to send now, if one is due (one per interval)."""
        if now_ms < self._next_hello_ms:
            return None
        self._next_hello_ms = now_ms + self.interval_ms
        return self.hello(now_ms)

    def hello(self, now_ms: int) -> Hello:
        return Hello(
            cluster=self.cluster,
            node_id=self.node_id,
            role=self.role,
            address=self.address,
            state="member" if self.member else "new",
            expect=self.expect,
            seen=self._seen(now_ms) if not self.member and self.role == "node" else (),
            vote=self.vote,
            vote_age_ms=now_ms - self.vote_ms if self.vote else 0,
            leader=self.leader,
            leader_address=self.leader_address,
            term=self.term,
            members=self.members,
            ts_ms=now_ms,
        )

    def decide(self, now_ms: int) -> Found | Join | None:
        """What a node that is not a member yet should do now."""
        if self.member or self.role != "node":
            return None
        cluster = self.known_cluster(now_ms)
        if cluster is not None:
            self.vote = ()
            return cluster
        if self.expect <= 0:
            return None  # no founding here: wait for a cluster to appear
        self._update_vote(now_ms)
        if self.vote and self.vote[0] == self.node_id and self._agreed(now_ms):
            return Found(self.vote[1:])
        return None

    def known_cluster(self, now_ms: int) -> Join | None:
        """The freshest leader any member announces, if any."""
        best: Hello | None = None
        for p in self._live(now_ms):
            h = p.hello
            announces = h.role == "node" and h.state == "member" and h.leader and h.leader_address
            if announces and (best is None or h.term > best.term):
                best = h
        if best is None:
            return None
        return Join(
            best.leader, best.leader_address, best.term, tuple(m.node_id for m in best.members)
        )

    def addresses(self, now_ms: int) -> dict[int, str]:
        """gRPC addresses of the nodes heard lately (and the members they
        announce)."""
        out: dict[int, str] = {}
        for p in self._live(now_ms):
            h = p.hello
            if h.role != "node":
                continue
            for m in h.members:
                out.setdefault(m.node_id, m.address)
            out[h.node_id] = h.address
        return out

    def queue_servers(self, now_ms: int) -> list[str]:
        return sorted(p.hello.address for p in self._live(now_ms) if p.hello.role == "queue")

    # ---------------------------------------------------------- founding

    def _live(self, now_ms: int) -> list[_Peer]:
        return [p for p in self.peers.values() if now_ms - p.heard_ms <= PEER_TTL_MS]

    def _seen(self, now_ms: int) -> tuple[int, ...]:
        ids = {self.node_id}
        ids |= {
            p.hello.node_id
            for p in self._live(now_ms)
            if p.hello.role == "node" and p.hello.state == "new"
        }
        seen = tuple(sorted(ids))
        if seen != self._last_seen:
            self._last_seen, self._seen_changed_ms = seen, now_ms
        return seen

    def _update_vote(self, now_ms: int) -> None:
        if self.vote and now_ms - self.vote_ms > self.vote_ttl_ms:
            self.counters["votes_withdrawn"] += 1
            self.vote = ()  # it led to nothing: cast afresh below
        if self.vote:
            return
        seen = self._seen(now_ms)
        cast = sorted(
            p.hello.vote
            for p in self._live(now_ms)
            if p.hello.role == "node" and p.hello.state == "new" and p.hello.vote
        )
        if cast:
            mine = [v for v in cast if self.node_id in v and len(v) == self.expect]
            if mine:
                self._cast(mine[0], now_ms)
            return  # votes without us: a cluster forms elsewhere, we join it
        stable = now_ms - self._seen_changed_ms >= self.settle * self.interval_ms
        if len(seen) >= self.expect and stable:
            lowest = seen[: self.expect]
            if self.node_id in lowest:
                self._cast(lowest, now_ms)

    def _cast(self, vote: tuple[int, ...], now_ms: int) -> None:
        self.vote, self.vote_ms = vote, now_ms
        self._agreed_since_ms = 0
        self.counters["votes_cast"] += 1

    def _agreed(self, now_ms: int) -> bool:
        """Every node of our vote announces it, freshly, for ``settle``
        intervals; no one has announced a different vote that includes one
        of ours."""
        live = {p.hello.node_id: p for p in self._live(now_ms) if p.hello.role == "node"}
        limit = self.vote_ttl_ms - self.vote_margin_ms
        ok = now_ms - self.vote_ms < limit
        for n in self.vote:
            if n == self.node_id:
                continue
            p = live.get(n)
            if p is None or p.hello.vote != self.vote or p.hello.state != "new":
                ok = False
            elif p.hello.vote_age_ms + (now_ms - p.heard_ms) >= limit:
                ok = False  # it may be withdrawn before we are heard
        if not ok:
            self._agreed_since_ms = 0
            return False
        if not self._agreed_since_ms:
            self._agreed_since_ms = now_ms
        return now_ms - self._agreed_since_ms >= self.settle * self.interval_ms
