"""The queue server's configuration: a TOML file, each key also a flag."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_daemon.config import ConfigError, check_address
from roadlog import configfile


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
        if min(self.max_writes, self.max_reads, self.default_timeout_ms) <= 0:
            raise ConfigError("max_writes, max_reads and default_timeout_ms must be positive")


def load_queue_config(path: Path | None, overrides: dict[str, Any]) -> QueueConfig:
    return configfile.load(QueueConfig, path, overrides, {"secret_file": Path})
