"""Daemon configuration: a TOML file whose keys are also flags (flags win),
the cluster secret, and the checks every daemon's config shares."""

from __future__ import annotations

import grp
import math
import os
import shlex
import sys
import tomllib
from collections.abc import Callable
from dataclasses import MISSING, Field, field, fields
from pathlib import Path
from typing import Any, NoReturn, Protocol, TypeVar, get_type_hints

import click

from roadlog.runtime.config_types import typed


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
            elif kind is float:
                decl, kw["type"] = [flag], float
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


# The cluster secret: at least 32 bytes, as `roadlog cluster up` and the
# docs make it (`openssl rand -hex 32`: 64 hex characters, 256 bits; 32 hex
# characters are the least, 128 bits). The token every daemon sends is
# HMAC(secret, cluster name), so a short secret could be found offline from
# one captured token.
MIN_SECRET_BYTES = 32
PLACEHOLDERS = (b"change-me", b"changeme", b"placeholder")
MAKE_SECRET = "openssl rand -hex 32"


def check_secret(
    path: Path | None,
    what: str = "secret_file",
    private: int = 0o027,
    minimum: int = MIN_SECRET_BYTES,
) -> bytes:
    """A daemon starts only with a real cluster secret: a file that exists,
    belongs to root or to this process's user, is open to nobody else, and
    holds a value ``check_secret_value`` takes (a guessable secret would let
    anyone compute the cluster token). ``private`` are the mode bits that
    must be clear: by default any access by others and group write; the
    group may read only when the file's group is this process's own group
    (the role deploys it 0640 root:roadlog, the daemons run as roadlog).
    0o077 closes it to every group. Returns the secret; ConfigError is one
    line naming ``what``, the file, the rule it fails and the fix."""
    if path is None:
        raise ConfigError(
            f"{what}: not set; point it at a file holding the cluster secret "
            f"(make one: (umask 077; {MAKE_SECRET} > FILE))"
        )
    try:
        st = path.stat()
    except OSError as e:
        raise ConfigError(
            f"{what} {path}: cannot read it ({e.strerror}); "
            f"fix: (umask 077; {MAKE_SECRET} > {_q(path)})"
        ) from None
    problem = _exposure(st, path, private)
    if problem:
        raise ConfigError(f"{what} {path}: {problem}")
    return check_secret_value(read_secret(path), what, minimum, path)


def _q(path: Path) -> str:
    return shlex.quote(str(path))


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _exposure(st: os.stat_result, path: Path, private: int) -> str:
    """What is wrong with who may read or change a secret file, with the fix
    ("" when nothing is)."""
    mode = st.st_mode & 0o777
    me = os.geteuid()
    if st.st_uid not in (0, me):
        return (
            f"owned by uid {st.st_uid}, neither root nor this process's user (uid {me}), "
            f"who could change it; fix: chown root {_q(path)}"
        )
    bad = mode & private
    if bad and private & 0o040:  # closed to every group
        return f"open to the group or others (mode {mode:03o}); fix: chmod 600 {_q(path)}"
    if bad:
        what = " and ".join(
            w for w, bits in (("open to others", 0o007), ("writable by the group", 0o070))
            if bad & bits
        )  # fmt: skip
        return f"{what} (mode {mode:03o}); fix: chmod g-w,o-rwx {_q(path)}"
    own = os.getegid()
    if mode & 0o040 and st.st_gid != own:
        return (
            f"readable by group {_group_name(st.st_gid)}, not this process's own group "
            f"{_group_name(own)} (mode {mode:03o}); fix: chmod 600 {_q(path)} "
            f"(or chgrp {_group_name(own)} {_q(path)})"
        )
    return ""


def check_secret_value(
    secret: bytes,
    what: str = "secret_file",
    minimum: int = MIN_SECRET_BYTES,
    path: Path | None = None,
) -> bytes:
    """``secret`` if it is at least ``minimum`` bytes long and not a
    placeholder, else ConfigError (naming ``path`` when it came from one)."""
    where = f"{what} {path}" if path is not None else what
    into = _q(path) if path is not None else "FILE"
    if len(secret) < minimum:
        raise ConfigError(
            f"{where}: the secret is {len(secret)} bytes, it must be at least {minimum} bytes; "
            f"fix: {MAKE_SECRET} > {into}"
        )
    if any(p in secret.lower() for p in PLACEHOLDERS):
        raise ConfigError(
            f"{where}: the secret is a placeholder (like CHANGE-ME), not a random value; "
            f"fix: {MAKE_SECRET} > {into}"
        )
    weak = weakness(secret)
    if weak:
        raise ConfigError(
            f"{where}: the secret is {weak}, not a random value; fix: {MAKE_SECRET} > {into}"
        )
    return secret


MIN_DISTINCT_BYTES = 8
MIN_ENTROPY_BITS = (
    64  # what its own byte frequencies say it holds (a random hex secret of 32: ~115)
)


def weakness(secret: bytes) -> str:
    """Why ``secret`` is guessable ("" when it does not look so): a pattern
    repeated, too few distinct bytes, or too little entropy by its own byte
    frequencies (a check for mistakes, not a proof of randomness)."""
    n = len(secret)
    for period in range(1, n // 2 + 1):
        if n % period == 0 and secret[:period] * (n // period) == secret:
            return f"one pattern of {period} byte(s) repeated"
    counts = [secret.count(b) for b in set(secret)]
    if len(counts) < MIN_DISTINCT_BYTES:
        return f"made of {len(counts)} distinct bytes (at least {MIN_DISTINCT_BYTES})"
    bits = -sum(c * math.log2(c / n) for c in counts)
    if bits < MIN_ENTROPY_BITS:
        return f"about {bits:.0f} bits by its byte frequencies (at least {MIN_ENTROPY_BITS})"
    return ""


METRICS_AUTH_MODES = ("none", "token", "tls")  # roadlog/runtime/health.py


def check_metrics_auth(mode: str, token_file: Path | None, insecure: bool) -> None:
    """ConfigError unless ``metrics_auth`` is a known mode with what it needs."""
    if mode not in METRICS_AUTH_MODES:
        raise ConfigError(f"metrics_auth: one of {', '.join(METRICS_AUTH_MODES)}, not {mode!r}")
    if mode == "token" and token_file is None:
        raise ConfigError("metrics_auth = token needs metrics_token_file (the bearer token's file)")
    if mode == "tls" and insecure:
        raise ConfigError("metrics_auth = tls needs TLS: the daemon runs insecure")


def refuse_to_start(program: str, error: ConfigError) -> NoReturn:
    """A daemon that cannot start says why in one line on stderr (no usage
    text around it, so it is what journald and the terminal show) and exits 2."""
    click.echo(f"{program}: {error}", err=True)
    sys.exit(2)


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
    it (``converters`` applied; numeric and true/false keys checked against
    their declared type, a flag's text parsed: ``config_types``); unknown
    keys and a wrong type are a ConfigError naming the key."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from None
    flags = {k: v for k, v in overrides.items() if v is not None}
    raw.update(flags)
    cfg = cls()
    known = {f.name for f in fields(cfg)}  # type: ignore[arg-type]
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"unknown config keys: {', '.join(sorted(unknown))}")
    conv = converters or {}
    hints = get_type_hints(type(cfg))
    for k, v in raw.items():
        try:
            # numbers and true/false checked (issue 39); a flag's text parsed
            v = conv[k](v) if k in conv else typed(hints[k], v, text=k in flags)
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
