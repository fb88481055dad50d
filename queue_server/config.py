"""The queue server's configuration: a TOML file, each key also a flag."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from roadlog.runtime import config as configfile
from roadlog.runtime.config import ConfigError, check_address


@dataclass
class QueueConfig:
    cluster_name: str = "roadlog"
    listen: str = "0.0.0.0:7500"
    advertise_address: str = ""
    http_listen: str = ""  # HOST:PORT of the HTTP/JSON API; empty: none
    secret_file: Path | None = None
    metrics_port: int = 9500
    max_writes: int = 10_000  # queued write requests before RESOURCE_EXHAUSTED
    max_reads: int = 10_000
    default_timeout_ms: int = 30_000  # for clients that set no deadline
    # Announce this queue server to the nodes by discovery HELLOs (so they
    # pull from it without a list). 0: no announcements.
    discovery_port: int = 7499
    discovery_broadcast: str = "255.255.255.255"
    discovery_seeds: list[str] = field(default_factory=list)
    log_level: str = "info"

    @property
    def address(self) -> str:
        return self.advertise_address or self.listen

    def secret(self) -> bytes:
        return configfile.read_secret(self.secret_file)

    def validate(self) -> None:
        check_address(self.listen, "listen")
        if self.http_listen:
            check_address(self.http_listen, "http_listen")
        for seed in self.discovery_seeds:
            check_address(seed, "discovery_seeds")
        if min(self.max_writes, self.max_reads, self.default_timeout_ms) <= 0:
            raise ConfigError("max_writes, max_reads and default_timeout_ms must be positive")


def _list(v: Any) -> list[str]:
    return [s for s in v.split(",") if s] if isinstance(v, str) else list(v)


def load_queue_config(path: Path | None, overrides: dict[str, Any]) -> QueueConfig:
    return configfile.load(
        QueueConfig,
        path,
        overrides,
        {"secret_file": Path, "discovery_seeds": _list},
    )
