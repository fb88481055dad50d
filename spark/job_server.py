"""The warm heat-map job server (``roadlog heatmap serve``): one long-lived
Spark session that builds heat maps on request, so that a small window
does not pay a JVM's start and a session's planning warm-up each time.

HTTP, HTTPS when the server runs with TLS (its certificate of the
cluster's CA; callers trust that CA):

- ``POST /jobs``: a JSON body ``{"topic", "window_start_ms",
  "window_end_ms"[, "history_ms"]}``; the answer is the job's summary (as
  ``heatmap build --json`` prints it). Only with ``Authorization: Bearer
  TOKEN``, the heat-map job identity's issued token the server itself
  commits with (compared in constant time): else 401, and nothing runs.
- ``GET /healthz`` (200 while the session lives), ``GET /readyz`` (200 or
  503) and ``GET /metrics`` (Prometheus): behind ``metrics_auth`` as every
  daemon's ops port (roadlog.runtime.health.MetricsAuth).

Invariants: one job at a time (a second waits for the first: one Spark
session, and a cluster's windows are few); at most ``max_connections``
connections at once, one thread each, a request read within
``read_timeout_s``; a body over ``MAX_BODY`` is refused unread.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from roadlog.client import RoadlogError
from roadlog.runtime.health import NO_AUTH, BoundedConnections, MetricsAuth

log = logging.getLogger("roadlog.heatmap.serve")

MAX_BODY = 64 * 1024
JOBS_PATH = "/jobs"


@dataclass(frozen=True, slots=True)
class JobRequest:
    """One window of one topic to build."""

    topic: str
    window_start_ms: int
    window_end_ms: int
    history_ms: int | None = None

    @classmethod
    def parse(cls, body: bytes) -> JobRequest:
        """ValueError (one line) for a body that is not such a job."""
        try:
            doc = json.loads(body)
        except ValueError:
            raise ValueError("the body is not JSON") from None
        if not isinstance(doc, dict):
            raise ValueError("the body is not a JSON object")
        topic = doc.get("topic")
        if not isinstance(topic, str) or not topic:
            raise ValueError("topic: a non-empty string")
        ints = {}
        for name in ("window_start_ms", "window_end_ms", "history_ms"):
            v = doc.get(name)
            if v is None and name == "history_ms":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name}: a non-negative integer")
            ints[name] = v
        if ints["window_end_ms"] <= ints["window_start_ms"]:
            raise ValueError("window_end_ms must come after window_start_ms")
        return cls(topic, **ints)

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {
            "topic": self.topic,
            "window_start_ms": self.window_start_ms,
            "window_end_ms": self.window_end_ms,
        }
        if self.history_ms is not None:
            doc["history_ms"] = self.history_ms
        return json.dumps(doc).encode()


class ServerMetrics:
    """The server's Prometheus metrics."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.jobs = Counter(
            "roadlog_heatmap_server_jobs",
            "Jobs run, by topic and outcome",
            ["topic", "outcome"],
            registry=registry,
        )
        self.refused = Counter(
            "roadlog_heatmap_server_refused",
            "Requests refused unrun, by reason",
            ["reason"],
            registry=registry,
        )
        self.seconds = Histogram(
            "roadlog_heatmap_server_job_seconds",
            "A job's seconds, asked to answered",
            buckets=(0.5, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 300, 600),
            registry=registry,
        )
        self.busy = Gauge("roadlog_heatmap_server_busy", "1 while a job runs", registry=registry)


Build = Callable[[JobRequest], dict[str, Any]]
Ready = Callable[[], tuple[bool, dict[str, Any]]]


class JobServer(BoundedConnections, ThreadingHTTPServer):
    """The server (``serve_forever`` runs it; ``server_port`` is the bound
    port). ``build`` runs one job with the warm session; ``ready`` says
    whether that session lives."""

    def __init__(
        self,
        address: tuple[str, int],
        *,
        build: Build,
        ready: Ready,
        token: str,
        ssl_context: ssl.SSLContext | None,
        metrics_auth: MetricsAuth = NO_AUTH,
        registry: CollectorRegistry | None = None,
        max_connections: int = 16,
        read_timeout_s: float = 10.0,
    ) -> None:
        if not token:
            raise ValueError("the job server needs the heat-map identity's token")
        self.build, self.ready = build, ready
        self.token = token.encode()
        self.ssl_context = ssl_context
        self.metrics_auth = metrics_auth
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = ServerMetrics(self.registry)
        self.job_lock = threading.Lock()
        self.max_connections = max_connections  # the bound (BoundedConnections)
        self.read_timeout_s = read_timeout_s
        super().__init__(address, _Handler)

    def run_job(self, job: JobRequest) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of one job, run under the job lock."""
        t0 = time.monotonic()
        with self.job_lock:
            self.metrics.busy.set(1)
            try:
                summary = self.build(job)
            except RoadlogError as e:  # an unknown topic, the cluster unavailable
                self.metrics.jobs.labels(job.topic, "error").inc()
                log.warning("heat map of %s: %s", job.topic, e)
                return 422, {"error": str(e)}
            except Exception as e:
                self.metrics.jobs.labels(job.topic, "error").inc()
                log.exception("heat map of %s failed", job.topic)
                return 500, {"error": f"{type(e).__name__}: {e}"}
            finally:
                self.metrics.busy.set(0)
        took = time.monotonic() - t0
        self.metrics.jobs.labels(job.topic, "ok").inc()
        self.metrics.seconds.observe(took)
        log.info("heat map of %s: %s cells in %.1f s", job.topic, summary.get("cells"), took)
        return 200, {**summary, "server_seconds": round(took, 2)}


class _Handler(BaseHTTPRequestHandler):
    server: JobServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        self.request.settimeout(self.server.read_timeout_s)
        ctx = self.server.ssl_context
        if ctx is not None:  # the handshake here, in this connection's thread
            try:
                self.request = ctx.wrap_socket(self.request, server_side=True)
            except OSError:
                with contextlib.suppress(OSError):
                    self.request.close()
                raise
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes and health checks are not worth a log line."""

    def _answer(
        self,
        status: int,
        body: bytes,
        ctype: str = "application/json",
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        self.send_response(status)
        for k, v in headers or []:
            self.send_header(k, v)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, doc: dict[str, Any], **kw: Any) -> None:
        self._answer(status, json.dumps(doc).encode(), **kw)

    def do_GET(self) -> None:
        refused = self.server.metrics_auth.refusal(
            {"HTTP_AUTHORIZATION": self.headers.get("Authorization", "")}
        )
        if refused is not None:
            status, headers, why = refused
            self._json(int(status.split()[0]), {"error": why}, headers=headers)
            return
        if self.path in ("/healthz", "/readyz"):
            try:
                ok, detail = self.server.ready()
            except Exception as e:  # a health check answers, it does not crash
                ok, detail = False, {"error": str(e)}
            busy = self.server.job_lock.locked()
            if self.path == "/healthz":
                self._json(200, {"live": True, "ready": ok, "busy": busy, **detail})
            else:
                self._json(200 if ok else 503, {"ready": ok, "busy": busy, **detail})
        elif self.path == "/metrics":
            self._answer(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
        else:
            self._json(404, {"error": f"no {self.path}: GET /healthz, /readyz, /metrics"})

    def do_POST(self) -> None:
        srv = self.server
        if self.path != JOBS_PATH:
            self._json(404, {"error": f"no {self.path}: POST {JOBS_PATH}"})
            return
        scheme, _, given = self.headers.get("Authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            srv.metrics.refused.labels("no_token").inc()
            self._json(
                401,
                {"error": "send 'Authorization: Bearer TOKEN' with the heat-map identity's token"},
                headers=[("WWW-Authenticate", "Bearer")],
            )
            return
        if not hmac.compare_digest(given.strip().encode(), srv.token):
            srv.metrics.refused.labels("wrong_token").inc()
            self._json(
                401,
                {"error": "not the heat-map identity's token"},
                headers=[("WWW-Authenticate", "Bearer")],
            )
            return
        try:
            length = int(self.headers.get("Content-Length", "-1"))
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY:
            srv.metrics.refused.labels("bad_request").inc()
            self._json(
                413 if length > MAX_BODY else 411,
                {"error": f"a body of at most {MAX_BODY} bytes, with its Content-Length"},
            )
            return
        try:
            job = JobRequest.parse(self.rfile.read(length))
        except ValueError as e:
            srv.metrics.refused.labels("bad_request").inc()
            self._json(400, {"error": str(e)})
            return
        self.request.settimeout(None)  # the job takes what it takes; the answer follows
        status, doc = srv.run_job(job)
        self._json(status, doc)
