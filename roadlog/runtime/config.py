"""Daemon configuration: a TOML file whose keys are also flags (flags win),
the cluster secret, and the checks every daemon's config shares."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable
from dataclasses import MISSING, Field, field, fields
from pathlib import Path
from typing import Any, Protocol, TypeVar, get_type_hints

import click


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key."""


class _Config(Protocol):
    def validate(self) -> None: ...


C = TypeVar("C", bound=_Config)
F = TypeVar("F", bound=Callable[..., Any])


def key(default: Any = MISSING, help: str = "", *, factory: Callable[[], Any] | None = None) -> Any:
    """A config key, declared once: its default and what it means. The
    TOML key, the ``--flag`` (``config_flags``) and the docs come from it."""
    if not help:
        raise ValueError("every config key says what it means")
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def keys(cls: type) -> list[Field[Any]]:
    """The config keys of a config dataclass, in declaration order."""
    return list(fields(cls))


def config_flags(cls: type) -> Callable[[F], F]:
    """A ``--flag`` for every key of ``cls`` (``node_id`` -> ``--node-id``),
    with its help; a flag left out is None, so the file's value stands."""
    hints = get_type_hints(cls)

    def decorate(fn: F) -> F:
        for f in reversed(keys(cls)):
            flag = "--" + f.name.replace("_", "-")
            kind = hints[f.name]
            kw: dict[str, Any] = {"help": f.metadata["help"], "default": None}
            if kind is bool:
                decl = [f"{flag}/--no-{flag[2:]}"]
            elif kind is int:
                decl, kw["type"] = [flag], int
            elif kind in (Path, Path | None):
                decl, kw["type"] = [flag], click.Path(path_type=Path)
            else:  # str, and lists and tables given as text ("a,b")
                decl = [flag]
            fn = click.option(*decl, f.name, **kw)(fn)
        return fn

    return decorate


def check_address(addr: str, key: str) -> None:
    """``addr`` is HOST:PORT with a port in 1..65535, else ConfigError naming ``key``."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{key}: {addr!r} is not HOST:PORT")


MIN_SECRET_BYTES = 16
PLACEHOLDERS = (b"change-me", b"changeme", b"placeholder")


def check_secret(path: Path | None, what: str = "secret_file", private: int = 0o007) -> bytes:
    """A daemon starts only with a real cluster secret: a file that exists,
    is not open to others (``private``: the mode bits that must be clear;
    0o077 also closes it to the group), and holds a value ``check_secret_value``
    takes (a guessable secret would let anyone compute the cluster token).
    Returns the secret; ConfigError says which rule failed, named ``what``."""
    if path is None:
        raise ConfigError(f"{what}: required (the shared cluster secret)")
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise ConfigError(f"{what}: cannot read {path}: {e}") from None
    if mode & private:
        who, fix = (
            ("others", "chmod o-rwx") if private == 0o007 else ("the group or others", "chmod 600")
        )
        raise ConfigError(f"{what}: {path} is readable by {who} (mode {mode & 0o777:o}): {fix}")
    return check_secret_value(read_secret(path), what)


def check_secret_value(secret: bytes, what: str = "secret_file") -> bytes:
    """``secret`` if it is at least MIN_SECRET_BYTES long and not a
    placeholder, else ConfigError."""
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"{what}: the secret must be at least {MIN_SECRET_BYTES} bytes")
    if any(p in secret.lower() for p in PLACEHOLDERS):
        raise ConfigError(f"{what}: the secret is a placeholder; make a random one")
    return secret


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


PRIVATE_UMASK = 0o077


def private_files() -> None:
    """What a daemon creates from now on (LMDB files, snapshots, backups)
    is readable by its own user only: files 0600, directories 0700."""
    os.umask(PRIVATE_UMASK)
