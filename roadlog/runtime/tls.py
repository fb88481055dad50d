"""Transport security for roadlog's processes: the credentials a daemon
loads at start (its certificate and key, the cluster's CA), the gRPC
credentials and ssl contexts of every port, and the identity a peer's
certificate names. The CA and the certificates are made by
``roadlog.tools.ca`` (``roadlog ca ...``); this module needs no
``cryptography``, so hosts do not either.

A certificates directory (``certs_dir``, as ``cockroach cert`` lays it out):

- ``ca.crt``: the cluster's CA (its key is never in a daemon's directory);
- ``node.crt`` / ``node.key``: a node's, subject CN ``node:ID``;
- ``queue.crt`` / ``queue.key``: a queue server's, CN ``queue:NAME``;
- ``client.NAME.crt`` / ``client.NAME.key``: a client's (an operator, the
  Spark job's reader), CN ``client:NAME``.

Invariants:
- A daemon starts only with readable credentials whose key files are open
  to nobody but their owner (mode 0600 or stricter), owned by root or by the
  daemon's user; else ``ConfigError`` names the file and the fix.
- Every TLS port verifies the other side against the cluster's CA only (not
  the system's roots); mutual ports refuse a connection without a
  certificate of that CA.
- Who a caller is comes from its verified certificate (``Identity``),
  never from what it says in a message.
"""

from __future__ import annotations

import os
import shlex
import ssl
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from roadlog.client_tls import ClientTLS
from roadlog.runtime.auth import guarded
from roadlog.runtime.config import ConfigError

CA_CERT = "ca.crt"
KINDS = ("node", "queue", "client")
INSECURE_WARNING = (
    "INSECURE: TLS is off (--insecure): every port is plaintext and unauthenticated; "
    "anyone who reaches a port can read and change the cluster's data. For debugging only."
)


@dataclass(frozen=True)
class Identity:
    """Who a certificate names: a kind (node, queue, client) and a name
    (a node's id as text)."""

    kind: str
    name: str

    @classmethod
    def parse(cls, common_name: str) -> Identity | None:
        kind, sep, name = common_name.partition(":")
        if not sep or kind not in KINDS or not name:
            return None
        if kind == "node" and not (name.isdigit() and int(name) > 0):
            return None
        return cls(kind, name)

    @property
    def common_name(self) -> str:
        return f"{self.kind}:{self.name}"

    @property
    def node_id(self) -> int:
        """The node id a node's certificate names (0 for any other kind)."""
        return int(self.name) if self.kind == "node" else 0

    def __str__(self) -> str:
        return self.common_name


def cert_files(kind: str, name: str = "") -> tuple[str, str]:
    """The certificate's and key's file names of ``kind`` in a certs dir."""
    if kind == "client":
        return f"client.{name}.crt", f"client.{name}.key"
    return f"{kind}.crt", f"{kind}.key"


def _q(path: Path) -> str:
    return shlex.quote(str(path))


def check_key_file(path: Path) -> None:
    """A private key a daemon may use: it exists, belongs to root or to this
    process's user, and no group or other may read or change it. Else
    ConfigError (the file, what is wrong, the fix)."""
    try:
        st = path.stat()
    except OSError as e:
        raise ConfigError(f"key file {path}: cannot read it ({e.strerror})") from None
    me = os.geteuid()
    if st.st_uid not in (0, me):
        raise ConfigError(
            f"key file {path}: owned by uid {st.st_uid}, neither root nor this process's "
            f"user (uid {me}); fix: chown {me} {_q(path)}"
        )
    mode = st.st_mode & 0o777
    if mode & 0o077:
        raise ConfigError(
            f"key file {path}: readable or writable by group or others (mode {mode:03o}); "
            f"fix: chmod 600 {_q(path)}"
        )


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot read it ({e.strerror})") from None


def peer_common_name(pem: bytes) -> str:
    """The subject CN of a PEM certificate (ssl's own decoder, no cryptography)."""
    import tempfile

    with tempfile.NamedTemporaryFile("wb", suffix=".crt") as f:
        f.write(pem)
        f.flush()
        decoded = ssl._ssl._test_decode_cert(f.name)  # type: ignore[attr-defined]
    return _cn_of(decoded)


def _cn_of(decoded: dict[str, Any]) -> str:
    for rdn in decoded.get("subject", ()):
        for k, v in rdn:
            if k == "commonName":
                return str(v)
    return ""


@dataclass(frozen=True)
class Credentials:
    """A process's TLS credentials: its certificate and key (files, checked)
    and the cluster's CA. ``identity`` is what its own certificate names."""

    ca_file: Path
    cert_file: Path
    key_file: Path
    identity: Identity
    ca: bytes
    cert: bytes
    key: bytes

    @classmethod
    def load(cls, certs_dir: Path, kind: str, name: str = "") -> Credentials:
        """The credentials of ``kind`` in ``certs_dir`` (ConfigError when one
        is missing, unreadable, open to others, or names another kind)."""
        crt_name, key_name = cert_files(kind, name)
        ca_file, cert_file, key_file = (
            certs_dir / CA_CERT,
            certs_dir / crt_name,
            certs_dir / key_name,
        )
        make = f"make them with `roadlog ca create-{kind} --certs-dir {_q(certs_dir)} ...`"
        for p in (ca_file, cert_file, key_file):
            if not p.exists():
                raise ConfigError(f"certs_dir {certs_dir}: no {p.name}; {make}")
        check_key_file(key_file)
        ca, cert, key = (
            _read(ca_file, "CA"),
            _read(cert_file, "certificate"),
            _read(key_file, "key"),
        )
        try:  # the key belongs to the certificate, and both parse
            server_context(cert_file, key_file, ca_file, mutual=False)
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(
                f"certs_dir {certs_dir}: {cert_file.name} and {key_file.name} do not load "
                f"together ({e}); {make}"
            ) from None
        ident = Identity.parse(peer_common_name(cert))
        if ident is None or ident.kind != kind:
            raise ConfigError(
                f"certificate {cert_file}: names {ident or 'no roadlog identity'}, "
                f"not a {kind}; {make}"
            )
        return cls(ca_file, cert_file, key_file, ident, ca, cert, key)

    # ---------------------------------------------------------------- gRPC

    def server_credentials(self, mutual: bool = True) -> grpc.ServerCredentials:
        """A TLS port's credentials; ``mutual``: callers must present a
        certificate of the cluster's CA (else only the server proves itself)."""
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=mutual
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Dialling: trusts the cluster's CA only, presents this certificate."""
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)

    # --------------------------------------------------------- ssl contexts

    def server_ssl(self, mutual: bool = True) -> ssl.SSLContext:
        return server_context(self.cert_file, self.key_file, self.ca_file, mutual)

    def client_ssl(self) -> ssl.SSLContext:
        return client_context(self.ca_file, self.cert_file, self.key_file)


def server_context(cert: Path, key: Path, ca: Path, mutual: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(cafile=str(ca))
    ctx.verify_mode = ssl.CERT_REQUIRED if mutual else ssl.CERT_NONE
    return ctx


def client_context(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the server and its name
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(cafile=str(ca))
    if cert is not None and key is not None:
        ctx.load_cert_chain(cert, key)
    return ctx


def ssl_identity(peercert: dict[str, Any] | None) -> Identity | None:
    """The identity of a verified peer (``getpeercert()`` of an ssl socket)."""
    return Identity.parse(_cn_of(peercert)) if peercert else None


# --------------------------------------------------------------- the process


class Default:
    """The type of ``DEFAULT``: "the process's own" where None means plaintext."""


DEFAULT = Default()


class Security:
    """How a process speaks on the wire: TLS with its ``Credentials``, or
    plaintext (``insecure``, debugging only). One per process, installed at
    start (``install``); channels and ports ask it."""

    def __init__(self, creds: Credentials | None) -> None:
        self.creds = creds
        self._contexts: dict[str, ssl.SSLContext] = {}  # made once: loading reads files

    @property
    def insecure(self) -> bool:
        return self.creds is None

    def channel(
        self, target: str, options: Sequence[tuple[str, Any]] | None = None
    ) -> grpc.aio.Channel:
        if self.creds is None:
            return grpc.aio.insecure_channel(target, options=options)
        return grpc.aio.secure_channel(target, self.creds.channel_credentials(), options=options)

    def sync_channel(
        self, target: str, options: Sequence[tuple[str, Any]] | None = None
    ) -> grpc.Channel:
        if self.creds is None:
            return grpc.insecure_channel(target, options=options)
        return grpc.secure_channel(target, self.creds.channel_credentials(), options=options)

    def add_port(self, server: grpc.aio.Server, address: str, mutual: bool = True) -> int:
        """Listen on ``address`` (TLS, mutual or not; plaintext when insecure).
        Returns the port (0: not bound)."""
        if self.creds is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.creds.server_credentials(mutual))

    def client_tls(self) -> ClientTLS:
        """The same credentials for the SDK's calls (``roadlog.client_tls``)."""
        if self.creds is None:
            return ClientTLS(insecure=True)
        return ClientTLS(self.creds.ca_file, self.creds.cert_file, self.creds.key_file)

    def server_ssl(self, mutual: bool = True) -> ssl.SSLContext | None:
        if self.creds is None:
            return None
        key = f"server-{mutual}"
        if key not in self._contexts:
            self._contexts[key] = self.creds.server_ssl(mutual)
        return self._contexts[key]

    def client_ssl(self) -> ssl.SSLContext | None:
        if self.creds is None:
            return None
        if "client" not in self._contexts:
            self._contexts["client"] = self.creds.client_ssl()
        return self._contexts["client"]


def warn_insecure(program: str) -> None:
    """Say it loudly, on stderr and in the log, at every start."""
    import logging
    import sys

    line = f"{program}: {INSECURE_WARNING}"
    print("!" * 79, line, "!" * 79, sep="\n", file=sys.stderr, flush=True)
    logging.getLogger("roadlog.tls").warning(INSECURE_WARNING)


_current = Security(None)


def install(security: Security) -> Security:
    """Make ``security`` this process's (a daemon does it once at start)."""
    global _current
    _current = security
    return security


def current() -> Security:
    """This process's security; plaintext until a daemon installs its own
    (the daemons refuse to start without credentials unless told --insecure)."""
    return _current


def load_security(certs_dir: Path | None, insecure: bool, kind: str) -> Security:
    """A daemon's security from its config: credentials from ``certs_dir``,
    or plaintext when ``insecure`` (and only then)."""
    if insecure:
        return Security(None)
    if certs_dir is None:
        raise ConfigError(
            "certs_dir: not set; a daemon needs its TLS certificates (make them with "
            f"`roadlog ca create-{kind} ...`) or --insecure (plaintext, debugging only)"
        )
    return Security(Credentials.load(certs_dir, kind))


# ------------------------------------------------------- gRPC identities


def grpc_identity(context: Any) -> Identity | None:
    """The verified certificate's identity of a gRPC call (None: no
    certificate, or a connection without TLS)."""
    try:
        names = context.auth_context().get("x509_common_name") or []
    except Exception:
        return None
    return Identity.parse(names[0].decode(errors="replace")) if names else None


NOT_PERMITTED = "this certificate may not call"


class CertAuth(grpc.aio.ServerInterceptor):
    """Protected calls need a verified certificate of one of the kinds
    ``allowed(method)`` gives (None: the method is open); the rest are
    answered UNAUTHENTICATED (no certificate) or PERMISSION_DENIED (another
    kind) before their handler runs. ``on_refused`` hears of each."""

    def __init__(
        self,
        allowed: Callable[[str], Collection[str] | None],
        on_refused: Callable[[str], None] = lambda method: None,
    ) -> None:
        self.allowed = allowed
        self.on_refused = on_refused

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(details)
        method = details.method or ""
        kinds = self.allowed(method)
        if handler is None or kinds is None:
            return handler
        return _checked(handler, method, frozenset(kinds), self.on_refused)


def _checked(
    handler: grpc.RpcMethodHandler[Any, Any],
    method: str,
    kinds: frozenset[str],
    on_refused: Callable[[str], None],
) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` behind a check of the caller's certificate."""

    async def check(context: Any) -> None:
        ident = grpc_identity(context)
        if ident is None:
            on_refused(method)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no client certificate")
        elif ident.kind not in kinds:
            on_refused(method)
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"{NOT_PERMITTED} {method}: {ident}"
            )

    return guarded(handler, check)
