"""A development PKI for tests: a CA for a test trust domain and certificates issued on
demand, one per identity, plus certificates no honest service accepts (for negative tests)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc

from ztate.services.cli import ca
from ztate.services.runtime.identity import Identity, Role

TRUST_DOMAIN = "ztate.test"


@dataclass(frozen=True)
class Credentials:
    cert: Path
    key: Path
    ca: Path


class Pki:
    """A CA for the test trust domain, plus certificates no honest service accepts."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca_dir = root / "ca"
        self.certs = root / "certs"
        ca.init_ca(self.ca_dir, TRUST_DOMAIN)
        self.foreign_ca_dir = root / "foreign-ca"
        ca.init_ca(self.foreign_ca_dir, TRUST_DOMAIN)
        ca.issue(
            self.ca_dir,
            Identity(TRUST_DOMAIN, Role.SERVICE, "transition"),
            self.certs,
            dns_names=("localhost",),
            ip_addresses=("127.0.0.1",),
        )

    def identity(self, role: Role, name: str) -> Credentials:
        cert = self.certs / f"{role}-{name}.crt"
        if not cert.exists():
            ca.issue(self.ca_dir, Identity(TRUST_DOMAIN, role, name), self.certs)
        return Credentials(cert, self.certs / f"{role}-{name}.key", self.certs / ca.CA_CERT)

    def node(self, name: str) -> Credentials:
        return self.identity(Role.NODE, name)

    def operator(self, name: str = "admin") -> Credentials:
        return self.identity(Role.OPERATOR, name)

    def foreign(self, name: str) -> Credentials:
        """Signed by another CA that claims the same trust domain."""
        out = self.root / "foreign"
        paths = ca.issue(self.foreign_ca_dir, Identity(TRUST_DOMAIN, Role.NODE, name), out)
        return Credentials(paths.cert, paths.key, self.certs / ca.CA_CERT)

    def expired(self, name: str) -> Credentials:
        out = self.root / "expired"
        now = datetime.now(UTC)
        paths = ca.issue(
            self.ca_dir,
            Identity(TRUST_DOMAIN, Role.NODE, name),
            out,
            not_before=now - timedelta(days=30),
            not_after=now - timedelta(days=1),
        )
        return Credentials(paths.cert, paths.key, self.certs / ca.CA_CERT)

    def with_uris(self, stem: str, *uris: str) -> Credentials:
        """Signed by our CA, with arbitrary URI SANs (or none)."""
        out = self.root / "odd"
        paths = ca.issue_for_uris(self.ca_dir, uris, out, stem=stem, common_name=stem)
        return Credentials(paths.cert, paths.key, self.certs / ca.CA_CERT)


def secure_channel(target: str, creds: Credentials) -> grpc.aio.Channel:
    """A raw gRPC channel with ``creds``: for calls the SDK does not make, or makes
    differently (undecodable bytes, default client options)."""
    return grpc.aio.secure_channel(
        target,
        grpc.ssl_channel_credentials(
            creds.ca.read_bytes(), creds.key.read_bytes(), creds.cert.read_bytes()
        ),
    )
