"""The error every replica raises alike for an operation it refuses."""

from __future__ import annotations

import grpc


class OpError(Exception):
    """An operation refused deterministically (same on every replica)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
