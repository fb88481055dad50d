"""The cluster's CA and the certificates it signs, made with ``cryptography``
(``roadlog ca ...``, ``roadlog cluster up``, the Ansible controller).

Layout (``roadlog.runtime.tls``): a certs dir holds ``ca.crt`` and the
certificates of one host (``node.crt``, ``queue.crt``, ``client.NAME.crt``)
with their keys; the CA's key lives apart (``--ca-key``), with the operators.

Invariants:
- Every key is written 0600 from the start (never briefly open to others),
  through a temporary file renamed into place; an existing key or
  certificate is never overwritten unless asked (``overwrite``).
- A certificate names its holder in its subject CN (``node:ID``,
  ``queue:NAME``, ``client:NAME``); node and queue certificates carry their
  hosts and addresses as SANs, so the other side checks the name it dialled.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from roadlog.runtime.tls import CA_CERT, Identity, cert_files, check_key_file

CA_DAYS = 3650
CERT_DAYS = 365
CA_NAME = "roadlog CA"


class CAError(ValueError):
    """A CA or certificate cannot be made or read; the message says why and the fix."""


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _write(path: Path, data: bytes, mode: int, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise CAError(f"{path} exists; remove it first (or pass --overwrite)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _write_pair(
    crt_path: Path,
    cert: x509.Certificate,
    key_path: Path,
    key: ec.EllipticCurvePrivateKey,
    overwrite: bool,
    exists_hint: str,
) -> None:
    """A certificate (0644) and its key (0600); unless ``overwrite``, neither
    may exist yet (CAError naming the one that does, with ``exists_hint``)."""
    if not overwrite:
        for p in (crt_path, key_path):
            if p.exists():
                raise CAError(f"{p} exists; {exists_hint}")
    _write(key_path, _pem_key(key), 0o600, overwrite)
    _write(crt_path, _pem(cert), 0o644, overwrite)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def create_ca(certs_dir: Path, ca_key: Path, days: int = CA_DAYS, overwrite: bool = False) -> Path:
    """A new cluster CA: ``certs_dir/ca.crt`` and its key at ``ca_key`` (0600)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    ca_crt = certs_dir / CA_CERT
    _write_pair(
        ca_crt,
        cert,
        ca_key,
        key,
        overwrite,
        "a cluster has one CA (pass --overwrite to replace it)",
    )
    return ca_crt


def _load_ca(certs_dir: Path, ca_key: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca_crt = certs_dir / CA_CERT
    try:
        cert = x509.load_pem_x509_certificate(ca_crt.read_bytes())
    except (OSError, ValueError) as e:
        raise CAError(
            f"{ca_crt}: no CA certificate here ({e}); make one with `roadlog ca create-ca`"
        ) from None
    try:
        check_key_file(ca_key)
        key = serialization.load_pem_private_key(ca_key.read_bytes(), None)
    except ValueError as e:
        raise CAError(str(e) if str(e).startswith("key file") else f"{ca_key}: {e}") from None
    except OSError as e:
        raise CAError(f"CA key {ca_key}: cannot read it ({e.strerror})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        raise CAError(f"CA key {ca_key} is not the key of {ca_crt}")
    return cert, key


def _san(hosts: list[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for h in dict.fromkeys(hosts):
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h.strip("[]"))))
        except ValueError:
            out.append(x509.DNSName(h))
    return out


def create_cert(
    certs_dir: Path,
    ca_key: Path,
    identity: Identity,
    hosts: list[str] | None = None,
    days: int = CERT_DAYS,
    overwrite: bool = False,
) -> tuple[Path, Path]:
    """A certificate for ``identity`` signed by the CA in ``certs_dir``
    (``ca.crt``, key ``ca_key``), with ``hosts`` (names, addresses) as SANs;
    written next to ``ca.crt`` (key 0600). Returns (certificate, key)."""
    ca_cert, ca_priv = _load_ca(certs_dir, ca_key)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    usage = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if identity.kind != "client":
        usage.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
    builder = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "roadlog"),
                    x509.NameAttribute(NameOID.COMMON_NAME, identity.common_name),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_priv.public_key()),
            critical=False,
        )
    )
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName(_san(hosts)), critical=False)
    cert = builder.sign(ca_priv, hashes.SHA256())
    crt_name, key_name = cert_files(identity.kind, identity.name)
    crt_path, key_path = certs_dir / crt_name, certs_dir / key_name
    _write_pair(crt_path, cert, key_path, key, overwrite, "remove it first (or pass --overwrite)")
    return crt_path, key_path


@dataclass(frozen=True)
class CertInfo:
    file: str
    subject: str
    hosts: list[str]
    not_after: str
    ca: bool


def list_certs(certs_dir: Path) -> list[CertInfo]:
    """The certificates in ``certs_dir``: what each names, for which hosts, until when."""
    out: list[CertInfo] = []
    for p in sorted(certs_dir.glob("*.crt")):
        try:
            c = x509.load_pem_x509_certificate(p.read_bytes())
        except ValueError as e:
            raise CAError(f"{p}: not a PEM certificate ({e})") from None
        cn = c.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        try:
            san = c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            hosts = [str(n.value) for n in san]
        except x509.ExtensionNotFound:
            hosts = []
        try:
            is_ca = c.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        except x509.ExtensionNotFound:
            is_ca = False
        out.append(
            CertInfo(
                p.name,
                str(cn[0].value) if cn else "",
                hosts,
                c.not_valid_after_utc.isoformat(timespec="seconds"),
                is_ca,
            )
        )
    return out


def copy_ca(from_dir: Path, to_dir: Path) -> None:
    """Put the CA certificate of ``from_dir`` into ``to_dir`` (another host's dir)."""
    to_dir.mkdir(parents=True, exist_ok=True)
    data = (from_dir / CA_CERT).read_bytes()
    if (to_dir / CA_CERT) != (from_dir / CA_CERT):
        _write(to_dir / CA_CERT, data, 0o644, overwrite=True)
