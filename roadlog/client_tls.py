"""How a client dials a cluster: TLS that trusts the cluster's CA (and, for
calls to nodes, presents a client certificate), or plaintext for a cluster
run with ``--insecure``.

The SDK's default is ``ClientTLS.from_env()``: ``ROADLOG_CA_FILE`` (the
cluster's CA; unset: the system's roots), ``ROADLOG_CERT_FILE`` and
``ROADLOG_KEY_FILE`` (a client certificate, needed only where a node is
called directly), ``ROADLOG_INSECURE=1`` (plaintext), and
``ROADLOG_TOKEN``: the client identity's token (issue 19), sent with every
call as ``authorization: Bearer TOKEN``. A local cluster's directory holds
all of these (``roadlog --cluster DIR``: its admin token too).
"""

from __future__ import annotations

import collections
import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc


@dataclass(frozen=True)
class ClientTLS:
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    insecure: bool = False
    token: str | None = None  # the Bearer token of a client identity (None: none)

    @classmethod
    def from_env(cls) -> ClientTLS:
        token = os.environ.get("ROADLOG_TOKEN") or None
        if os.environ.get("ROADLOG_INSECURE", "") not in ("", "0"):
            return cls(insecure=True, token=token)

        def path(name: str) -> Path | None:
            v = os.environ.get(name)
            return Path(v) if v else None

        return cls(
            path("ROADLOG_CA_FILE"),
            path("ROADLOG_CERT_FILE"),
            path("ROADLOG_KEY_FILE"),
            token=token,
        )

    def with_token(self, token: str | None) -> ClientTLS:
        """The same, with ``token`` (None: this one's) as the identity's token."""
        return self if token is None else replace(self, token=token)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC metadata that carries the token where the channel does not:
        a TLS channel's credentials carry it (``credentials``), a plaintext
        one's cannot (gRPC sends call credentials only inside TLS)."""
        return (("authorization", f"Bearer {self.token}"),) if self.token and self.insecure else ()

    def headers(self) -> dict[str, str]:
        """HTTP headers that carry the token."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    @property
    def scheme(self) -> str:
        """The HTTP scheme of a cluster dialled this way."""
        return "http" if self.insecure else "https"

    def _read(self, p: Path | None) -> bytes | None:
        if p is None:
            return None
        try:
            return p.read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read {p}: {e.strerror}") from None

    def credentials(self, with_token: bool = True) -> grpc.ChannelCredentials | None:
        """gRPC channel credentials (None: plaintext); ``with_token``: every
        call on the channel carries the token (``authorization: Bearer``)."""
        if self.insecure:
            return None
        cert, key = self._read(self.cert_file), self._read(self.key_file)
        if (cert is None) != (key is None):
            raise ValueError("a client certificate needs both its certificate and its key file")
        creds = grpc.ssl_channel_credentials(self._read(self.ca_file), key, cert)
        if self.token and with_token:
            return grpc.composite_channel_credentials(
                creds, grpc.access_token_call_credentials(self.token)
            )
        return creds

    def channel(
        self, target: str, options: Sequence[tuple[str, Any]] | None = None
    ) -> grpc.Channel:
        """A blocking channel. Over TLS its calls carry the token from an
        interceptor, not from call credentials: those run a Python callback
        on a thread of gRPC's for every call, and closing the channel while
        one runs can deadlock on the GIL (grpc/grpc#42247; seen here as a
        status poll's ``with channel:`` that never returned)."""
        creds = self.credentials(with_token=False)
        if creds is None:
            return grpc.insecure_channel(target, options=options)
        ch = grpc.secure_channel(target, creds, options=options)
        if self.token:
            return grpc.intercept_channel(ch, _BearerToken(self.token))
        return ch

    def aio_channel(
        self, target: str, options: Sequence[tuple[str, Any]] | None = None
    ) -> grpc.aio.Channel:
        creds = self.credentials()
        if creds is None:
            return grpc.aio.insecure_channel(target, options=options)
        return grpc.aio.secure_channel(target, creds, options=options)

    def ssl_context(self) -> ssl.SSLContext | None:
        """For HTTPS (None: plaintext): trusts the cluster's CA (else the system's)."""
        if self.insecure:
            return None
        ctx = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        if self.cert_file is not None and self.key_file is not None:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer TOKEN`` to every call of a blocking
    channel (what ``access_token_call_credentials`` does, in the caller's
    thread)."""

    def __init__(self, token: str) -> None:
        self._pair = ("authorization", f"Bearer {token}")

    def _details(self, d: Any) -> _CallDetails:
        metadata = [*(d.metadata or ()), self._pair]
        return _CallDetails(
            d.method,
            d.timeout,
            metadata,
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, d: Any, request: Any) -> Any:
        return continuation(self._details(d), request)

    def intercept_unary_stream(self, continuation: Any, d: Any, request: Any) -> Any:
        return continuation(self._details(d), request)

    def intercept_stream_unary(self, continuation: Any, d: Any, requests: Any) -> Any:
        return continuation(self._details(d), requests)

    def intercept_stream_stream(self, continuation: Any, d: Any, requests: Any) -> Any:
        return continuation(self._details(d), requests)
