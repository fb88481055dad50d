"""Client identities (issue 19) without a cluster: every gRPC method and
every HTTP route of the client API has a rule, the rules ask for the scope
of the topic a request names (read off the wire as a parser reads it), the
token cache, the registration limit, and identities in the state machine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from node_daemon.raft import Entry, EntryType
from node_daemon.state.clients import MAX_CLIENTS
from node_daemon.state.machine import StateMachine
from queue_server.auth import (
    Authenticator,
    Caller,
    Gate,
    Principal,
    RateLimit,
    authorize,
    required,
)
from queue_server.config import QueueConfig
from queue_server.http_api import ROUTE_RULES, HttpApi
from queue_server.server import QueueServer
from roadlog.errors import Code, RoadlogError
from roadlog.rpc import BY_NAME, NEEDS, PUBLIC, RPCS
from roadlog.scopes import (
    PHONE_SCOPES,
    Need,
    ScopeError,
    allows,
    check_scopes,
    new_token,
    token_hash,
)
from roadlog.v1 import client_pb2, clients_pb2, command_pb2

pytestmark = pytest.mark.unit

SERVICE = client_pb2.DESCRIPTOR.services_by_name["Roadlog"]


def test_every_grpc_method_has_a_rule() -> None:
    for m in SERVICE.methods:
        rpc = BY_NAME[m.name]
        assert rpc.needs in NEEDS, m.name
        # A request that names a topic is checked against that topic, never
        # "any topic of the kind": its field must be known to the rules.
        fields = m.input_type.fields_by_name
        if rpc.needs in ("produce", "read", "heatmap") and "topic" in fields:
            assert rpc.topic_field == (fields["topic"].number,), m.name
    assert {r.name for r in RPCS if r.needs == PUBLIC} == {"RegisterClient"}


def test_every_http_route_has_a_rule() -> None:
    async def never(*_: object) -> bytes:
        raise AssertionError

    app = HttpApi(never, client_pb2.ClusterStatus).app()
    rpc_routes = {(r.http.method, r.http.path) for r in RPCS if r.http is not None}
    for route in app.router.routes():
        if route.method == "HEAD":
            continue
        path = route.resource.canonical if route.resource is not None else ""
        if (route.method, path) in rpc_routes:
            continue
        rule = ROUTE_RULES.get(path) or ROUTE_RULES.get(path + "/")
        assert rule is not None, f"{route.method} {path} has no rule in ROUTE_RULES"
        assert rule == PUBLIC or rule.removeprefix("rpc:") in BY_NAME, (path, rule)


def _publish(topic: str) -> bytes:
    return client_pb2.PublishRequest(topic=topic, client_id="c").SerializeToString()


def test_the_rules_name_the_topic_of_the_request() -> None:
    assert required("CreateTopic", b"") == [Need("admin")]
    assert required("ListTopics", b"") == [Need("")]
    assert required("Status", b"") == [Need("")]  # any identity (finding 15)
    assert required("Publish", _publish("berlin")) == [Need("produce", "berlin")]
    batch = client_pb2.PublishBatchRequest()
    for t in ("munich", "berlin", "munich"):
        batch.requests.add(topic=t)
    assert required("PublishBatch", batch.SerializeToString()) == [
        Need("produce", "berlin"),
        Need("produce", "munich"),
    ]
    fetch = client_pb2.FetchRequest(topic="munich").SerializeToString()
    assert required("Fetch", fetch) == [Need("read", "munich")]
    join = client_pb2.JoinGroupRequest(group="g", topic="munich").SerializeToString()
    assert required("JoinGroup", join) == [Need("read", "munich")]  # topic is field 2 there
    assert required("Heartbeat", b"") == [Need("read")]  # a group's: some read scope
    assert required("InitProducer", b"") == [Need("produce")]


def test_a_topic_sent_twice_is_checked_as_the_node_reads_it() -> None:
    """Protobuf keeps the last of a repeated singular field: so does the check."""
    sneaky = _publish("berlin") + _publish("munich")
    assert client_pb2.PublishRequest.FromString(sneaky).topic == "munich"
    van = Principal("cl-1", "van", frozenset({"produce:berlin"}))
    with pytest.raises(RoadlogError) as e:
        authorize(van, "Publish", sneaky)
    assert e.value.code == Code.PERMISSION_DENIED and "produce:munich" in e.value.message
    authorize(van, "Publish", _publish("berlin"))
    with pytest.raises(RoadlogError, match="malformed Publish"):
        authorize(van, "Publish", b"\x0a\x40abc")


def test_scopes() -> None:
    assert allows(["admin"], Need("read", "x"))
    assert allows(["read:*"], Need("read", "x")) and not allows(["read:*"], Need("produce", "x"))
    assert allows(["read:x"], Need("read")) and not allows(["read:y"], Need("read", "x"))
    assert not allows(["produce:*"], Need("admin"))
    assert check_scopes(["read:x", "read:x", "admin"]) == ["read:x", "admin"]
    for bad in ("", "write:x", "read:", "read:UPPER", "produce"):
        with pytest.raises(ScopeError):
            check_scopes([bad])
    with pytest.raises(ScopeError):
        check_scopes([])


def test_an_identity_without_the_scope_is_told_which_it_lacks() -> None:
    phone = Principal("cl-2", "phone", frozenset(PHONE_SCOPES))
    authorize(phone, "Publish", _publish("anywhere"))  # produce:*: the request is not read
    fetch = client_pb2.FetchRequest(topic="munich").SerializeToString()
    for method, req, missing in (
        ("Fetch", fetch, "scope read:munich"),
        ("CreateTopic", b"", "scope admin"),
        ("RevokeClient", b"", "scope admin"),
        ("Heartbeat", b"", "a read:TOPIC scope"),
    ):
        with pytest.raises(RoadlogError) as e:
            authorize(phone, method, req)
        assert e.value.code == Code.PERMISSION_DENIED and missing in e.value.message, method


class Lookups:
    def __init__(self) -> None:
        self.known: dict[bytes, clients_pb2.ClientIdentity] = {}
        self.asked = 0
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self, h: bytes, source: str) -> clients_pb2.AuthenticateResponse:
        self.asked += 1
        await self.release.wait()
        ident = self.known.get(h)
        if ident is None:
            return clients_pb2.AuthenticateResponse(found=False)
        return clients_pb2.AuthenticateResponse(found=True, identity=ident)


def test_the_token_cache_expires_dedupes_and_forgets() -> None:
    async def main() -> None:
        now = [0.0]
        lookups = Lookups()
        auth = Authenticator(lookups, clock=lambda: now[0], max_cached=2)
        token = new_token()
        lookups.known[token_hash(token)] = clients_pb2.ClientIdentity(
            name="van", client_id="cl-9", scopes=["read:*"]
        )
        lookups.release.clear()
        got = asyncio.gather(*(auth.principal(f"Bearer {token}") for _ in range(5)))
        await asyncio.sleep(0)
        lookups.release.set()
        assert {p.client_id for p in await got} == {"cl-9"} and lookups.asked == 1
        now[0] += 4.9
        await auth.principal(f"bearer {token}")  # cached; the scheme in any case
        assert lookups.asked == 1
        now[0] += 0.2
        await auth.principal(f"Bearer {token}")  # expired: asked again
        assert lookups.asked == 2
        del lookups.known[token_hash(token)]  # revoked elsewhere
        auth.forget("van")  # revoked here: at once
        with pytest.raises(RoadlogError) as e:
            await auth.principal(f"Bearer {token}")
        assert e.value.code == Code.UNAUTHENTICATED and "revoked" in e.value.message
        asked = lookups.asked
        with pytest.raises(RoadlogError):
            await auth.principal(f"Bearer {token}")  # a refusal is cached too
        assert lookups.asked == asked
        for bad in (None, "", "Basic abc", "Bearer", "Bearer not-ours"):
            with pytest.raises(RoadlogError) as e:
                await auth.principal(bad)
            assert e.value.code == Code.UNAUTHENTICATED
        assert lookups.asked == asked  # none of those was looked up
        for _ in range(3):
            with pytest.raises(RoadlogError):
                await auth.principal(f"Bearer {new_token()}")
        assert len(auth.cache) == 2  # bounded

    asyncio.run(main())


def test_registrations_are_limited_per_source() -> None:
    now = [0.0]
    limit = RateLimit(3, clock=lambda: now[0], max_sources=2)
    assert [limit.take("a") for _ in range(4)] == [True, True, True, False]
    assert limit.take("b")
    now[0] += 20.0  # a minute's third: one more
    assert limit.take("a") and not limit.take("a")
    limit.take("c")
    assert len(limit.buckets) == 2


def test_registration_off_and_client_auth_none() -> None:
    async def main() -> None:
        cfg = QueueConfig(open_registration=False, insecure=True)
        qs = QueueServer(cfg)
        with pytest.raises(RoadlogError) as e:
            await qs.client_call("RegisterClient", b"", 1.0, Caller(None, "10.0.0.9"))
        assert e.value.code == Code.PERMISSION_DENIED and "open_registration" in e.value.message
        open_gate = Gate(Authenticator(Lookups()), enabled=False)
        admitted = await open_gate.admit("CreateTopic", b"", Caller(None, "x"))
        assert "admin" in admitted.scopes and admitted.client_id == ""

    asyncio.run(main())


def _entry(index: int, *ops: command_pb2.Op, leader_ms: int = 1000) -> Entry:
    cmd = command_pb2.Command(leader_ms=leader_ms, ops=list(ops))
    return Entry(index=index, term=1, type=EntryType.NORMAL, data=cmd.SerializeToString())


def _create(name: str, token: str, scopes: list[str], registered: bool = False) -> command_pb2.Op:
    ident = clients_pb2.ClientIdentity(
        name=name, client_id=f"cl-{name}", scopes=scopes, registered=registered
    )
    op = command_pb2.CreateClientOp(identity=ident, token_hash=token_hash(token))
    return command_pb2.Op(create_client=op)


def test_identities_in_the_state_machine(tmp_path: Path) -> None:
    a, b = StateMachine(tmp_path / "a"), StateMachine(tmp_path / "b")
    t1, t2 = new_token(), new_token()
    revoke = command_pb2.Op(revoke_client=command_pb2.RevokeClientOp(name="van"))
    entries = [
        _entry(1, _create("van", t1, ["produce:berlin"])),
        _entry(2, _create("van", t2, ["read:*"])),  # the name is taken
        _entry(3, _create("cl-phone", t2, list(PHONE_SCOPES), registered=True)),
        _entry(4, _create("bad", new_token(), ["write:x"])),
    ]
    for sm in (a, b):
        results = sm.apply(entries)
        assert results[0][0].code == Code.OK
        assert results[1][0].code == Code.ALREADY_EXISTS
        assert results[2][0].code == Code.OK
        assert results[3][0].code == Code.INVALID_ARGUMENT
    found = a.identity(token_hash(t1))
    assert found is not None and found.name == "van" and found.created_ms == 1000
    listing = a.list_clients()
    assert [c.name for c in listing.clients] == ["van"] and listing.registered == 1
    assert a.digest() == b.digest()
    # The token is not stored: only its hash.
    assert t1.encode() not in (tmp_path / "a" / "data.mdb").read_bytes()
    for sm in (a, b):
        assert sm.apply([_entry(5, revoke)])[0][0].code == Code.OK
        assert sm.identity(token_hash(t1)) is None
        assert sm.apply([_entry(6, revoke)])[0][0].code == Code.NOT_FOUND
    assert a.digest() == b.digest()


def test_identities_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import node_daemon.state.clients as clients

    monkeypatch.setattr(clients, "MAX_CLIENTS", 2)
    sm = StateMachine(tmp_path / "s")
    res = sm.apply([_entry(i + 1, _create(f"c{i}", new_token(), ["read:*"])) for i in range(3)])
    assert [r[0].code for r in res] == [Code.OK, Code.OK, Code.RESOURCE_EXHAUSTED]
    assert "revoke some" in res[2][0].message
    assert MAX_CLIENTS >= 1000  # the real bound


def test_a_bound_producer_id_takes_only_its_identitys_appends(tmp_path: Path) -> None:
    from node_daemon.state.machine import append_op
    from tests.integration.conftest import make_pings

    sm = StateMachine(tmp_path / "s")
    spec = client_pb2.CreateTopicRequest().spec
    spec.name = "munich"
    from roadlog.geo import bbox_region

    spec.region_geojson = bbox_region(11.4, 48.05, 11.75, 48.25).geojson
    spec.partitions = 1
    init = command_pb2.InitProducerOp(client_id="cl-a", producer_id=77, bound=True)
    sm.apply(
        [
            _entry(1, command_pb2.Op(create_topic=command_pb2.CreateTopicOp(spec=spec))),
            _entry(2, command_pb2.Op(init_producer=init)),
        ]
    )
    cols = make_pings("x", 0, 3)
    theirs = append_op("munich", [(0, cols)], producer_id=77, sequence=0, client_id="cl-b")
    ours = append_op("munich", [(0, cols)], producer_id=77, sequence=0, client_id="cl-a")
    (r,) = sm.apply([_entry(3, theirs)])
    assert r[0].spans[0].code == Code.PERMISSION_DENIED
    (r,) = sm.apply([_entry(4, ours)])
    assert r[0].spans[0].code == Code.OK
