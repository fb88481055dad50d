"""Client identities' scopes and tokens (issue 19), shared by the queue
server (which checks them), the node (which stores identities) and the
tools (which make them).

Scopes: ``admin`` (everything: topics, clients, groups, heat-map writes,
settings, and every topic's pings and maps), ``ops`` (the cluster's layout
with its nodes' addresses, for operators' tools that need no more),
``produce:TOPIC``, ``read:TOPIC`` (raw pings, consumer groups),
``heatmap:TOPIC`` (heat maps, still under give-to-get); TOPIC may be ``*``,
every topic. A self-registered identity's ``produce:*`` does not cover a
topic closed to open produce (``TopicSpec.no_open_produce``).

Tokens are ``rl_`` and 32 random bytes (URL-safe base64): 256 bits, so one
SHA-256 (``token_hash``) is the right way to keep them; the cluster stores
only that hash.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from roadlog.validation import check_topic_name

ADMIN = "admin"
OPS = "ops"  # the cluster's layout with addresses (issue 39)
# Scopes that stand alone (no TOPIC); never handed to a self-registered identity.
OPERATOR_SCOPES = (ADMIN, OPS)
PRODUCE, READ, HEATMAP = "produce", "read", "heatmap"
KINDS = (PRODUCE, READ, HEATMAP)
ANY_TOPIC = "*"
TOKEN_PREFIX = "rl_"
MAX_SCOPES = 64
MAX_NAME_BYTES = 64
PHONE_SCOPES = (f"{PRODUCE}:{ANY_TOPIC}", f"{HEATMAP}:{ANY_TOPIC}")


class ScopeError(ValueError):
    """A scope that is not one of the forms above."""


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_hash(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def check_scope(scope: str) -> str:
    """``scope`` if it is well formed; ScopeError saying why not."""
    if scope in OPERATOR_SCOPES:
        return scope
    kind, sep, topic = scope.partition(":")
    if not sep or kind not in KINDS:
        raise ScopeError(
            f"bad scope {scope!r}: admin, ops, or produce:TOPIC, read:TOPIC or heatmap:TOPIC "
            "(TOPIC or * for every topic)"
        )
    if topic != ANY_TOPIC:
        try:
            check_topic_name(topic)
        except ValueError as e:
            raise ScopeError(f"bad scope {scope!r}: {e}") from None
    return scope


def check_scopes(scopes: Iterable[str]) -> list[str]:
    """The scopes, checked, without repeats, in the order given."""
    out = list(dict.fromkeys(check_scope(s) for s in scopes))
    if not out:
        raise ScopeError("an identity needs at least one scope")
    if len(out) > MAX_SCOPES:
        raise ScopeError(f"at most {MAX_SCOPES} scopes")
    return out


def check_client_name(name: str) -> str:
    """A name is what a topic name may be (letters, digits, '.', '_', '-')."""
    if len(name.encode()) > MAX_NAME_BYTES:
        raise ValueError(f"bad client name {name!r}: at most {MAX_NAME_BYTES} bytes")
    try:
        check_topic_name(name)
    except ValueError as e:
        raise ValueError(str(e).replace("topic name", "client name")) from None
    return name


@dataclass(frozen=True, slots=True)
class Need:
    """What a call needs: a scope of ``kind`` for ``topic`` (``""``: for some
    topic, any of that kind), ``admin``, or only an identity
    (``kind == ""``)."""

    kind: str
    topic: str = ""

    def __str__(self) -> str:
        if not self.kind:
            return "an identity (any valid token)"
        if self.kind == ADMIN:
            return "scope admin"
        if not self.topic:
            return f"a {self.kind}:TOPIC scope"
        return f"scope {self.kind}:{self.topic}"


AUTHENTICATED = Need("")
NEEDS_ADMIN = Need(ADMIN)


def sees_addresses(scopes: Iterable[str]) -> bool:
    """Whether an identity with ``scopes`` is shown the nodes' addresses in
    the cluster's layout (``admin`` or ``ops``); others see roles and
    indexes only."""
    return any(s in OPERATOR_SCOPES for s in scopes)


def open_produce_covers(scopes: Iterable[str], topic: str) -> bool:
    """Whether a self-registered identity's ``scopes`` let it publish to a
    topic closed to open produce: only ``admin`` or ``produce:TOPIC`` by
    name, never ``produce:*``."""
    return any(s in (ADMIN, f"{PRODUCE}:{topic}") for s in scopes)


def allows(scopes: Iterable[str], need: Need) -> bool:
    """Whether ``scopes`` grant ``need`` (admin grants everything)."""
    if not need.kind:
        return True
    for s in scopes:
        if s == ADMIN:
            return True
        kind, _, topic = s.partition(":")
        if kind == need.kind and (not need.topic or topic in (ANY_TOPIC, need.topic)):
            return True
    return False
