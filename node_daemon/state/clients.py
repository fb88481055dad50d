"""Client identities in the state machine (issue 19): applied from the log,
so every replica holds the same identities; any node answers whose token a
hash is (the queue server's ``Authenticate`` read).

One database, ``clients``, two kinds of keys:

- ``n`` + name (made by an admin) or ``r`` + name (self-registered) -> the
  token's SHA-256 (32 bytes), then ClientIdentity (protobuf)
- ``h`` + SHA-256 of the token -> name

and a count per kind in ``meta`` (``clients/admin``, ``clients/registered``),
which bounds them: at most ``MAX_CLIENTS`` made by admins and
``MAX_REGISTERED`` self-registered (RESOURCE_EXHAUSTED beyond). The token is
never stored, only its hash. A revoke deletes both keys: its token stops
working at once on every replica that applied it (queue servers cache an
answer for a few seconds).

Invariant: every ``h`` key names an ``n`` key whose identity is stored with
that hash as its token's, and every ``n`` key has exactly one ``h`` key.
"""

from __future__ import annotations

import struct
from typing import Any

from roadlog.errors import Code, RoadlogError
from roadlog.scopes import OPERATOR_SCOPES, ScopeError, check_client_name, check_scopes
from roadlog.v1 import clients_pb2

MAX_CLIENTS = 10_000  # made by admins
MAX_REGISTERED = 1_000_000  # self-registered phones
HASH_BYTES = 32
_NAME, _REGISTERED, _HASH = b"n", b"r", b"h"
_COUNT = {False: b"clients/admin", True: b"clients/registered"}
_U64 = struct.Struct(">Q")


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
        txn.put(key, token_hash + stored.SerializeToString(), db=self.clients)
        txn.put(_HASH + token_hash, key, db=self.clients)
        self._set_count(txn, ident.registered, n + 1)
        return stored

    def revoke(self, txn: Any, name: str) -> None:
        """Delete the identity and its token's hash; NOT_FOUND if none."""
        found = self._named(txn, name) if name else None
        if found is None:
            raise RoadlogError(Code.NOT_FOUND, f"no client named {name!r}")
        key, raw = found
        ident = clients_pb2.ClientIdentity.FromString(raw[HASH_BYTES:])
        txn.delete(_HASH + bytes(raw[:HASH_BYTES]), db=self.clients)
        txn.delete(key, db=self.clients)
        self._set_count(txn, ident.registered, max(0, self._count(txn, ident.registered) - 1))

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
