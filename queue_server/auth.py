"""Who calls, and may they (issue 19: client identities with scopes).

Every client call, gRPC or HTTP, goes through ``Gate.admit``: the Bearer
token (gRPC metadata ``authorization``, HTTP ``Authorization``) names an
identity the cluster issued (``Authenticator``: its SHA-256 looked up by a
read any node answers, cached for a few seconds), and ``required`` says
what the call needs, from the rpc table's ``needs`` (``roadlog.rpc``) and
the topic the request names. One function for both APIs, so no route is
left unchecked; ``tests/unit/queue_server/test_client_auth.py`` checks every rpc and
every HTTP route has a rule.

No credential or an unknown one: UNAUTHENTICATED (HTTP 401). An identity
without the scope: PERMISSION_DENIED (403), saying which scope is missing.

Invariants: a revoked token stops working within ``POSITIVE_TTL_S`` on every
queue server (at once on the one that revoked it); the cache holds at most
``MAX_CACHED`` tokens' answers; concurrent calls with one uncached token
cause one lookup.
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from urllib.parse import unquote

from google.protobuf.message import DecodeError

from roadlog.errors import Code, RoadlogError
from roadlog.protowire import field_spans
from roadlog.rpc import ADMIN, BY_NAME, IDENTITY, PUBLIC
from roadlog.scopes import (
    AUTHENTICATED,
    KINDS,
    NEEDS_ADMIN,
    TOKEN_PREFIX,
    Need,
    allows,
    token_hash,
)
from roadlog.v1 import clients_pb2

log = logging.getLogger("roadlog.auth")

POSITIVE_TTL_S = 5.0  # a token's identity is believed this long (a revoke takes this long)
NEGATIVE_TTL_S = 1.0  # an unknown token is refused this long without asking again
MAX_CACHED = 100_000
MAX_TOKEN_BYTES = 128
HOW = (
    "send 'authorization: Bearer TOKEN' with a token the cluster issued (`roadlog client "
    "create`, or POST /v1/clients for a phone)"
)
NO_CREDENTIAL = "no credential: " + HOW


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated identity (``client_id`` "": nobody in particular,
    client_auth off)."""

    client_id: str
    name: str
    scopes: frozenset[str]
    # It registered itself (POST /v1/clients): its produce:* does not
    # cover a topic closed to open produce (the node checks that).
    registered: bool = False


# With client_auth = "none": everything allowed, client ids as declared.
UNCHECKED = Principal("", "", frozenset({ADMIN}))


@dataclass(frozen=True, slots=True)
class Caller:
    """What a call says about who makes it."""

    credential: str | None  # the authorization header's value, as sent
    source: str  # the caller's address (its host)
    declared: str = ""  # the client id it declares (the fairness lane without identities)


def bearer(credential: str | None) -> str:
    """The token of an ``authorization`` value; UNAUTHENTICATED if none or malformed."""
    if not credential:
        raise RoadlogError(Code.UNAUTHENTICATED, NO_CREDENTIAL)
    scheme, _, token = credential.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise RoadlogError(Code.UNAUTHENTICATED, "the authorization is not 'Bearer TOKEN': " + HOW)
    return token


# ------------------------------------------------------------ authorization

# The rpcs whose topic is read off the wire (their pings are not parsed for
# it); the others' requests are small and parsed whole. Where each request
# names its topic is the RPC table's (``Rpc.topic_field``).
_READ_RAW = frozenset({"Publish", "PublishBatch"})


def required(method: str, request: bytes) -> list[Need]:
    """What a call of ``method`` with ``request`` needs (empty: nothing)."""
    rpc = BY_NAME[method]
    if rpc.needs == PUBLIC:
        return []
    if rpc.needs == IDENTITY:
        return [AUTHENTICATED]
    if rpc.needs == ADMIN:
        return [NEEDS_ADMIN]
    topics = topics_of(method, request)
    if topics is None:
        # A request that names no topic: that kind for some topic. A group's
        # (``Rpc.group_topic``): the node checks its own topic, with the
        # scopes the work item carries (node_daemon/work/group_access.py).
        return [Need(rpc.needs)]
    return [Need(rpc.needs, t) for t in sorted(set(topics))]


def topics_of(method: str, request: bytes) -> list[str] | None:
    """The topics a request names (None: it names none)."""
    rpc = BY_NAME[method]
    path = rpc.topic_field
    if not path:
        return None
    try:
        if method in _READ_RAW:
            return _strings_at(request, path)
        (number,) = path
        field = rpc.request.DESCRIPTOR.fields_by_number[number].name
        return [str(getattr(rpc.request.FromString(request), field))]
    except (DecodeError, ValueError, UnicodeDecodeError):
        raise RoadlogError(Code.INVALID_ARGUMENT, f"malformed {method} request") from None


def authorize(principal: Principal, method: str, request: bytes) -> None:
    """PERMISSION_DENIED, naming the scope missing, unless ``principal`` may
    make this call. Cheap for the usual callers: an admin or a holder of
    ``KIND:*`` is not made to read the request."""
    rpc = BY_NAME[method]
    if ADMIN in principal.scopes or rpc.needs in (PUBLIC, IDENTITY):
        return
    if rpc.needs != ADMIN and f"{rpc.needs}:*" in principal.scopes:
        return
    for need in required(method, request):
        check_need(principal, need, method)


def route_need(needs: str, topic: str) -> Need | None:
    """What an HTTP route whose rpc ``needs`` that, on ``topic`` ("": it names
    none), needs (None: nothing beyond a token)."""
    if needs == ADMIN:
        return NEEDS_ADMIN
    if needs in (PUBLIC, IDENTITY) or needs not in KINDS:
        return None
    return Need(needs, topic)


def check_need(principal: Principal, need: Need, what: str) -> None:
    if not allows(principal.scopes, need):
        raise RoadlogError(
            Code.PERMISSION_DENIED, f"client {principal.name!r} needs {need} for {what}"
        )


def _fields(raw: bytes | memoryview, number: int) -> Iterator[memoryview]:
    """Every length-delimited value of field ``number`` at the top level of a
    message's wire bytes, in order (not copied)."""
    buf = memoryview(raw)
    for start, end in field_spans(buf, number):
        yield buf[start:end]


def _strings_at(raw: bytes | memoryview, path: tuple[int, ...]) -> list[str]:
    """The string at ``path`` (field numbers, ``Rpc.topic_field``) of a
    message's wire bytes: one, or one per message of each repeated message
    field on the way."""
    number, *rest = path
    if not rest:
        return [_last_string(raw, number)]
    return [s for sub in _fields(raw, number) for s in _strings_at(sub, tuple(rest))]


def _last_string(raw: bytes | memoryview, number: int) -> str:
    """A string field as a parser reads it: the last occurrence wins."""
    last = b""
    for v in _fields(raw, number):
        last = bytes(v)
    return last.decode()


# ----------------------------------------------------------- authentication

Lookup = Callable[[bytes, str], Awaitable[clients_pb2.AuthenticateResponse]]


class Authenticator:
    """Token -> Principal, by its SHA-256, through ``lookup`` (a read a node
    answers), with a bounded cache (see the module's doc)."""

    def __init__(
        self,
        lookup: Lookup,
        clock: Callable[[], float] = time.monotonic,
        positive_ttl_s: float = POSITIVE_TTL_S,
        negative_ttl_s: float = NEGATIVE_TTL_S,
        max_cached: int = MAX_CACHED,
    ) -> None:
        self.lookup = lookup
        self.clock = clock
        self.positive_ttl_s = positive_ttl_s
        self.negative_ttl_s = negative_ttl_s
        self.max_cached = max_cached
        self.cache: OrderedDict[bytes, tuple[float, Principal | None]] = OrderedDict()
        self._asking: dict[bytes, asyncio.Future[Principal | None]] = {}
        self.lookups = 0
        self.used = UsedReport()

    async def principal(self, credential: str | None, source: str = "") -> Principal:
        token = bearer(credential)
        if not token.startswith(TOKEN_PREFIX) or len(token) > MAX_TOKEN_BYTES:
            raise RoadlogError(Code.UNAUTHENTICATED, "not a roadlog token: " + HOW)
        h = token_hash(token)
        now = self.clock()
        hit = self.cache.get(h)
        if hit is not None and hit[0] > now:
            found = hit[1]
        else:
            found = await self._ask(h, source)
        if found is None:
            raise RoadlogError(Code.UNAUTHENTICATED, "unknown or revoked token: " + HOW)
        if found.registered:
            self.used.note(found.name)
        return found

    async def _ask(self, h: bytes, source: str) -> Principal | None:
        pending = self._asking.get(h)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[Principal | None] = asyncio.get_running_loop().create_future()
        self._asking[h] = fut
        try:
            self.lookups += 1
            resp = await self.lookup(h, source)
            found = (
                Principal(
                    resp.identity.client_id,
                    resp.identity.name,
                    frozenset(resp.identity.scopes),
                    resp.identity.registered,
                )
                if resp.found
                else None
            )
            ttl = self.positive_ttl_s if found is not None else self.negative_ttl_s
            self.cache[h] = (self.clock() + ttl, found)
            self.cache.move_to_end(h)
            while len(self.cache) > self.max_cached:
                self.cache.popitem(last=False)
            fut.set_result(found)
            return found
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: waiters re-raise it
            raise
        finally:
            del self._asking[h]

    def forget(self, name: str) -> None:
        """Drop what the cache holds of identity ``name`` (revoked here)."""
        for h in [h for h, (_, p) in self.cache.items() if p is not None and p.name == name]:
            del self.cache[h]


class UsedReport:
    """The self-registered identities this queue server saw used and has not
    told group 0's leader of yet (``ClientsUsed``), each told at most once a
    day (by this process's clock: the log records the log's day); at most
    ``max_names`` waiting, more are told the next day they are used."""

    def __init__(self, clock: Callable[[], float] = time.time, max_names: int = MAX_CACHED) -> None:
        self.clock = clock
        self.max_names = max_names
        self.day = -1
        self.told: set[str] = set()  # today's, told or waiting
        self.waiting: dict[str, None] = {}

    def note(self, name: str) -> None:
        day = int(self.clock() // 86_400)
        if day != self.day:
            self.day, self.told = day, set()
        if name in self.told or len(self.told) >= self.max_names:
            return
        self.told.add(name)
        self.waiting[name] = None

    def take(self, limit: int) -> list[str]:
        """Up to ``limit`` names waiting, no longer waiting."""
        out = list(itertools.islice(self.waiting, limit))
        for name in out:
            del self.waiting[name]
        return out

    def give_back(self, names: Iterable[str]) -> None:
        """Names whose telling failed: told again next time."""
        for name in names:
            self.waiting[name] = None


# ------------------------------------------------------------ who is where

V4_PREFIX = 24  # a registration's rate is counted per /24 (IPv4) ...
V6_PREFIX = 64  # ... and per /64 (IPv6): a host's or a subscriber's block


def peer_host(peer: str) -> str:
    """The host of a gRPC peer ("ipv4:10.1.2.3:5555", "ipv6:[::1]:5555",
    percent-encoded or not) or of an HTTP remote ("10.1.2.3"), plain:
    both APIs name a caller alike."""
    text = unquote(peer)
    for scheme in ("ipv4:", "ipv6:"):
        if text.startswith(scheme):
            text = text[len(scheme) :]
            if text.startswith("["):  # [v6]:port
                return text[1:].partition("]")[0]
            if scheme == "ipv4:":
                return text.rpartition(":")[0] or text
            return text  # a v6 address without brackets has no port here
    return text.strip("[]")


def rate_key(host: str) -> str:
    """What a per-source rate counts ``host`` under: its /24 (IPv4, an
    IPv4-mapped IPv6 address as its IPv4 one) or its /64 (IPv6); the host
    itself when it is no address."""
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    bits = V4_PREFIX if ip.version == 4 else V6_PREFIX
    return str(ipaddress.ip_network(f"{ip}/{bits}", strict=False))


class TrustedProxies:
    """Whose word on a caller's address is believed: a request from one of
    ``cidrs`` (a load balancer in front of the queue servers) is from the
    address its ``X-Forwarded-For`` names last that is not itself a trusted
    proxy; from anyone else the header is ignored (anyone could send it)."""

    def __init__(self, cidrs: Iterable[str] = ()) -> None:
        self.networks = [ipaddress.ip_network(c.strip(), strict=False) for c in cidrs]

    def _trusted(self, host: str) -> bool:
        try:
            ip = ipaddress.ip_address(host.split("%")[0])
        except ValueError:
            return False
        return any(ip in n for n in self.networks if n.version == ip.version)

    def client(self, host: str, forwarded_for: str | None) -> str:
        """The caller's address: ``host`` unless it is a trusted proxy that
        forwarded the request."""
        if not forwarded_for or not self.networks or not self._trusted(host):
            return host
        hops = [h.strip() for h in forwarded_for.split(",") if h.strip()]
        for hop in reversed(hops):
            hop = peer_host(hop)
            if not self._trusted(hop):
                return hop
        return peer_host(hops[0]) if hops else host


class RateLimited(RoadlogError):
    """RESOURCE_EXHAUSTED because a rate ran out: the HTTP API answers it
    429 with ``Retry-After`` (whole seconds, at least 1)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(Code.RESOURCE_EXHAUSTED, message)
        self.retry_after_s = retry_after_s


class RateLimit:
    """A token bucket per source: ``per_minute`` a minute, a burst of as
    many; at most ``max_sources`` sources remembered (the oldest forgotten
    first). ``retry_after`` says when the next would be taken."""

    def __init__(
        self,
        per_minute: int,
        clock: Callable[[], float] = time.monotonic,
        max_sources: int = 100_000,
    ) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.clock = clock
        self.max_sources = max_sources
        self.buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, source: str) -> bool:
        now = self.clock()
        level, at = self.buckets.pop(source, (self.capacity, now))
        level = min(self.capacity, level + (now - at) * self.rate)
        ok = level >= 1.0
        self.buckets[source] = (level - 1.0 if ok else level, now)
        while len(self.buckets) > self.max_sources:
            self.buckets.popitem(last=False)
        return ok

    def retry_after(self, source: str) -> float:
        """Seconds until ``source`` may take one again (0: now)."""
        level, at = self.buckets.get(source, (self.capacity, self.clock()))
        level = min(self.capacity, level + (self.clock() - at) * self.rate)
        return 0.0 if level >= 1.0 else (1.0 - level) / self.rate


class Gate:
    """Authentication and authorization of client calls (``enabled``
    False: client_auth = "none", every call admitted as ``UNCHECKED``)."""

    def __init__(self, authenticator: Authenticator, enabled: bool = True) -> None:
        self.auth = authenticator
        self.enabled = enabled

    async def admit(self, method: str, request: bytes, caller: Caller) -> Principal:
        if not self.enabled:
            return UNCHECKED
        if BY_NAME[method].needs == PUBLIC:
            if caller.credential:  # a token given anyway must be good
                return await self.auth.principal(caller.credential, caller.source)
            return UNCHECKED_PUBLIC
        principal = await self.auth.principal(caller.credential, caller.source)
        authorize(principal, method, request)
        return principal


# A public call without a credential: no identity, no scope.
UNCHECKED_PUBLIC = Principal("", "", frozenset())
