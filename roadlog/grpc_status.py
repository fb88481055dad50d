"""The gRPC edge of ``roadlog.errors``: ``Code`` to and from ``grpc.StatusCode``.

Used only where gRPC is spoken (the servicers and handlers of the node and
the queue server, the client SDK); everything inside speaks ``Code``.
"""

from __future__ import annotations

import grpc

from roadlog.errors import Code

_TO_GRPC: dict[Code, grpc.StatusCode] = {c: grpc.StatusCode[c.name] for c in Code}
_FROM_GRPC: dict[grpc.StatusCode, Code] = {sc: c for c, sc in _TO_GRPC.items()}


def to_grpc(code: Code) -> grpc.StatusCode:
    """The gRPC status of ``code`` (same name, same number)."""
    return _TO_GRPC[code]


def from_grpc(status: grpc.StatusCode | None) -> Code:
    """roadlog's code for a gRPC status (UNKNOWN for none)."""
    return _FROM_GRPC.get(status, Code.UNKNOWN) if status is not None else Code.UNKNOWN
