"""A development certificate authority for ztate identities.

``ztate ca init`` writes a CA; ``ztate ca issue`` writes a key and certificate
for one SPIFFE identity, valid for a day unless asked otherwise (``--ttl``);
``ztate ca renew`` issues the same identity again with a new key pair. Every file is
written atomically (``reloading.write_atomically``): the services and the SDK watch
them and must never read half of one. The CA key stays in the CA folder: services and
workers receive only their own key, their certificate and the CA certificate. In
production, use your own PKI (SPIRE, cert-manager, Vault PKI) issuing the same
SPIFFE IDs.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ztate.contract.files import MAX_CA_BUNDLE_BYTES, MAX_PEM_FILE_BYTES, FileTooLarge, read_bounded
from ztate.services.runtime.identity import Identity
from ztate.services.runtime.reloading import write_atomically
from ztate.services.runtime.tls import private_key

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
DEFAULT_TTL = timedelta(days=1)
MAX_TTL = timedelta(days=3650)
TTL = re.compile(r"^([1-9][0-9]{0,6})([mhd])\Z")
TTL_UNITS = {"m": "minutes", "h": "hours", "d": "days"}
BACKDATE = timedelta(minutes=5)  # tolerates clocks a little behind the CA's


def parse_ttl(text: str) -> timedelta:
    """A lifetime as people write it: ``90m``, ``24h``, ``7d``."""
    found = TTL.fullmatch(text.strip())
    if not found:
        raise ValueError(
            f"a lifetime is a whole number of minutes, hours or days, as 90m, 24h or 7d, "
            f"not {text!r}"
        )
    ttl = timedelta(**{TTL_UNITS[found.group(2)]: int(found.group(1))})
    if ttl > MAX_TTL:
        raise ValueError(f"a lifetime of at most {MAX_TTL.days} days, not {text!r}")
    return ttl


@dataclass(frozen=True)
class IssuedPaths:
    """Where an identity's files were written."""

    cert: Path
    key: Path
    ca_cert: Path


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
    write_atomically(key_path, _key_pem(key), 0o600)
    write_atomically(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
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
    ttl: timedelta = DEFAULT_TTL,
) -> IssuedPaths:
    """Issue a key and certificate for ``identity``, usable for client and server TLS,
    valid for ``ttl`` (unless ``not_after`` says otherwise).

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
        ttl=ttl,
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
    ttl: timedelta = DEFAULT_TTL,
) -> IssuedPaths:
    """Issue a certificate with exactly the given URI SANs (``issue`` is the usual way)."""
    ca_key, ca_cert = _load_ca(ca_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or datetime.now(UTC) - BACKDATE
    end = not_after or start + BACKDATE + ttl
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
    # the key first: a reader that sees the new certificate before its key waits for it
    write_atomically(key_path, _key_pem(key), 0o600)
    write_atomically(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    ca_copy = out_dir / CA_CERT
    if ca_copy.resolve() != (ca_dir / CA_CERT).resolve():
        _trust(ca_copy, ca_cert)
    return IssuedPaths(cert=cert_path, key=key_path, ca_cert=ca_copy)


def _load_ca(ca_dir: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """The CA's key and certificate, each read to its bound; ``ValueError`` naming the
    file and what is wrong with it (never its content), ``OSError`` as reading raises."""
    key_path, cert_path = ca_dir / CA_KEY, ca_dir / CA_CERT
    ca_key = private_key(read_bounded(key_path, MAX_PEM_FILE_BYTES, "a CA key"), key_path)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{key_path}: the CA key must be an EC key")
    try:
        ca_cert = x509.load_pem_x509_certificate(
            read_bounded(cert_path, MAX_PEM_FILE_BYTES, "a CA certificate")
        )
    except ValueError as exc:
        if isinstance(exc, FileTooLarge):
            raise
        raise ValueError(f"{cert_path} is not a PEM certificate") from None
    return ca_key, ca_cert


def _trust(bundle: Path, ca_cert: x509.Certificate) -> None:
    """Make ``bundle`` trust ``ca_cert``: added to the CAs it holds, never replacing them,
    so that issuing from a new CA keeps the old one trusted until it is removed (the
    overlap of a CA rotation, docs/operations.md)."""
    try:
        held = x509.load_pem_x509_certificates(
            read_bounded(bundle, MAX_CA_BUNDLE_BYTES, "a CA bundle")
        )
    except (FileNotFoundError, ValueError):
        held = []
    if ca_cert in held:
        return
    pem = b"".join(c.public_bytes(serialization.Encoding.PEM) for c in [*held, ca_cert])
    write_atomically(bundle, pem, 0o644)


def _signed_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


class NotIssuedHere(ValueError):
    """A certificate the CA asked to renew it did not sign."""


@dataclass(frozen=True)
class Issued:
    """What an issued certificate says, as renewal reads it back."""

    uris: tuple[str, ...]
    dns_names: tuple[str, ...]
    ip_addresses: tuple[str, ...]
    common_name: str
    not_before: datetime
    not_after: datetime
    serial: int

    @classmethod
    def read(cls, cert_path: Path) -> Issued:
        pem = read_bounded(cert_path, MAX_PEM_FILE_BYTES, "a certificate")
        return cls.of(x509.load_pem_x509_certificate(pem), cert_path.stem)

    @classmethod
    def of(cls, cert: x509.Certificate, stem: str) -> Issued:
        try:
            sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            sans = x509.SubjectAlternativeName([])
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        return cls(
            uris=tuple(sans.get_values_for_type(x509.UniformResourceIdentifier)),
            dns_names=tuple(sans.get_values_for_type(x509.DNSName)),
            ip_addresses=tuple(str(ip) for ip in sans.get_values_for_type(x509.IPAddress)),
            common_name=str(names[0].value) if names else stem,
            not_before=cert.not_valid_before_utc,
            not_after=cert.not_valid_after_utc,
            serial=cert.serial_number,
        )

    @property
    def lifetime(self) -> timedelta:
        return self.not_after - self.not_before - BACKDATE

    def near_expiry(self, now: datetime | None = None) -> bool:
        """Past two thirds of its lifetime (or expired): time to renew, as SPIRE and
        cert-manager do by default."""
        now = now or datetime.now(UTC)
        return now >= self.not_after - (self.not_after - self.not_before) / 3


def renew(
    ca_dir: Path,
    cert_path: Path,
    *,
    ttl: timedelta | None = None,
    previous: tuple[Path, ...] = (),
) -> IssuedPaths:
    """Issue the identity of ``cert_path`` again (the same SANs and name) with a new key
    pair, for ``ttl`` or the old certificate's lifetime; ``<stem>.key`` beside it is
    replaced too. Both files are replaced atomically; processes watching them take the
    new pair at their next handshake or call.

    Only a certificate issued by a CA of ``ca_dir``'s own ``ca.crt``, or of a
    ``previous`` CA the operator names (a CA rotation's overlap: the old CA's folder or
    certificate file), is renewed (``NotIssuedHere`` otherwise): its identities are
    copied, so a certificate anyone could write into the folder (made with their own key,
    naming another identity) must not become a genuine one. Not the ``ca.crt`` beside the
    certificate: whoever can write the certificate there can add their own CA to that
    bundle too. The lifetime is at most ``MAX_TTL``, whatever the old certificate's."""
    cert = x509.load_pem_x509_certificate(
        read_bounded(cert_path, MAX_PEM_FILE_BYTES, "a certificate")
    )
    issuers = []
    for source in (ca_dir, *previous):
        bundle = source / CA_CERT if source.is_dir() else source
        issuers += x509.load_pem_x509_certificates(
            read_bounded(bundle, MAX_CA_BUNDLE_BYTES, "a CA bundle")
        )
    if not any(_signed_by(cert, issuer) for issuer in issuers):
        raise NotIssuedHere(
            f"{cert_path} was not issued by the CA in {ca_dir}"
            + (" nor a previous CA given" if previous else "")
            + ": not renewed (issue the identity with ztate ca issue, or name its CA with "
            "--previous-ca during a CA rotation)"
        )
    old = Issued.of(cert, cert_path.stem)
    return issue_for_uris(
        ca_dir,
        old.uris,
        cert_path.parent,
        stem=cert_path.stem,
        common_name=old.common_name,
        dns_names=old.dns_names,
        ip_addresses=old.ip_addresses,
        ttl=ttl or (min(old.lifetime, MAX_TTL) if old.lifetime > timedelta(0) else DEFAULT_TTL),
    )
