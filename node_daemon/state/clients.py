"""Client identities in the state machine (issue 19): applied from the log,
so every replica holds the same identities; any node answers whose token a
hash is (the queue server's ``Authenticate`` read).

One database, ``clients``, three kinds of keys:

- ``n`` + name (made by an admin) or ``r`` + name (self-registered) -> the
  token's SHA-256 (32 bytes), then ClientIdentity (protobuf)
- ``h`` + SHA-256 of the token -> name
- ``u`` + the day (>I, days since the epoch) + name -> nothing: when a
  self-registered identity was last known used (its ``used_day``), so the
  trim finds the longest idle first without reading the others

and a count per kind in ``meta`` (``clients/admin``, ``clients/registered``),
which bounds them: at most ``MAX_CLIENTS`` made by admins and
``MAX_REGISTERED`` self-registered (RESOURCE_EXHAUSTED beyond). The token is
never stored, only its hash. A revoke deletes both keys: its token stops
working at once on every replica that applied it (queue servers cache an
answer for a few seconds).

Idle self-registered identities are forgotten (issue 39, item 2): a queue
server notes which it saw used (at most once a day each), group 0's leader
gathers them and its retention trim carries them (``TrimOp.clients_used``:
one entry every ``trim_interval_s``, never one per request), and the same
trim deletes every self-registered identity whose ``used_day`` is more than
``registration_idle_days`` before the log's day, as a revoke does: its
token is unknown from then on and its place under ``MAX_REGISTERED`` free.
Identities from before this (``used_day`` 0) count as used on the day of
the first such trim. A full ``MAX_REGISTERED`` refuses registrations only:
tokens issued keep working.

Invariant: every ``h`` key names an ``n`` or ``r`` key whose identity is
stored with that hash as its token's, and every such key has exactly one
``h`` key; every ``r`` identity with a ``used_day`` has exactly one ``u``
key, of that day, and every ``u`` key names an ``r`` identity.
"""

from __future__ import annotations

import itertools
import struct
from typing import Any

from roadlog.errors import Code, RoadlogError
from roadlog.scopes import OPERATOR_SCOPES, ScopeError, check_client_name, check_scopes
from roadlog.v1 import clients_pb2

MAX_CLIENTS = 10_000  # made by admins
MAX_REGISTERED = 1_000_000  # self-registered phones
HASH_BYTES = 32
DAY_MS = 86_400_000
FORGOTTEN_PER_TRIM = 10_000  # idle identities one trim forgets at most
USED_PER_TRIM = 10_000  # names one trim records as used at most
MAX_USED_PENDING = 100_000  # names a leader holds for its next trims
_NAME, _REGISTERED, _HASH, _USED = b"n", b"r", b"h", b"u"
_COUNT = {False: b"clients/admin", True: b"clients/registered"}
_USED_INDEXED = b"clients/used_indexed"  # every r identity has its u key
_U64 = struct.Struct(">Q")
_DAY = struct.Struct(">I")


def day_of(ms: int) -> int:
    """The day (since the Unix epoch) of a time on the log's clock."""
    return max(0, ms) // DAY_MS


class ClientTables:
    def __init__(self, clients_db: Any, meta_db: Any) -> None:
        self.clients = clients_db
        self.meta = meta_db

    def _count(self, txn: Any, registered: bool) -> int:
        raw = txn.get(_COUNT[registered], db=self.meta)
        return int(_U64.unpack(raw)[0]) if raw else 0

    def _set_count(self, txn: Any, registered: bool, n: int) -> None:
        txn.put(_COUNT[registered], _U64.pack(n), db=self.meta)

    def create(
        self, txn: Any, ident: clients_pb2.ClientIdentity, token_hash: bytes, leader_ms: int
    ) -> clients_pb2.ClientIdentity:
        """Store a new identity; ALREADY_EXISTS for a name taken (the same
        request again, same hash, is answered with what is stored)."""
        check_identity(ident)
        if len(token_hash) != HASH_BYTES:
            raise RoadlogError(Code.INVALID_ARGUMENT, "a token hash is 32 bytes (SHA-256)")
        name = ident.name.encode()
        key = (_REGISTERED if ident.registered else _NAME) + name
        existing = txn.get(key, db=self.clients)
        if existing is not None:
            if bytes(existing[:HASH_BYTES]) == token_hash:
                return clients_pb2.ClientIdentity.FromString(existing[HASH_BYTES:])  # a retry
            raise RoadlogError(Code.ALREADY_EXISTS, f"a client named {ident.name!r} exists")
        if self._named(txn, ident.name) is not None:
            raise RoadlogError(Code.ALREADY_EXISTS, f"a client named {ident.name!r} exists")
        if txn.get(_HASH + token_hash, db=self.clients) is not None:
            raise RoadlogError(Code.ALREADY_EXISTS, "that token is taken: make another")
        n = self._count(txn, ident.registered)
        limit = MAX_REGISTERED if ident.registered else MAX_CLIENTS
        if n >= limit:
            what = "self-registered identities" if ident.registered else "client identities"
            raise RoadlogError(
                Code.RESOURCE_EXHAUSTED,
                f"identity quota: the cluster holds {limit} {what}: revoke some first",
            )
        stored = clients_pb2.ClientIdentity()
        stored.CopyFrom(ident)
        stored.created_ms = leader_ms
        stored.used_day = day_of(leader_ms) if ident.registered else 0
        txn.put(key, token_hash + stored.SerializeToString(), db=self.clients)
        txn.put(_HASH + token_hash, key, db=self.clients)
        if ident.registered:
            txn.put(_used_key(stored.used_day, name), b"", db=self.clients)
        self._set_count(txn, ident.registered, n + 1)
        return stored

    def revoke(self, txn: Any, name: str) -> None:
        """Delete the identity and its token's hash; NOT_FOUND if none."""
        found = self._named(txn, name) if name else None
        if found is None:
            raise RoadlogError(Code.NOT_FOUND, f"no client named {name!r}")
        self._delete(txn, *found)

    def _delete(self, txn: Any, key: bytes, raw: bytes) -> None:
        ident = clients_pb2.ClientIdentity.FromString(raw[HASH_BYTES:])
        txn.delete(_HASH + bytes(raw[:HASH_BYTES]), db=self.clients)
        txn.delete(key, db=self.clients)
        if ident.registered and ident.used_day:
            txn.delete(_used_key(ident.used_day, ident.name.encode()), db=self.clients)
        self._set_count(txn, ident.registered, max(0, self._count(txn, ident.registered) - 1))

    def counts(self, txn: Any) -> tuple[int, int]:
        """(identities admins made, self-registered ones)."""
        return self._count(txn, False), self._count(txn, True)

    def trim(self, txn: Any, used: Any, log_ms: int, idle_days: int) -> int:
        """The retention trim's part (see the module's doc): ``used``
        (names) recorded as used on the log's day, then idle identities
        forgotten (``idle_days`` 0: none). Returns how many were."""
        today = day_of(log_ms)
        self._index_used(txn, today)
        for name in list(used)[:USED_PER_TRIM]:
            self._used(txn, name.encode(), today)
        if not idle_days:
            return 0
        before = _used_key(max(0, today - idle_days), b"")
        idle: list[bytes] = []
        cur = txn.cursor(db=self.clients)
        if cur.set_range(_USED):
            for k in cur.iternext(values=False):
                if k >= before or len(idle) >= FORGOTTEN_PER_TRIM:
                    break
                idle.append(bytes(k))
        for k in idle:
            key = _REGISTERED + k[1 + _DAY.size :]
            raw = txn.get(key, db=self.clients)
            if raw is None:  # not kept by the invariant: only the stray key goes
                txn.delete(k, db=self.clients)
            else:
                self._delete(txn, key, bytes(raw))
        return len(idle)

    def _used(self, txn: Any, name: bytes, day: int) -> None:
        """Record that self-registered ``name`` was used on ``day``."""
        if len(name) > 255:
            return
        raw = txn.get(_REGISTERED + name, db=self.clients)
        if raw is None:
            return  # not a self-registered identity (or gone): nothing to record
        ident = clients_pb2.ClientIdentity.FromString(raw[HASH_BYTES:])
        if ident.used_day >= day:
            return
        if ident.used_day:
            txn.delete(_used_key(ident.used_day, name), db=self.clients)
        ident.used_day = day
        value = bytes(raw[:HASH_BYTES]) + ident.SerializeToString()
        txn.put(_REGISTERED + name, value, db=self.clients)
        txn.put(_used_key(day, name), b"", db=self.clients)

    def _index_used(self, txn: Any, today: int) -> None:
        """Once: identities registered before use was recorded count as
        used ``today`` (the first trim that forgets)."""
        if txn.get(_USED_INDEXED, db=self.meta) is not None:
            return
        names: list[bytes] = []
        cur = txn.cursor(db=self.clients)
        if cur.set_range(_REGISTERED):
            for k, v in cur:
                if not k.startswith(_REGISTERED):
                    break
                if not clients_pb2.ClientIdentity.FromString(v[HASH_BYTES:]).used_day:
                    names.append(bytes(k[1:]))
        for name in names:
            self._used(txn, name, today)
        txn.put(_USED_INDEXED, b"1", db=self.meta)

    def _named(self, txn: Any, name: str) -> tuple[bytes, bytes] | None:
        """(key, value) of the identity called ``name``, of either kind."""
        if not name or len(name.encode()) > 255:
            return None
        for prefix in (_NAME, _REGISTERED):
            raw = txn.get(prefix + name.encode(), db=self.clients)
            if raw is not None:
                return prefix + name.encode(), bytes(raw)
        return None

    def by_hash(self, txn: Any, token_hash: bytes) -> clients_pb2.ClientIdentity | None:
        if len(token_hash) != HASH_BYTES:
            return None
        key = txn.get(_HASH + token_hash, db=self.clients)
        if key is None:
            return None
        raw = txn.get(bytes(key), db=self.clients)
        if raw is None:
            return None
        return clients_pb2.ClientIdentity.FromString(raw[HASH_BYTES:])

    def token_hashes(self, txn: Any) -> dict[str, bytes]:
        """Every identity's client id -> its token's hash (one scan: for a
        topic move, which maps bound producers by their owner's token)."""
        out: dict[str, bytes] = {}
        for prefix in (_NAME, _REGISTERED):
            cur = txn.cursor(db=self.clients)
            if cur.set_range(prefix):
                for k, v in cur:
                    if not k.startswith(prefix):
                        break
                    ident = clients_pb2.ClientIdentity.FromString(v[HASH_BYTES:])
                    out[ident.client_id] = bytes(v[:HASH_BYTES])
        return out

    def listing(self, txn: Any) -> clients_pb2.ListClientsResponse:
        """The identities admins made, by name, and how many registered themselves."""
        out = clients_pb2.ListClientsResponse(registered=self._count(txn, True))
        cur = txn.cursor(db=self.clients)
        if cur.set_range(_NAME):
            for k, v in cur:
                if not k.startswith(_NAME):
                    break
                out.clients.append(clients_pb2.ClientIdentity.FromString(v[HASH_BYTES:]))
        return out


def _used_key(day: int, name: bytes) -> bytes:
    return _USED + _DAY.pack(day) + name


class UsedNames:
    """The self-registered identities queue servers saw used, as group 0's
    leader holds them until its next trim carries them (at most
    ``MAX_USED_PENDING``; more are dropped: a queue server tells again the
    next day an identity is used)."""

    def __init__(self, limit: int = MAX_USED_PENDING) -> None:
        self.limit = limit
        self.names: dict[str, None] = {}  # in the order told

    def add(self, names: Any) -> int:
        """Hold ``names``; returns how many are held now."""
        for name in names:
            if len(self.names) >= self.limit:
                break
            self.names[name] = None
        return len(self.names)

    def take(self, limit: int = USED_PER_TRIM) -> list[str]:
        """The first ``limit`` names held, no longer held."""
        out = list(itertools.islice(self.names, limit))
        for name in out:
            del self.names[name]
        return out


def check_identity(ident: clients_pb2.ClientIdentity) -> None:
    """INVALID_ARGUMENT unless the identity is well formed (every replica
    checks alike, so a bad op is refused everywhere)."""
    try:
        check_client_name(ident.name)
        check_scopes(ident.scopes)
        if ident.registered and any(s in OPERATOR_SCOPES for s in ident.scopes):
            # open_registration_scopes never holds them (``settings``)
            raise ScopeError("a self-registered identity may never have admin or ops")
    except ValueError as e:
        raise RoadlogError(Code.INVALID_ARGUMENT, str(e)) from None
    if not ident.client_id or len(ident.client_id.encode()) > 64:
        raise RoadlogError(Code.INVALID_ARGUMENT, "an identity needs a client id (1..64 bytes)")
