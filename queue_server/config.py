"""The queue server's configuration: a TOML file, each key also a flag."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from queue_server.queues import MAX_QUEUED_BYTES
from roadlog.limits import CLIENT_MESSAGE_BYTES
from roadlog.runtime import config as configfile
from roadlog.runtime.config import ConfigError, check_address, key

# OpenStreetMap's tiles (deployments that reach the internet; see its tile usage policy).
DEFAULT_TILE_URL = "https://tile.openstreetmap.org/{z}/{x}/{y}.png"
CLIENT_AUTH_MODES = ("token", "none")


@dataclass
class QueueConfig:
    """Every key of a queue server's TOML file, each also a flag of ``roadlog-queue run``."""

    cluster_name: str = key("roadlog", "the cluster's name")
    listen: str = key("0.0.0.0:7500", "HOST:PORT of the gRPC API (clients and nodes)")
    advertise_address: str = key("", "HOST:PORT clients and nodes reach it at (default: listen)")
    http_listen: str = key("", "HOST:PORT of the HTTP/JSON API and the dashboard (empty: none)")
    dashboard_tile_url: str = key(
        DEFAULT_TILE_URL,
        "the dashboard's street map tiles, a {z}/{x}/{y} URL (empty: a plain background)",
    )
    # Nodes pull work over a lean framed link on this port of the listen
    # host (roadlog/runtime/frames.py) where they can; else over gRPC Pull.
    work_frames_port: int = key(
        7501, "TCP port of the framed Work link for nodes (0: any free port, -1: off)"
    )
    # Clients publish over a lean framed link on this port of the listen host
    # (roadlog/publish_link.py) where they can; the PublishStream offers it.
    publish_link_port: int = key(
        7502, "TCP port of the framed publish link for clients (0: any free port, -1: off)"
    )
    secret_file: Path | None = key(None, "the file holding the shared cluster secret")
    # TLS on every port (roadlog/runtime/tls.py): ca.crt, queue.crt, queue.key
    # (made by `roadlog ca create-queue`; the key 0600). Clients check the
    # queue server's certificate; nodes pull work over the framed Work link
    # in mutual TLS (a client port cannot ask callers for certificates).
    certs_dir: Path | None = key(None, "directory of ca.crt, queue.crt and queue.key (TLS)")
    insecure: bool = key(False, "no TLS: plaintext, unauthenticated ports (debugging only)")
    # Client identities (issue 19): every client call carries a Bearer token
    # the cluster issued (`roadlog client create`, POST /v1/clients), checked
    # against its scopes. "none": no check at all (loudly logged).
    client_auth: str = key("token", "token: clients need a Bearer token; none: no check at all")
    open_registration: bool = key(
        True, "POST /v1/clients issues phone identities (produce:*, heatmap:*) to anyone"
    )
    # Counted per /24 (IPv4) or /64 (IPv6), over HTTP and gRPC alike: a
    # carrier's NAT puts thousands of phones behind a few addresses, but a
    # phone registers once, when its app is installed.
    registrations_per_minute: int = key(
        30,
        "self-registrations allowed per /24 (IPv4) or /64 (IPv6) and minute (a burst of as many)",
    )
    # Self-registered identities unused for the cluster setting
    # registration_idle_days are forgotten (issue 39): this server tells
    # group 0's leader which it saw used, each at most once a day.
    clients_used_report_s: float = key(
        60.0, "how often the identities seen used are told to the leader (seconds)"
    )
    # Load balancers in front of the queue servers: a request from one of
    # these is from the address its X-Forwarded-For (HTTP header, gRPC
    # metadata) names last that is not itself one of them.
    trusted_proxies: list[str] = key(
        help="CIDRs,... of proxies whose X-Forwarded-For is believed", factory=list
    )
    # Every HTTP request body has a total deadline and a minimum rate, and a
    # cap on bodies read at once (issue 39, finding 4; queue_server/http_api.py).
    http_body_timeout_s: float = key(30.0, "an HTTP request body is whole within this, or 408")
    http_body_min_rate: int = key(
        1024, "bytes a second an HTTP request body must keep up (judged after 5 s), or 408"
    )
    http_bodies_per_source: int = key(
        64, "HTTP request bodies read at once from one address, more get 429"
    )
    http_bodies_per_identity: int = key(
        8, "HTTP request bodies read at once for one identity, more get 429"
    )
    # gRPC server reflection on the client port lists every service to
    # anyone who reaches it (issue 19, finding 15): off unless debugging.
    grpc_reflection: bool = key(False, "answer gRPC server reflection on the client port")
    metrics_port: int = key(9500, "port of Prometheus /metrics, /healthz and /readyz")
    # Metrics tell topics, rates and roles to whoever reaches them (issue 19,
    # finding 15): bind them to the management network's address.
    metrics_host: str = key("", "address the metrics port binds (empty: listen's host)")
    # Who may read the metrics port (roadlog/runtime/health.py; issue 39).
    metrics_auth: str = key(
        "none",
        "who may read /metrics, /healthz, /readyz: none (anyone), token (a bearer token, "
        "metrics_token_file) or tls (a client certificate the cluster's CA signed)",
    )
    metrics_token_file: Path | None = key(
        None, "the file holding the metrics port's bearer token (metrics_auth = token)"
    )
    max_writes: int = key(10_000, "queued write requests before RESOURCE_EXHAUSTED")
    max_reads: int = key(10_000, "queued read requests before RESOURCE_EXHAUSTED")
    max_queued_bytes: int = key(
        MAX_QUEUED_BYTES, "bytes of requests each queue holds (a client: a quarter)"
    )
    default_timeout_ms: int = key(30_000, "deadline for clients that set none, in ms")
    # Announce this queue server to the nodes by discovery HELLOs (so they
    # pull from it without a list).
    discovery_port: int = key(7499, "announce to nodes on this UDP port (0: no)")
    discovery_broadcast: str = key("255.255.255.255", "where announcements are broadcast")
    discovery_seeds: list[str] = key(help="HOST:PORT,... to announce to by unicast", factory=list)
    log_level: str = key("info", "debug, info, warning or error")
    # Federation (issue 43, docs/federation.md): a member cluster's queue
    # servers register with the directory (its cluster_name is its name
    # there), report their load, and name a topic's home when asked about
    # one this cluster does not hold.
    directory_servers: list[str] = key(
        help="the directory's queue servers HOST:PORT,... (empty: not a federation member)",
        factory=list,
    )
    directory_ca_file: Path | None = key(
        None, "the CA the directory's certificates are checked against (default: this CA)"
    )
    directory_token_file: Path | None = key(
        None, "the file holding the token this server registers and reports with"
    )
    cluster_tags: list[str] = key(help="key=value,... tags of this member cluster", factory=list)
    directory_report_s: float = key(5.0, "how often the load is reported (seconds)")
    http_advertise: str = key(
        "", "the HTTP API's base URL told to the federation (default: from http_listen)"
    )

    @property
    def address(self) -> str:
        return self.advertise_address or self.listen

    def secret(self) -> bytes:
        return configfile.read_secret(self.secret_file)

    def validate(self) -> None:
        configfile.check_metrics_auth(self.metrics_auth, self.metrics_token_file, self.insecure)
        check_address(self.listen, "listen")
        if self.http_listen:
            check_address(self.http_listen, "http_listen")
        if self.dashboard_tile_url and not (
            self.dashboard_tile_url.startswith(("http://", "https://", "/"))
            and all(f"{{{v}}}" in self.dashboard_tile_url for v in "xyz")
        ):
            raise ConfigError(
                "dashboard_tile_url: an http(s) URL (or a path) with {z}, {x} and {y}, or empty"
            )
        for seed in self.discovery_seeds:
            check_address(seed, "discovery_seeds")
        if not -1 <= self.work_frames_port <= 65535:
            raise ConfigError("work_frames_port: must be in -1..65535 (-1: off, 0: any)")
        if self.work_frames_port == -1 and not self.insecure:
            raise ConfigError(
                "work_frames_port: with TLS nodes pull work only over the framed Work link "
                "(mutual TLS); give it a port (0: any)"
            )
        if not -1 <= self.publish_link_port <= 65535:
            raise ConfigError("publish_link_port: must be in -1..65535 (-1: off, 0: any)")
        if self.client_auth not in CLIENT_AUTH_MODES:
            raise ConfigError(
                f"client_auth: one of {', '.join(CLIENT_AUTH_MODES)}, not {self.client_auth!r}"
            )
        if self.http_body_timeout_s <= 0 or self.http_body_min_rate < 0:
            raise ConfigError("http_body_timeout_s: positive; http_body_min_rate: not negative")
        if min(self.http_bodies_per_source, self.http_bodies_per_identity) <= 0:
            raise ConfigError("http_bodies_per_source, http_bodies_per_identity: positive")
        for cidr in self.trusted_proxies:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ConfigError(
                    f"trusted_proxies: {cidr!r} is no CIDR (10.0.0.0/8, ::1/128)"
                ) from None
        for addr in self.directory_servers:
            check_address(addr, "directory_servers")
        if self.directory_servers and self.directory_report_s <= 0:
            raise ConfigError("directory_report_s must be positive")
        if self.clients_used_report_s <= 0:
            raise ConfigError("clients_used_report_s must be positive")
        if self.registrations_per_minute <= 0:
            raise ConfigError("registrations_per_minute must be positive")
        if min(self.max_writes, self.max_reads, self.default_timeout_ms) <= 0:
            raise ConfigError("max_writes, max_reads and default_timeout_ms must be positive")
        if self.max_queued_bytes < CLIENT_MESSAGE_BYTES:
            raise ConfigError(
                f"max_queued_bytes: at least {CLIENT_MESSAGE_BYTES} (one request of the "
                "largest size a client may send)"
            )


def _list(v: Any) -> list[str]:
    return [s for s in v.split(",") if s] if isinstance(v, str) else list(v)


def load_queue_config(path: Path | None, overrides: dict[str, Any]) -> QueueConfig:
    return configfile.load(
        QueueConfig,
        path,
        overrides,
        {
            "secret_file": Path,
            "certs_dir": Path,
            "metrics_token_file": Path,
            "directory_ca_file": Path,
            "directory_token_file": Path,
            "directory_servers": _list,
            "cluster_tags": _list,
            "discovery_seeds": _list,
            "trusted_proxies": _list,
        },
    )
