"""Asking the warm heat-map job server (spark/job_server.py) to build a
window: what ``roadlog heatmap build`` and the cron job do first, building
with a Spark of their own (as before) only when no server answers.

``python -m spark.job_client --server HOST:PORT --topic T --since-ms N``
(the cron job's): prints the summary and exits 0 when the server built the
map, exits ``NO_SERVER`` (75) when none answers or it refused the job
(the caller then builds), 1 when the server ran the job and it failed.
TLS and the token come from the environment (``ClientTLS.from_env``: the
cluster's CA, ``ROADLOG_TOKEN``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import ssl
import sys
import time
from typing import Any

from roadlog.client_tls import ClientTLS
from spark.job_server import JOBS_PATH, JobRequest

NO_SERVER = 75  # EX_TEMPFAIL
DEFAULT_SERVER = "127.0.0.1:9460"
PROBE_TIMEOUT_S = 3.0
JOB_TIMEOUT_S = 3600.0


class NoServer(Exception):
    """No job server answers at the address (nothing listens, the handshake
    failed, it does not answer its health check in time)."""


class JobRefused(Exception):
    """The server answered but did not build: ``status`` and its reason.
    401/503 (a token it does not take, a session down) leave the caller to
    build; others (the job failed) are the job's answer."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{status}: {reason}")
        self.status, self.reason = status, reason

    @property
    def build_instead(self) -> bool:
        return self.status in (401, 403, 503)


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{address!r}: HOST:PORT")
    return host.strip("[]"), int(port)


def _connection(address: str, tls: ClientTLS, timeout: float) -> http.client.HTTPConnection:
    host, port = _split(address)
    ctx = tls.ssl_context()
    if ctx is None:
        return http.client.HTTPConnection(host, port, timeout=timeout)
    return http.client.HTTPSConnection(host, port, timeout=timeout, context=ctx)


def _ask(
    address: str,
    tls: ClientTLS,
    method: str,
    path: str,
    timeout: float,
    body: bytes | None = None,
    token: str | None = None,
) -> tuple[int, dict[str, Any]]:
    conn = _connection(address, tls, timeout)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    try:
        doc = json.loads(raw) if raw else {}
    except ValueError:
        doc = {"error": raw[:200].decode(errors="replace")}
    return resp.status, doc


def submit(
    address: str,
    job: JobRequest,
    tls: ClientTLS,
    token: str | None,
    probe_timeout_s: float = PROBE_TIMEOUT_S,
    job_timeout_s: float = JOB_TIMEOUT_S,
) -> dict[str, Any]:
    """The summary of ``job`` built by the server at ``address``; NoServer
    when none answers its health check; JobRefused when it answered but
    did not build."""
    try:
        status, doc = _ask(address, tls, "GET", "/healthz", probe_timeout_s, token=token)
    except (OSError, http.client.HTTPException, ssl.SSLError) as e:  # refused, timeout, TLS
        raise NoServer(f"no heat-map job server at {address} ({e})") from None
    if status == 200 and not doc.get("ready", False):
        raise JobRefused(503, f"the server's Spark session is down ({doc})")
    try:
        status, doc = _ask(address, tls, "POST", JOBS_PATH, job_timeout_s, job.to_json(), token)
    except TimeoutError:
        raise JobRefused(504, f"no answer in {job_timeout_s:g} s") from None
    except (OSError, http.client.HTTPException) as e:
        raise NoServer(f"the job server at {address} went away ({e})") from None
    if status != 200:
        raise JobRefused(status, str(doc.get("error", doc)))
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default=DEFAULT_SERVER, help="the job server's HOST:PORT")
    ap.add_argument("--topic", required=True)
    ap.add_argument(
        "--since-ms", type=int, default=15 * 60_000, help="the window: the last this long"
    )
    args = ap.parse_args(argv)
    tls = ClientTLS.from_env()
    end = int(time.time() * 1000)
    job = JobRequest(args.topic, end - args.since_ms, end)
    try:
        summary = submit(args.server, job, tls, tls.token)
    except NoServer as e:
        print(f"heatmap {args.topic}: {e}; building without it", file=sys.stderr)
        return NO_SERVER
    except JobRefused as e:
        print(f"heatmap {args.topic}: the job server refused ({e})", file=sys.stderr)
        return NO_SERVER if e.build_instead else 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
