"""A directory's federation in its group 0's state (issue 43,
docs/federation.md): the member clusters and each topic's home.

Kept in ``meta``: ``fed/member/NAME`` (a ``FederationMember``, without the
fields told only when read), ``fed/home/TOPIC`` (the home's name) and
``fed/count/NAME`` (how many topics have their home there, kept with the
homes). Invariants: a topic has at most one home; every home names a
registered member; a member's count is the number of homes naming it.

Every decision is made where the op is applied, from stored state and the
log's clock only (``log_ms``), so every replica decides alike: placement
(named, tags, least loaded) and which members count as healthy for it (a
report within ``HEALTHY_MS`` of the log's clock). ``healthy`` in an answer
is judged on the reader's clock (``now_ms``) the same way.
"""

from __future__ import annotations

import re
import struct
from typing import Any

from roadlog.errors import Code, RoadlogError
from roadlog.v1 import federation_pb2
from roadlog.validation import check_topic_name

HEALTHY_MS = 15_000  # three of the default 5 s reports
MAX_CA_BYTES = 16 << 10
MAX_ADDRESSES = 64
MEMBER_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
TAG = re.compile(r"^[A-Za-z0-9_.-]{1,64}=[A-Za-z0-9_.:/-]{1,128}$")
_MEMBER, _HOME, _COUNT = b"fed/member/", b"fed/home/", b"fed/count/"
_U64 = struct.Struct(">Q")
OPS = frozenset(
    {"register_member", "report_load", "place_topic_home", "forget_topic_home", "move_topic_home"}
)


def _bad(message: str) -> RoadlogError:
    return RoadlogError(Code.INVALID_ARGUMENT, message)


def check_member_name(name: str) -> str:
    if not MEMBER_NAME.match(name):
        raise _bad(
            f"bad cluster name {name!r}: lower-case letters, digits, '.', '_' or '-', "
            "1..63 characters, starting with a letter or digit"
        )
    return name


def check_tags(tags: Any) -> list[str]:
    """``key=value`` tags, checked, sorted, each key once (the last wins)."""
    by_key: dict[str, str] = {}
    for t in tags:
        if not TAG.match(t):
            raise _bad(f"bad tag {t!r}: key=value (letters, digits, '_', '.', '-')")
        k, _, v = t.partition("=")
        by_key[k] = v
    return [f"{k}={v}" for k, v in sorted(by_key.items())]


def _addresses(values: Any, what: str) -> list[str]:
    out = sorted(set(values))
    if len(out) > MAX_ADDRESSES or any(not a or len(a) > 256 for a in out):
        raise _bad(f"{what}: 1..{MAX_ADDRESSES} addresses of 1..256 characters")
    return out


class FederationTable:
    """The federation in ``meta`` (see the module's doc)."""

    def __init__(self, meta: Any) -> None:
        self.meta = meta

    # ------------------------------------------------------------ applying

    def apply(self, txn: Any, op: Any, log_ms: int, index: int) -> bytes:
        """One of ``OPS`` applied at the log's clock ``log_ms``; its answer."""
        kind = op.WhichOneof("op")
        if kind == "register_member":
            m = self.register(txn, op.register_member.member, log_ms)
            return federation_pb2.RegisterMemberResponse(
                member=self._told(txn, m, log_ms), applied_index=index
            ).SerializeToString()
        if kind == "report_load":
            self.report(txn, op.report_load.request, log_ms)
            return federation_pb2.ReportLoadResponse(applied_index=index).SerializeToString()
        if kind == "place_topic_home":
            home = self.place(txn, op.place_topic_home.request, log_ms)
            home.applied_index = index
            return home.SerializeToString()
        if kind == "forget_topic_home":
            req = op.forget_topic_home.request
            gone = self.forget(txn, req.topic, req.cluster)
            return federation_pb2.ForgetTopicHomeResponse(
                forgotten=gone, applied_index=index
            ).SerializeToString()
        if kind == "move_topic_home":
            home = self.move(txn, op.move_topic_home.request)
            home.applied_index = index
            return home.SerializeToString()
        raise RoadlogError(Code.INTERNAL, f"not a federation op: {kind}")

    def register(
        self, txn: Any, given: federation_pb2.FederationMember, log_ms: int
    ) -> federation_pb2.FederationMember:
        """A member registered, or registered again: its tags and CA are the
        newest registration's; its queue servers and HTTP APIs add up (each
        of its queue servers registers itself)."""
        name = check_member_name(given.name)
        if len(given.ca_pem) > MAX_CA_BYTES:
            raise _bad(f"a member's CA is at most {MAX_CA_BYTES} bytes of PEM")
        m = self.member(txn, name) or federation_pb2.FederationMember(
            name=name, registered_ms=log_ms
        )
        m.tags[:] = check_tags(given.tags)
        m.queue_servers[:] = _addresses([*m.queue_servers, *given.queue_servers], "queue_servers")
        m.http[:] = sorted(set(m.http) | set(given.http))
        if given.ca_pem:
            m.ca_pem = given.ca_pem
        self._put(txn, m)
        return m

    def report(self, txn: Any, req: federation_pb2.ReportLoadRequest, log_ms: int) -> None:
        """A queue server's load, kept as its member's newest from it."""
        m = self.member(txn, req.name)
        if m is None:
            raise RoadlogError(Code.NOT_FOUND, f"no member cluster {req.name!r}: register first")
        if req.load.queue_server not in m.queue_servers:
            raise RoadlogError(
                Code.NOT_FOUND, f"{req.load.queue_server!r} is not registered for {req.name!r}"
            )
        load = federation_pb2.MemberLoad()
        load.CopyFrom(req.load)
        load.reported_ms = log_ms
        kept = [x for x in m.loads if x.queue_server != load.queue_server]
        del m.loads[:]
        m.loads.extend(sorted([*kept, load], key=lambda x: x.queue_server))
        self._put(txn, m)

    def place(
        self, txn: Any, req: federation_pb2.PlaceTopicRequest, log_ms: int
    ) -> federation_pb2.TopicHome:
        """The topic's home chosen (``PlaceTopicRequest``'s rule) and kept."""
        try:
            check_topic_name(req.topic)
        except ValueError as e:
            raise _bad(str(e)) from None
        held = self.home_name(txn, req.topic)
        if held is not None:
            raise RoadlogError(
                Code.ALREADY_EXISTS, f"topic {req.topic!r} has its home in cluster {held!r}"
            )
        members = self.members(txn)
        if req.on:
            chosen = next((m for m in members if m.name == req.on), None)
            if chosen is None:
                known = ", ".join(m.name for m in members) or "none"
                raise RoadlogError(
                    Code.NOT_FOUND, f"no member cluster {req.on!r} (members: {known})"
                )
        else:
            want = set(check_tags(req.tags))
            fit = [m for m in members if _healthy(m, log_ms) and want <= set(m.tags)]
            if not fit:
                raise RoadlogError(
                    Code.FAILED_PRECONDITION if members else Code.UNAVAILABLE,
                    "no healthy member cluster"
                    + (f" with tags {', '.join(sorted(want))}" if want else ""),
                )
            chosen = min(fit, key=lambda m: (self.count(txn, m.name), _publishes_per_s(m), m.name))
        txn.put(_HOME + req.topic.encode(), chosen.name.encode(), db=self.meta)
        self._count(txn, chosen.name, +1)
        return self._home(req.topic, chosen)

    def forget(self, txn: Any, topic: str, cluster: str = "") -> bool:
        """The topic's home dropped, if it is ``cluster`` ("": whichever)."""
        held = self.home_name(txn, topic)
        if held is None or (cluster and held != cluster):
            return False
        txn.delete(_HOME + topic.encode(), db=self.meta)
        self._count(txn, held, -1)
        return True

    def move(self, txn: Any, req: federation_pb2.MoveTopicHomeRequest) -> federation_pb2.TopicHome:
        """A moved topic's home flipped to ``req.target``, only if it is
        ``req.source`` (a compare-and-set: of two movers one wins, and a
        move abandoned after its flip was refused leaves the home alone)."""
        held = self.home_name(txn, req.topic)
        if held is None:
            raise RoadlogError(Code.NOT_FOUND, f"no topic {req.topic!r} in the federation")
        if held != req.source:
            raise RoadlogError(
                Code.FAILED_PRECONDITION,
                f"topic {req.topic!r} has its home in {held!r}, not {req.source!r}",
            )
        target = self.member(txn, req.target)
        if target is None:
            raise RoadlogError(Code.NOT_FOUND, f"no member cluster {req.target!r}")
        if held != target.name:
            txn.put(_HOME + req.topic.encode(), target.name.encode(), db=self.meta)
            self._count(txn, held, -1)
            self._count(txn, target.name, +1)
        return self._home(req.topic, target)

    # --------------------------------------------------------------- reads

    def member(self, txn: Any, name: str) -> federation_pb2.FederationMember | None:
        raw = txn.get(_MEMBER + name.encode(), db=self.meta)
        return federation_pb2.FederationMember.FromString(bytes(raw)) if raw else None

    def members(self, txn: Any) -> list[federation_pb2.FederationMember]:
        """Every member, by name (stored fields only)."""
        return [
            federation_pb2.FederationMember.FromString(bytes(v))
            for _, v in self._scan(txn, _MEMBER)
        ]

    def home_name(self, txn: Any, topic: str) -> str | None:
        raw = txn.get(_HOME + topic.encode(), db=self.meta)
        return bytes(raw).decode() if raw else None

    def home(self, txn: Any, topic: str) -> federation_pb2.TopicHome:
        """The topic's home with its member's addresses; NOT_FOUND if none."""
        name = self.home_name(txn, topic)
        m = self.member(txn, name) if name is not None else None
        if m is None:
            raise RoadlogError(Code.NOT_FOUND, f"no topic {topic!r} in the federation")
        return self._home(topic, m)

    def count(self, txn: Any, name: str) -> int:
        raw = txn.get(_COUNT + name.encode(), db=self.meta)
        return int(_U64.unpack(raw)[0]) if raw else 0

    def federation(self, txn: Any, now_ms: int) -> federation_pb2.Federation:
        """Every member (as told: healthy on ``now_ms``, its topics) and
        every topic's home (topic and cluster)."""
        out = federation_pb2.Federation()
        out.members.extend(self._told(txn, m, now_ms) for m in self.members(txn))
        for key, value in self._scan(txn, _HOME):
            out.topics.add(topic=bytes(key[len(_HOME) :]).decode(), cluster=bytes(value).decode())
        return out

    # ------------------------------------------------------------- helpers

    def _told(
        self, txn: Any, m: federation_pb2.FederationMember, now_ms: int
    ) -> federation_pb2.FederationMember:
        told = federation_pb2.FederationMember()
        told.CopyFrom(m)
        told.reported_ms = _reported_ms(m)
        told.healthy = _healthy(m, now_ms)
        told.topics = self.count(txn, m.name)
        return told

    @staticmethod
    def _home(topic: str, m: federation_pb2.FederationMember) -> federation_pb2.TopicHome:
        return federation_pb2.TopicHome(
            topic=topic, cluster=m.name, queue_servers=m.queue_servers, http=m.http
        )

    def _put(self, txn: Any, m: federation_pb2.FederationMember) -> None:
        txn.put(_MEMBER + m.name.encode(), m.SerializeToString(deterministic=True), db=self.meta)

    def _count(self, txn: Any, name: str, delta: int) -> None:
        n = max(0, self.count(txn, name) + delta)
        txn.put(_COUNT + name.encode(), _U64.pack(n), db=self.meta)

    def _scan(self, txn: Any, prefix: bytes) -> list[tuple[bytes, bytes]]:
        cur = txn.cursor(db=self.meta)
        out: list[tuple[bytes, bytes]] = []
        if cur.set_range(prefix):
            for key, value in cur.iternext():
                if not bytes(key).startswith(prefix):
                    break
                out.append((bytes(key), bytes(value)))
        return out


def _reported_ms(m: federation_pb2.FederationMember) -> int:
    return max((x.reported_ms for x in m.loads), default=0)


def _healthy(m: federation_pb2.FederationMember, now_ms: int) -> bool:
    """Some queue server of it reported within ``HEALTHY_MS`` of ``now_ms``."""
    last = _reported_ms(m)
    return bool(last) and now_ms - last <= HEALTHY_MS


def _publishes_per_s(m: federation_pb2.FederationMember) -> float:
    return sum(x.publishes_per_s for x in m.loads)
