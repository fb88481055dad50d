"""The SDK does not retry a quota refusal: RESOURCE_EXHAUSTED whose
message names a quota is raised at once with that message (the message says
what frees it), while an overloaded server's RESOURCE_EXHAUSTED is still
tried again."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from roadlog.client import Connection
from roadlog.errors import Code, RoadlogError, Unavailable
from roadlog.v1 import client_pb2

pytestmark = pytest.mark.unit


class Refusal(grpc.RpcError):
    def __init__(self, details: str, code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED):
        self._details = details
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def calls_until_raised(
    details: str, timeout: float, code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED
) -> tuple[int, RoadlogError]:
    conn = Connection(["127.0.0.1:1"])  # never dialled: the call is replaced
    calls = 0

    def refuse(*_: Any, **__: Any) -> bytes:
        nonlocal calls
        calls += 1
        raise Refusal(details, code)

    conn._method = lambda _method: refuse  # type: ignore[assignment,method-assign,return-value]
    req = client_pb2.JoinGroupRequest(group="g", topic="munich")
    try:
        with pytest.raises(RoadlogError) as err:
            conn.call("JoinGroup", req, timeout=timeout)
    finally:
        conn.close()
    return calls, err.value


def test_a_quota_refusal_is_raised_at_once_with_its_message() -> None:
    message = "group quota: this identity has created 100 consumer groups, the most one may"
    calls, err = calls_until_raised(message, timeout=5)
    assert calls == 1
    assert err.code == Code.RESOURCE_EXHAUSTED and err.message == message


def test_an_overloaded_server_is_still_tried_again() -> None:
    calls, err = calls_until_raised("queue full: 10000 writes waiting", timeout=0.6)
    assert calls > 1
    assert isinstance(err, Unavailable) and "queue full" in err.message


def test_a_call_the_server_cancels_is_tried_again() -> None:
    """A server that stops cancels the calls it holds: to the client that is
    the server going away (UNAVAILABLE), tried again, never a final CANCELLED."""
    calls, err = calls_until_raised("Cancelling all calls", 0.6, grpc.StatusCode.CANCELLED)
    assert calls > 1
    assert isinstance(err, Unavailable) and err.code == Code.UNAVAILABLE


def test_a_refusal_that_is_not_retryable_is_raised_at_once() -> None:
    calls, err = calls_until_raised("bad topic", 5, grpc.StatusCode.INVALID_ARGUMENT)
    assert calls == 1 and err.code == Code.INVALID_ARGUMENT
