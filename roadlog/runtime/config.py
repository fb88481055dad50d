"""Daemon configuration: a TOML file whose keys are also flags (flags win),
the cluster secret, and the checks every daemon's config shares."""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any, Protocol, TypeVar


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key."""


class _Config(Protocol):
    def validate(self) -> None: ...


C = TypeVar("C", bound=_Config)


def check_address(addr: str, key: str) -> None:
    """``addr`` is HOST:PORT with a port in 1..65535, else ConfigError naming ``key``."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{key}: {addr!r} is not HOST:PORT")


def read_secret(path: Path | None) -> bytes:
    """The cluster secret (empty when no file is configured)."""
    if path is None:
        return b""
    try:
        return path.read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"secret_file: cannot read {path}: {e}") from None


def load(
    cls: Callable[[], C],
    path: Path | None,
    overrides: dict[str, Any],
    converters: dict[str, Callable[[Any], Any]] | None = None,
    validate: bool = True,
) -> C:
    """``cls()`` with the file's keys, then the flags that were given, set on
    it (ints coerced, ``converters`` applied); unknown keys are an error."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from None
    raw.update({k: v for k, v in overrides.items() if v is not None})
    cfg = cls()
    known = {f.name for f in fields(cfg)}  # type: ignore[arg-type]
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"unknown config keys: {', '.join(sorted(unknown))}")
    conv = converters or {}
    for k, v in raw.items():
        try:
            if k in conv:
                v = conv[k](v)
            elif isinstance(getattr(cfg, k), int) and not isinstance(v, int):
                v = int(v)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{k}: {e}") from None
        setattr(cfg, k, v)
    if validate:
        cfg.validate()
    return cfg
