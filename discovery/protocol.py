"""The discovery datagram: an authenticated HELLO (sans-I/O).

Wire format: ``b"RLD"``, a version byte, a JSON object (UTF-8), then
HMAC-SHA256 over everything before it, keyed with the discovery key: one
derived from the cluster secret (``discovery_key``), so that a client that
finds queue servers holds no credential of the cluster itself. A
datagram is accepted only if it is at most ``MAX_DATAGRAM`` bytes, the MAC
is right (constant-time compare), the JSON has the expected fields and
types, the cluster name is ours, its timestamp is within ``MAX_SKEW_MS`` of
our clock, and its (sender, nonce) was not seen before: forged, foreign,
replayed, oversized or garbage datagrams are refused with a reason (and
counted by the caller), never raise anything else.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass, field
from typing import Any

MAGIC = b"RLD"
VERSION = 1
MAC_BYTES = 32
MAX_DATAGRAM = 1400  # fits one Ethernet frame with room for IP/UDP headers
MAX_SKEW_MS = 30_000
MAX_MEMBERS = 32
ROLES = ("node", "queue")
STATES = ("new", "member")


class Rejected(ValueError):
    """A datagram we do not accept; ``reason`` is a short metric label."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class Member:
    node_id: int
    address: str
    voter: bool


@dataclass(frozen=True)
class Hello:
    """What a process says about itself every interval.

    ``seen``: node ids of new nodes this node heard lately (itself included);
    ``vote``: the founding set it agreed to (sticky once cast); ``leader``
    and ``members``: the cluster it belongs to, once it does.
    """

    cluster: str
    node_id: int
    role: str
    address: str  # gRPC HOST:PORT
    state: str = "new"
    expect: int = 0
    seen: tuple[int, ...] = ()
    vote: tuple[int, ...] = ()
    vote_age_ms: int = 0
    leader: int = 0
    leader_address: str = ""
    term: int = 0
    members: tuple[Member, ...] = ()
    ts_ms: int = 0
    nonce: str = field(default_factory=lambda: os.urandom(8).hex())


_KEY_SALT = b"roadlog"
_KEY_INFO = b"roadlog discovery v1"


def discovery_key(secret: bytes) -> bytes:
    """The key HELLOs are signed with: HKDF-SHA256 (RFC 5869) of the cluster
    secret, one 32-byte block. Whoever holds it can find and announce
    members, but cannot get the secret back, nor the cluster token derived
    from the secret (``roadlog-node discovery-key`` prints it for clients)."""
    prk = hmac.new(_KEY_SALT, secret, hashlib.sha256).digest()
    return hmac.new(prk, _KEY_INFO + b"\x01", hashlib.sha256).digest()


def encode(h: Hello, key: bytes) -> bytes:
    body = {
        "c": h.cluster,
        "id": h.node_id,
        "r": h.role,
        "a": h.address,
        "s": h.state,
        "x": h.expect,
        "seen": list(h.seen),
        "vote": list(h.vote),
        "va": h.vote_age_ms,
        "l": h.leader,
        "la": h.leader_address,
        "t": h.term,
        "m": [[m.node_id, m.address, int(m.voter)] for m in h.members],
        "ts": h.ts_ms,
        "n": h.nonce,
    }
    head = MAGIC + bytes([VERSION]) + json.dumps(body, separators=(",", ":")).encode()
    out = head + hmac.new(key, head, hashlib.sha256).digest()
    if len(out) > MAX_DATAGRAM:
        raise ValueError(f"HELLO of {len(out)} bytes exceeds {MAX_DATAGRAM}")
    return out


def _int(v: Any, lo: int = 0, hi: int = 2**63 - 1) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise Rejected("malformed", "bad integer")
    return v


def _str(v: Any, max_len: int = 255) -> str:
    if not isinstance(v, str) or len(v) > max_len:
        raise Rejected("malformed", "bad string")
    return v


def _ids(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > MAX_MEMBERS:
        raise Rejected("malformed", "bad id list")
    return tuple(_int(x, 1) for x in v)


class ReplayGuard:
    """Remembers (sender, nonce) pairs for as long as their timestamps are
    acceptable, so a datagram recorded and sent again is refused."""

    def __init__(self, max_entries: int = 100_000) -> None:
        self.seen: dict[tuple[int, str], int] = {}
        self.max_entries = max_entries

    def check(self, sender: int, nonce: str, ts_ms: int, now_ms: int) -> None:
        if (sender, nonce) in self.seen:
            raise Rejected("replayed")
        if len(self.seen) >= self.max_entries:
            self.prune(now_ms)
            if len(self.seen) >= self.max_entries:
                raise Rejected("flood", "too many recent nonces")
        self.seen[(sender, nonce)] = ts_ms

    def prune(self, now_ms: int) -> None:
        old = [k for k, ts in self.seen.items() if ts < now_ms - 2 * MAX_SKEW_MS]
        for k in old:
            del self.seen[k]


def decode(data: bytes, key: bytes, cluster: str | None, now_ms: int, replay: ReplayGuard) -> Hello:
    """The HELLO in ``data``, or Rejected saying why not (``cluster`` None:
    any cluster name signed with ``key``)."""
    if len(data) > MAX_DATAGRAM:
        raise Rejected("oversized")
    if len(data) < len(MAGIC) + 1 + MAC_BYTES or not data.startswith(MAGIC):
        raise Rejected("garbage")
    if data[len(MAGIC)] != VERSION:
        raise Rejected("version", f"version {data[len(MAGIC)]}")
    head, mac = data[:-MAC_BYTES], data[-MAC_BYTES:]
    if not hmac.compare_digest(mac, hmac.new(key, head, hashlib.sha256).digest()):
        raise Rejected("bad_mac")
    try:
        body = json.loads(head[len(MAGIC) + 1 :])
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise Rejected("malformed", "not JSON") from None
    if not isinstance(body, dict):
        raise Rejected("malformed", "not an object")
    try:
        h = Hello(
            cluster=_str(body["c"], 64),
            node_id=_int(body["id"], 1),
            role=_str(body["r"], 16),
            address=_str(body["a"]),
            state=_str(body["s"], 16),
            expect=_int(body["x"], 0, MAX_MEMBERS),
            seen=_ids(body["seen"]),
            vote=_ids(body["vote"]),
            vote_age_ms=_int(body["va"]),
            leader=_int(body["l"]),
            leader_address=_str(body["la"]),
            term=_int(body["t"]),
            members=_members(body["m"]),
            ts_ms=_int(body["ts"]),
            nonce=_str(body["n"], 64),
        )
    except KeyError as e:
        raise Rejected("malformed", f"missing {e}") from None
    if h.role not in ROLES or h.state not in STATES:
        raise Rejected("malformed", "unknown role or state")
    if cluster is not None and h.cluster != cluster:
        raise Rejected("foreign_cluster", h.cluster)
    if abs(h.ts_ms - now_ms) > MAX_SKEW_MS:
        raise Rejected("stale", f"{h.ts_ms - now_ms} ms off")
    replay.check(h.node_id, h.nonce, h.ts_ms, now_ms)
    return h


def _members(v: Any) -> tuple[Member, ...]:
    if not isinstance(v, list) or len(v) > MAX_MEMBERS:
        raise Rejected("malformed", "bad member list")
    out = []
    for m in v:
        if not isinstance(m, list) or len(m) != 3:
            raise Rejected("malformed", "bad member")
        out.append(Member(_int(m[0], 1), _str(m[1]), bool(_int(m[2], 0, 1))))
    return tuple(out)
