"""roadlog's one error: a status ``Code`` and a message.

Everything that refuses a request raises ``RoadlogError``: the replicated
state machine (alike on every replica), the leader's appends, the node's
worker, the queue server, and the client SDK that hands the server's answer
to its caller. ``Code`` is roadlog's own status enum; its names and numbers
are gRPC's, because the work protocol carries the number
(``WorkResult.code``) and the client API answers with gRPC statuses. This
module imports nothing of grpc or aiohttp: the mapping to ``grpc.StatusCode``
(``roadlog.grpc_status``) and to HTTP statuses (``queue_server.http_api``)
lives at the edges only.

The SDK's names (``roadlog.client.NotFound``, ``InvalidArgument``, ...) are
the subclasses below; ``error(code, message)`` makes the one that fits.
"""

from __future__ import annotations

from enum import IntEnum


class Code(IntEnum):
    """A request's outcome: the gRPC status codes, by name and number."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16

    @classmethod
    def of(cls, value: int) -> Code:
        """The code a wire number stands for; UNKNOWN for a number we do not know."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNKNOWN


class RoadlogError(Exception):
    """A request failed with ``code``; ``message`` (also ``reason``) says why.

    ``str(e)`` is ``"CODE: message"``, what the CLI shows."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @property
    def reason(self) -> str:
        """The message (the SDK's older name for it)."""
        return self.message


class NotFound(RoadlogError):
    """No such topic, partition, group or heat map."""


class InvalidArgument(RoadlogError):
    """The request is malformed or invalid."""


class Unavailable(RoadlogError):
    """No answer before the deadline: no leader, no majority, or no server."""


class PermissionDenied(RoadlogError):
    """Give-to-get: heat maps are for clients that contributed pings lately."""


class FailedPrecondition(RoadlogError):
    """The request no longer fits the state (a stale group generation, say)."""


class AlreadyExists(RoadlogError):
    """A topic of that name exists already."""


class Throttled(RoadlogError):
    """RESOURCE_EXHAUSTED because a rate ran out (the cluster's ceiling on
    registrations, say): try again after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(Code.RESOURCE_EXHAUSTED, message)
        self.retry_after_s = retry_after_s


_BY_CODE: dict[Code, type[RoadlogError]] = {
    Code.NOT_FOUND: NotFound,
    Code.INVALID_ARGUMENT: InvalidArgument,
    Code.UNAVAILABLE: Unavailable,
    Code.DEADLINE_EXCEEDED: Unavailable,
    Code.PERMISSION_DENIED: PermissionDenied,
    Code.FAILED_PRECONDITION: FailedPrecondition,
    Code.ALREADY_EXISTS: AlreadyExists,
}


def error(code: Code, message: str) -> RoadlogError:
    """The error for ``code``: the subclass that names it, else RoadlogError."""
    return _BY_CODE.get(code, RoadlogError)(code, message)
