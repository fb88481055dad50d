"""The error a queue server answers a client request with."""

from __future__ import annotations

import grpc


class Failed(Exception):
    """The request failed with ``code``; ``message`` says why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
