"""roadlog's one error type: its codes are gRPC's by name and number, the
edges map them both ways, and the SDK's names are that one class."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

import roadlog.client
from queue_server.http_api import HTTP_STATUS
from roadlog import errors
from roadlog.errors import Code, RoadlogError, error
from roadlog.grpc_status import from_grpc, to_grpc

pytestmark = pytest.mark.unit


def test_codes_are_grpcs_by_name_and_number() -> None:
    assert [(c.name, c.value) for c in Code] == [(sc.name, sc.value[0]) for sc in grpc.StatusCode]


@pytest.mark.parametrize("sc", list(grpc.StatusCode))
def test_the_grpc_edge_maps_both_ways(sc: grpc.StatusCode) -> None:
    assert to_grpc(from_grpc(sc)) is sc
    assert from_grpc(sc).value == sc.value[0]


def test_a_client_sends_again_what_the_server_could_not_take_or_cancelled() -> None:
    """A CANCELLED a client receives is the server going away (a server that
    stops cancels every call it holds): sent again, as UNAVAILABLE is."""
    assert Code.CANCELLED in roadlog.client.RETRYABLE


def test_an_unknown_wire_number_is_unknown() -> None:
    assert Code.of(5) is Code.NOT_FOUND
    assert Code.of(99) is Code.UNKNOWN
    assert Code.of(-1) is Code.UNKNOWN
    assert from_grpc(None) is Code.UNKNOWN


def test_the_error_carries_code_and_message() -> None:
    e = RoadlogError(Code.NOT_FOUND, "no topic 'x'")
    assert (e.code, e.message, e.reason) == (Code.NOT_FOUND, "no topic 'x'", "no topic 'x'")
    assert str(e) == "NOT_FOUND: no topic 'x'"


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (Code.NOT_FOUND, errors.NotFound),
        (Code.INVALID_ARGUMENT, errors.InvalidArgument),
        (Code.UNAVAILABLE, errors.Unavailable),
        (Code.DEADLINE_EXCEEDED, errors.Unavailable),
        (Code.PERMISSION_DENIED, errors.PermissionDenied),
        (Code.FAILED_PRECONDITION, errors.FailedPrecondition),
        (Code.ALREADY_EXISTS, errors.AlreadyExists),
        (Code.INTERNAL, RoadlogError),
        (Code.OUT_OF_RANGE, RoadlogError),
    ],
)
def test_error_picks_the_subclass_that_names_the_code(code: Code, cls: type[RoadlogError]) -> None:
    e = error(code, "why")
    assert type(e) is cls and e.code is code and e.message == "why"
    assert isinstance(e, RoadlogError)


def test_the_sdk_names_are_the_one_error() -> None:
    assert roadlog.client.RoadlogError is RoadlogError
    for name in (
        "NotFound",
        "InvalidArgument",
        "Unavailable",
        "PermissionDenied",
        "FailedPrecondition",
        "AlreadyExists",
    ):
        assert getattr(roadlog.client, name) is getattr(errors, name)
    with pytest.raises(roadlog.client.NotFound):
        raise error(Code.NOT_FOUND, "gone")


def test_http_statuses_are_keyed_by_roadlogs_codes() -> None:
    assert all(isinstance(c, Code) for c in HTTP_STATUS)
    assert HTTP_STATUS[Code.NOT_FOUND] == 404
    assert HTTP_STATUS[Code.INVALID_ARGUMENT] == 400
    assert HTTP_STATUS[Code.UNAVAILABLE] == 503


def test_the_shared_layer_imports_no_grpc_or_aiohttp() -> None:
    code = (
        "import sys, roadlog.errors, roadlog.rpc; "
        "print(sorted(m for m in ('grpc', 'aiohttp') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
