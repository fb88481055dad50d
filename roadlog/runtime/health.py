"""The ops HTTP endpoint every daemon serves on its metrics port.

- `/metrics`: Prometheus exposition (prometheus-client's default registry),
  with `roadlog_ready` (1 while `/readyz` would answer 200) set at each scrape.
- `/healthz`: liveness; 200 while the process serves requests.
- `/readyz`: readiness; 200 when `ready()` says so, else 503. The body is
  the JSON detail `ready()` returns (role, term, leader, indexes, ...), so
  systemd smoke checks, Ansible and load balancers read one document.

Runs in a daemon thread (wsgiref, threaded), so a busy event loop never
makes health checks time out; `ready()` must therefore only read plain
attributes (no awaits, no locks held by the loop).

Bounded: at most ``max_connections`` requests are served at once (one
thread each; a connection over the bound is closed at once), a connection
that sends nothing for ``idle_timeout_s`` (a half-sent request) is dropped,
and none lasts more than ``deadline_s`` (a byte now and then does not keep
it), so no client can pile up threads on a daemon or hold its slots.

HTTPS when the daemon runs with TLS (``ssl_context``: the daemon's
certificate, no client certificate asked; Prometheus and the health checks
trust the cluster's CA): the handshake runs in the connection's own thread,
under the same idle timeout and deadline, so a caller that never finishes
it holds one slot for at most ``deadline_s``. A plaintext request on an
HTTPS port fails in the handshake and is answered nothing.

Who may read it (``metrics_auth``, issue 39 item 6: the port tells topic
names, roles, terms and indexes): ``none``, anyone who reaches it (the
default, as before); ``token``, a caller that sends ``Authorization:
Bearer TOKEN`` with the token of ``metrics_token_file`` (compared in
constant time), else 401 with ``WWW-Authenticate: Bearer``; ``tls``, a
caller that presented a client certificate the cluster's CA signed (the
handshake asks for one and checks it; one the CA did not sign fails the
handshake), else 403. Every path is behind it, /healthz and /readyz too.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import socket
import ssl
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from socketserver import TCPServer, ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, Gauge, make_wsgi_app

from roadlog.runtime.config import check_metrics_auth, check_secret

Readiness = Callable[[], tuple[bool, dict[str, Any]]]
StartResponse = Callable[[str, list[tuple[str, str]]], Any]


CLIENT_CERT_ENV = "roadlog.client_certificate"  # the handler's note: one was presented


@dataclass(frozen=True, slots=True)
class MetricsAuth:
    """Who may read the port (see the module's doc)."""

    mode: str = "none"
    token: bytes = b""

    def refusal(self, environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], str] | None:
        """(status, headers, why) refusing this request; None: it may."""
        if self.mode == "token":
            scheme, _, given = str(environ.get("HTTP_AUTHORIZATION", "")).strip().partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(
                given.strip().encode(), self.token
            ):
                return None
            why = "send 'Authorization: Bearer TOKEN' with the token of metrics_token_file"
            return "401 Unauthorized", [("WWW-Authenticate", 'Bearer realm="metrics"')], why
        if self.mode == "tls" and not environ.get(CLIENT_CERT_ENV):
            return "403 Forbidden", [], "present a client certificate the cluster's CA signed"
        return None


NO_AUTH = MetricsAuth()


def metrics_auth(mode: str, token_file: Path | None, insecure: bool) -> MetricsAuth:
    """The ``metrics_auth`` of a daemon's configuration; ConfigError (one
    line) for an unknown mode, a token file missing, open to others or weak,
    or ``tls`` without TLS."""
    check_metrics_auth(mode, token_file, insecure)
    if mode == "token":
        return MetricsAuth(mode, check_secret(token_file, "metrics_token_file"))
    return MetricsAuth(mode)


def metrics_ssl(security: Any, auth: MetricsAuth) -> ssl.SSLContext | None:
    """The metrics port's TLS context from the process's ``tls.Security``:
    its certificate, and with ``tls`` a client certificate asked for and
    checked against the cluster's CA (a fresh context: the shared ones are
    left as they are); None when it runs insecure."""
    if auth.mode != "tls" or security.creds is None:
        ctx: ssl.SSLContext | None = security.server_ssl(mutual=False)
        return ctx
    ctx = security.creds.server_ssl(True)
    ctx.verify_mode = ssl.CERT_OPTIONAL  # none presented: answered 403, not a failed handshake
    return ctx


READY = Gauge("roadlog_ready", "1 while the process is ready (/readyz answers 200), else 0")

MAX_CONNECTIONS = 32
IDLE_TIMEOUT_S = 5.0
DEADLINE_S = 15.0


class BoundedConnections(ThreadingMixIn, TCPServer):
    """A thread per connection, at most ``max_connections`` of them (one
    over the bound is closed at once, no thread made); a failed TLS
    handshake or a peer gone away is not logged as an error. Mixed in
    first, before the server class it bounds."""

    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False
    max_connections = MAX_CONNECTIONS

    def server_activate(self) -> None:
        super().server_activate()
        self._slots = threading.BoundedSemaphore(self.max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # over the bound: closed, no thread
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A failed TLS handshake (a plaintext caller, a client that does
        not trust the CA) or a peer gone away is not worth a traceback."""
        import sys

        if isinstance(sys.exc_info()[1], OSError):  # ssl.SSLError is an OSError
            return
        super().handle_error(request, client_address)


class _BoundedWSGIServer(BoundedConnections, WSGIServer):
    """The health and metrics endpoint's server."""

    ssl_context: ssl.SSLContext | None = None


class _QuietHandler(WSGIRequestHandler):
    timeout = IDLE_TIMEOUT_S  # the socket's: a connection idle this long is dropped
    deadline_s = DEADLINE_S  # a connection is cut this long after it was accepted

    def setup(self) -> None:
        self._deadline = threading.Timer(self.deadline_s, self._cut)
        self._deadline.daemon = True
        self._deadline.start()
        ctx = getattr(self.server, "ssl_context", None)
        if ctx is not None:  # the handshake here, in this connection's thread
            self.request.settimeout(self.timeout)
            try:
                self.request = ctx.wrap_socket(self.request, server_side=True)
            except OSError:
                self._deadline.cancel()
                with contextlib.suppress(OSError):
                    self.request.close()
                raise
        super().setup()

    def _cut(self) -> None:
        with contextlib.suppress(OSError):
            self.request.shutdown(socket.SHUT_RDWR)

    def finish(self) -> None:
        self._deadline.cancel()
        try:
            super().finish()
        finally:
            if isinstance(self.request, ssl.SSLSocket):  # the server closes the plain one
                with contextlib.suppress(OSError):
                    self.request.close()

    def get_environ(self) -> dict[str, str]:
        env = super().get_environ()
        if isinstance(self.request, ssl.SSLSocket) and self.request.getpeercert():
            env[CLIENT_CERT_ENV] = "1"  # verified against the CA in the handshake
        return env

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds are not worth a log line."""


def health_app(
    ready: Readiness, registry: CollectorRegistry | None = None, auth: MetricsAuth = NO_AUTH
) -> Callable[[dict[str, Any], StartResponse], Iterable[bytes]]:
    """``registry``: what /metrics shows (default prometheus-client's);
    ``auth``: who may see anything (``MetricsAuth``)."""
    metrics = make_wsgi_app(registry if registry is not None else REGISTRY)

    def readiness() -> tuple[bool, dict[str, Any]]:
        try:
            ok, detail = ready()
        except Exception as e:  # a health check must answer, not crash
            ok, detail = False, {"error": str(e)}
        READY.set(int(ok))
        return ok, detail

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        refused = auth.refusal(environ)
        if refused is not None:
            status, headers, why = refused
            data = json.dumps({"error": why}).encode()
            start_response(
                status,
                [
                    *headers,
                    ("Content-Type", "application/json"),
                    ("Content-Length", str(len(data))),
                ],
            )
            return [data]
        path = environ.get("PATH_INFO", "/")
        if path in ("/healthz", "/readyz"):
            ok, detail = readiness()
            if path == "/healthz":
                status, body = "200 OK", {"live": True, "ready": ok, **detail}
            else:
                status = "200 OK" if ok else "503 Service Unavailable"
                body = {"ready": ok, **detail}
            data = json.dumps(body).encode()
            start_response(
                status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))]
            )
            return [data]
        readiness()  # roadlog_ready as of this scrape
        result: Iterable[bytes] = metrics(environ, start_response)
        return result

    return app


def serve_metrics_and_health(
    host: str,
    port: int,
    ready: Readiness,
    max_connections: int = MAX_CONNECTIONS,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
    deadline_s: float = DEADLINE_S,
    ssl_context: ssl.SSLContext | None = None,
    registry: CollectorRegistry | None = None,
    auth: MetricsAuth = NO_AUTH,
) -> WSGIServer:
    """Start the endpoint in a daemon thread; returns the server (its
    `server_port` is the bound port, useful with port 0). ``ssl_context``:
    HTTPS with it (a daemon's ``metrics_ssl``); None: plaintext (a daemon
    run ``insecure``). ``auth``: who may read it."""
    server_class = type(
        "BoundedWSGIServer",
        (_BoundedWSGIServer,),
        {"max_connections": max_connections, "ssl_context": ssl_context},
    )
    handler_class = type(
        "Handler", (_QuietHandler,), {"timeout": idle_timeout_s, "deadline_s": deadline_s}
    )
    server: WSGIServer = make_server(
        host or "0.0.0.0",
        port,
        health_app(ready, registry, auth),
        server_class=server_class,
        handler_class=handler_class,
    )
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
