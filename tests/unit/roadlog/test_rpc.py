"""The RPC surface declared once (roadlog.rpc): the table agrees with the
proto's service, its wire facts (where a request names its topic, where a
publish's group hint is) with the messages' descriptors, and the queue
server, the node's worker, the HTTP routes and the OpenAPI document are
made from it."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest
from google.protobuf.descriptor import FieldDescriptor

from node_daemon.work.handler import WorkHandler
from queue_server.client_front import client_handler
from queue_server.http_api import HttpApi
from queue_server.openapi import OPENAPI
from roadlog.errors import Code
from roadlog.rpc import (
    BY_NAME,
    FENCE_FIELD,
    INTERNAL,
    QUEUED,
    ROUTED,
    RPCS,
    SERVICE,
    Kind,
    Rpc,
)
from roadlog.v1 import client_pb2, work_pb2

pytestmark = pytest.mark.unit

SERVICE_DESCRIPTOR = client_pb2.DESCRIPTOR.services_by_name["Roadlog"]


def test_the_table_is_the_protos_service() -> None:
    assert SERVICE_DESCRIPTOR.full_name == SERVICE
    methods = SERVICE_DESCRIPTOR.methods_by_name
    assert [r.name for r in RPCS] == [m.name for m in SERVICE_DESCRIPTOR.methods]
    for r in RPCS:
        m = methods[r.name]
        assert r.request.DESCRIPTOR.full_name == m.input_type.full_name, r.name
        assert r.response.DESCRIPTOR.full_name == m.output_type.full_name, r.name
        assert not m.client_streaming and not m.server_streaming, r.name


def test_kinds_and_fences() -> None:
    # Answered by the queue server itself: Status, and ReadFences (a ReadIndex per group).
    assert {r.name for r in RPCS if r.kind is None} == {"Status", "ReadFences"}
    assert {r.name for r in RPCS if r.fenced} == {
        "Fetch",
        "DescribeTopic",
        "ListTopics",
        "DescribeGroup",
        "GetHeatmap",
        "ListClients",
        "LookupTopic",
        "GetFederation",
        "ExportTopicState",
    }
    # Only reads wait for a fence; every write is the leader's.
    assert all(r.kind == Kind.READ for r in RPCS if r.fenced)
    assert {r.name for r in RPCS if r.kind == Kind.READ} == {
        "Fetch",
        "DescribeTopic",
        "ListTopics",
        "DescribeGroup",
        "ListGroups",
        "GetHeatmap",
        "ListClients",
        "LookupTopic",
        "GetFederation",
        "ExportTopicState",
    }
    assert set(QUEUED) == set(BY_NAME) - {"Status", "ReadFences"}


def test_each_rows_wire_facts_are_its_requests_fields() -> None:
    """Every row's topic field is a path of field numbers down to a string
    named topic (through message fields), and its group hint a uint32 named
    group; each request that names a topic says where."""
    for r in (*RPCS, *INTERNAL.values()):
        msg = r.request.DESCRIPTOR
        for number in r.topic_field[:-1]:
            f = msg.fields_by_number[number]
            assert f.type == FieldDescriptor.TYPE_MESSAGE and f.message_type, r.name
            msg = f.message_type
        if r.topic_field:
            f = msg.fields_by_number[r.topic_field[-1]]
            assert (f.name, f.type) == ("topic", FieldDescriptor.TYPE_STRING), r.name
        if r.group_hint_field:
            f = r.request.DESCRIPTOR.fields_by_number[r.group_hint_field]
            assert (f.name, f.type) == ("group", FieldDescriptor.TYPE_UINT32), r.name
    for r in RPCS:
        topic = r.request.DESCRIPTOR.fields_by_name.get("topic")
        if topic is not None:
            assert r.topic_field == (topic.number,), r.name


def test_the_wire_facts_are_pinned_a_renumbered_field_fails_here() -> None:
    """Deployed SDKs write the group hint, and the queue server reads topics
    and hints off the wire: renumbering one of these fields breaks them, so
    the numbers are written out here once more."""
    facts = {r.name: (r.topic_field, r.group_hint_field) for r in RPCS}
    assert {name: f for name, f in facts.items() if f != ((), 0)} == {
        "Publish": ((1,), 7),
        "PublishBatch": ((1, 1), 2),
        "Fetch": ((1,), 0),
        "ReadFences": ((1,), 0),
        "JoinGroup": ((2,), 0),
        "GetHeatmap": ((1,), 0),
        "PlaceTopic": ((1,), 0),
        "ForgetTopicHome": ((1,), 0),
        "LookupTopic": ((1,), 0),
        "FenceTopic": ((1,), 0),
        "ExportTopicState": ((1,), 0),
        "ImportTopic": ((1,), 0),
        "MoveTopicHome": ((1,), 0),
    }
    assert all((r.topic_field, r.group_hint_field) == ((), 0) for r in INTERNAL.values())
    # The views the SDK and the HTTP API write publishes with (their batch
    # left as bytes) share those numbers.
    views = [
        (client_pb2.PublishRequest.DESCRIPTOR, client_pb2.PublishRequestView.DESCRIPTOR),
        (client_pb2.PublishBatchRequest.DESCRIPTOR, client_pb2.PublishBatchRequestView.DESCRIPTOR),
    ]
    for msg, view in views:
        for f in msg.fields:
            assert view.fields_by_name[f.name].number == f.number, (msg.name, f.name)


def test_fenced_is_read_from_the_request() -> None:
    r = Rpc("X", Kind.READ, client_pb2.FetchRequest, client_pb2.FetchResponse, "read")
    assert r.fenced and FENCE_FIELD in client_pb2.FetchRequest.DESCRIPTOR.fields_by_name
    w = Rpc("Y", Kind.WRITE, client_pb2.PublishRequest, client_pb2.PublishResponse, "produce")
    assert not w.fenced


@pytest.mark.parametrize(
    ("name", "handler"),
    [
        ("Publish", "publish"),
        ("PublishBatch", "publish_batch"),
        ("GetHeatmap", "get_heatmap"),
        ("CommitOffsets", "commit_offsets"),
        ("Status", "status"),
    ],
)
def test_handler_names(name: str, handler: str) -> None:
    assert BY_NAME[name].handler == handler


def test_the_worker_has_a_handler_for_every_queued_rpc() -> None:
    for r in ROUTED.values():  # the queue server's own reads too
        fn = getattr(WorkHandler, r.handler, None)
        assert fn is not None and inspect.iscoroutinefunction(fn), r.name


def test_the_worker_refuses_a_method_not_in_the_table() -> None:
    ex = WorkHandler.__new__(WorkHandler)  # dispatch needs no node for an unknown method
    res = asyncio.run(ex.run(work_pb2.WorkItem(id=7, method="Status")))
    assert (res.id, res.code) == (7, Code.UNIMPLEMENTED) and "no method Status" in res.message


def test_the_queue_server_serves_every_rpc() -> None:
    handler: Any = client_handler(None)  # type: ignore[arg-type]
    for r in RPCS:
        assert handler.service(_Details(f"/{SERVICE}/{r.name}")) is not None, r.name
    assert handler.service(_Details(f"/{SERVICE}/Nope")) is None


class _Details:
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


def test_http_routes_are_the_tables() -> None:
    api = HttpApi(None, None)  # type: ignore[arg-type]
    routes = {
        (route.method, route.resource.canonical)
        for route in api.app().router.routes()
        if route.resource is not None and route.method != "HEAD"
    }
    table = {(r.http.method, r.http.path) for r in RPCS if r.http is not None}
    dashboard = {("GET", p) for p in ("/", "/ui", "/ui/", "/ui/static")} | {
        ("GET", f"/ui/api/{name}") for name in ("config", "identity", "cluster", "heatmap")
    }
    assert routes == table | {("GET", "/openapi.json"), ("GET", "/healthz")} | dashboard


def test_the_openapi_document_has_every_http_rpc_and_its_fence() -> None:
    documented = {
        (verb.upper(), path, op["operationId"])
        for path, ops in OPENAPI["paths"].items()
        for verb, op in ops.items()
    }
    assert documented == {(r.http.method, r.http.path, r.name) for r in RPCS if r.http}
    for r in RPCS:
        if r.http is None:
            continue
        op = OPENAPI["paths"][r.http.path][r.http.method.lower()]
        names = [p["name"] for p in op.get("parameters", [])]
        assert (FENCE_FIELD in names) == r.fenced, r.name
        for piece in r.http.path.split("/"):
            if piece.startswith("{"):
                assert piece.strip("{}") in names, (r.name, piece)
