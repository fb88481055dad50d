"""The queue server's configuration: a TOML file, each key also a flag."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from node_daemon.config import ConfigError, check_address


@dataclass
class QueueConfig:
    cluster_name: str = "roadlog"
    listen: str = "0.0.0.0:7500"
    advertise_address: str = ""
    http_listen: str = ""  # the HTTP/JSON API arrives with the front-door issue
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
        if self.secret_file is None:
            return b""
        try:
            return self.secret_file.read_bytes().strip()
        except OSError as e:
            raise ConfigError(f"secret_file: cannot read {self.secret_file}: {e}") from None

    def validate(self) -> None:
        check_address(self.listen, "listen")
        if self.http_listen:
            check_address(self.http_listen, "http_listen")
        if min(self.max_writes, self.max_reads, self.default_timeout_ms) <= 0:
            raise ConfigError("max_writes, max_reads and default_timeout_ms must be positive")


def load_queue_config(path: Path | None, overrides: dict[str, Any]) -> QueueConfig:
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from None
    raw.update({k: v for k, v in overrides.items() if v is not None})
    known = {f.name for f in fields(QueueConfig)}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"unknown config keys: {', '.join(sorted(unknown))}")
    cfg = QueueConfig()
    for k, v in raw.items():
        if k == "secret_file":
            v = Path(v)
        elif isinstance(getattr(cfg, k), int) and not isinstance(v, int):
            try:
                v = int(v)
            except ValueError as e:
                raise ConfigError(f"{k}: {e}") from None
        setattr(cfg, k, v)
    cfg.validate()
    return cfg
