"""A development certificate authority for ztate identities.

``ztate ca init`` writes a CA; ``ztate ca issue`` writes a key and certificate
for one SPIFFE identity. The CA key stays in the CA folder: services and workers
receive only their own key, their certificate and the CA certificate. In
production, use your own PKI (SPIRE, cert-manager, Vault PKI) issuing the same
SPIFFE IDs.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ztate.services.runtime.identity import Identity

CA_CERT = "ca.crt"
CA_KEY = "ca.key"


@dataclass(frozen=True)
class IssuedPaths:
    """Where an identity's files were written."""

    cert: Path
    key: Path
    ca_cert: Path


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def init_ca(ca_dir: Path, trust_domain: str, *, days: int = 3650) -> Path:
    """Create a CA for ``trust_domain`` in ``ca_dir``; refuses to overwrite one."""
    cert_path, key_path = ca_dir / CA_CERT, ca_dir / CA_KEY
    if cert_path.exists() or key_path.exists():
        raise FileExistsError(f"a CA already exists in {ca_dir}")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"ztate CA for {trust_domain}")])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
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
    _write_private(key_path, _key_pem(key))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path


def issue(
    ca_dir: Path,
    identity: Identity,
    out_dir: Path,
    *,
    dns_names: tuple[str, ...] = (),
    ip_addresses: tuple[str, ...] = (),
    not_before: datetime | None = None,
    not_after: datetime | None = None,
    days: int = 365,
) -> IssuedPaths:
    """Issue a key and certificate for ``identity``, usable for client and server TLS.

    Writes ``<role>-<name>.crt``/``.key`` into ``out_dir`` and copies the CA
    certificate beside them (never the CA key).
    """
    return issue_for_uris(
        ca_dir,
        (identity.spiffe_id,),
        out_dir,
        stem=f"{identity.role}-{identity.name}",
        common_name=f"{identity.role}/{identity.name}",
        dns_names=dns_names,
        ip_addresses=ip_addresses,
        not_before=not_before,
        not_after=not_after,
        days=days,
    )


def issue_for_uris(
    ca_dir: Path,
    uris: tuple[str, ...],
    out_dir: Path,
    *,
    stem: str,
    common_name: str,
    dns_names: tuple[str, ...] = (),
    ip_addresses: tuple[str, ...] = (),
    not_before: datetime | None = None,
    not_after: datetime | None = None,
    days: int = 365,
) -> IssuedPaths:
    """Issue a certificate with exactly the given URI SANs (``issue`` is the usual way)."""
    ca_key = serialization.load_pem_private_key((ca_dir / CA_KEY).read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("the CA key must be an EC key")
    ca_cert = x509.load_pem_x509_certificate((ca_dir / CA_CERT).read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or datetime.now(UTC) - timedelta(minutes=5)
    end = not_after or start + timedelta(days=days)
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(uri) for uri in uris]
    sans += [x509.DNSName(name) for name in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    cert_path, key_path = out_dir / f"{stem}.crt", out_dir / f"{stem}.key"
    _write_private(key_path, _key_pem(key))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    ca_copy = out_dir / CA_CERT
    if ca_copy.resolve() != (ca_dir / CA_CERT).resolve():
        ca_copy.write_bytes((ca_dir / CA_CERT).read_bytes())
    return IssuedPaths(cert=cert_path, key=key_path, ca_cert=ca_copy)
