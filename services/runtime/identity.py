"""Who is calling: the SPIFFE ID in the caller's verified client certificate.

An identity is ``spiffe://<trust-domain>/<role>/<name>``. TLS has already
verified the certificate chain to the configured CA and its validity period
when the connection was made; this module reads the identity out of it and, at every
call (so on connections opened before an expiry or a revocation too), refuses a
certificate outside its validity period, or a certificate or identity in the revocation
list (``Authenticator``). Nothing in a request body or
its metadata can claim an identity.
"""

from __future__ import annotations

import enum
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import grpc
from cryptography import x509

from ztate.services.runtime.errors import CertificateExpired, IdentityInvalid, IdentityRevoked

if TYPE_CHECKING:  # the list reads identities with this module: no import cycle
    from ztate.services.runtime.revocation import Revocations

# also a pydantic pattern (policy node names), whose engine has no \Z: Python code
# must use NAME.fullmatch, since "$" alone would also match before a final "\n"
NAME = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,62}[a-z0-9])?$")
TRUST_DOMAIN = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,253}[a-z0-9])?\Z")


class Role(enum.StrEnum):
    """What kind of principal an identity is."""

    NODE = "node"  # an agent worker
    OPERATOR = "operator"  # a human or tool that administers threads and reads the ledger
    REVIEWER = "reviewer"  # a human who decides approvals
    SERVICE = "service"  # a ztate service (transition, approval)


@dataclass(frozen=True, slots=True)
class Identity:
    """An authenticated principal."""

    trust_domain: str
    role: Role
    name: str
    # formatted once: the request path asks for it several times per call
    spiffe_id: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        spiffe_id = f"spiffe://{self.trust_domain}/{self.role.value}/{self.name}"
        object.__setattr__(self, "spiffe_id", spiffe_id)

    def __str__(self) -> str:
        return self.spiffe_id


@lru_cache(maxsize=4096)
def parse_spiffe_id(uri: str, trust_domain: str) -> Identity:
    """Parse and check a SPIFFE ID against the trust domain we serve."""
    prefix = "spiffe://"
    if not uri.startswith(prefix):
        raise IdentityInvalid("certificate URI SAN is not a SPIFFE ID")
    domain, _, path = uri[len(prefix) :].partition("/")
    if domain != trust_domain:
        raise IdentityInvalid(f"certificate is for trust domain {domain!r}, not {trust_domain!r}")
    parts = path.split("/")
    if len(parts) != 2:
        raise IdentityInvalid("SPIFFE ID path must be /<role>/<name>")
    role_text, name = parts
    try:
        role = Role(role_text)
    except ValueError:
        raise IdentityInvalid(f"unknown role {role_text!r} in SPIFFE ID") from None
    if not NAME.fullmatch(name):
        raise IdentityInvalid(f"identity name must match {NAME.pattern}")
    return Identity(trust_domain=trust_domain, role=role, name=name)


AuthContext = Mapping[str, Iterable[bytes]]


def identity_from_context(
    context: grpc.aio.ServicerContext[Any, Any],
    trust_domain: str,
    auth: AuthContext | None = None,
) -> Identity:
    """The caller's identity from the TLS-verified peer certificate of this call.

    gRPC core sets ``peer_spiffe_id`` only when the verified certificate carries
    exactly one URI SAN and it is a well-formed SPIFFE ID. ``auth`` is the call's
    ``auth_context()`` if the caller already has it (gRPC builds it anew, the peer's
    PEM certificate included, at every ask).
    """
    if auth is None:
        auth = context.auth_context()
    if auth.get("transport_security_type") != [b"ssl"]:
        raise IdentityInvalid("call did not arrive over TLS")
    spiffe_ids = list(auth.get("peer_spiffe_id") or ())
    if len(spiffe_ids) != 1:
        raise IdentityInvalid("client certificate must carry exactly one SPIFFE ID as URI SAN")
    return parse_spiffe_id(spiffe_ids[0].decode("ascii", "replace"), trust_domain)


@dataclass(frozen=True, slots=True)
class CertificateFacts:
    """What the per-call checks read from the caller's certificate: its serial, and its
    validity period in POSIX seconds."""

    serial: int
    not_before: float
    not_after: float


@lru_cache(maxsize=4096)
def certificate_facts(pem: bytes) -> CertificateFacts | None:
    """The facts of a PEM certificate (cached: a connection presents the same bytes at
    every call); None if it does not parse, which TLS would not have let by."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return None
    return CertificateFacts(
        cert.serial_number,
        cert.not_valid_before_utc.timestamp(),
        cert.not_valid_after_utc.timestamp(),
    )


class Authenticator:
    """The per-call identity step of a service: who the caller is (``identify``), then
    whether its certificate is still valid and neither it nor its identity revoked
    (``check_credential``); two steps, so that such a caller, whose certificate is
    genuine, can be named in a refusal."""

    def __init__(self, trust_domain: str, revocations: Revocations | None = None) -> None:
        self.trust_domain = trust_domain
        self._revocations = revocations

    def identify(
        self, context: grpc.aio.ServicerContext[Any, Any], auth: AuthContext | None = None
    ) -> Identity:
        """The caller's identity, or ``IdentityInvalid``."""
        return identity_from_context(context, self.trust_domain, auth)

    def check_credential(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        caller: Identity,
        auth: AuthContext | None = None,
    ) -> None:
        """``CertificateExpired`` if the caller's certificate is outside its validity
        period now (TLS checked the dates when the connection was made, and a connection
        lasts: this is checked at every call and stream item); ``IdentityRevoked`` if the
        revocation list, as it is now, names the certificate (by serial) or its
        identity."""
        if auth is None:
            auth = context.auth_context()
        facts = caller_certificate(auth)
        if facts is None:  # TLS verified exactly one certificate: fail closed all the same
            raise IdentityInvalid("the caller's certificate cannot be read")
        now = time.time()
        if now > facts.not_after:
            raise CertificateExpired(
                f"the certificate of {caller.spiffe_id} expired at "
                f"{_utc(facts.not_after)}: renew it"
            )
        if now < facts.not_before:
            raise CertificateExpired(
                f"the certificate of {caller.spiffe_id} is not valid before "
                f"{_utc(facts.not_before)}"
            )
        if self._revocations is None:
            return
        self._revocations.check(caller.spiffe_id, facts.serial)

    def revoked(self, spiffe_id: str, serial: int | None) -> bool:
        """Whether the revocation list, as it is now, names ``spiffe_id`` or the
        certificate of ``serial`` (a decision recorded earlier, checked again)."""
        if self._revocations is None:
            return False
        try:
            self._revocations.check(spiffe_id, serial)
        except IdentityRevoked:
            return True
        return False


def caller_certificate(auth: AuthContext) -> CertificateFacts | None:
    """The facts of the certificate the caller presented (None: not exactly one)."""
    pems = list(auth.get("x509_pem_cert") or ())
    return certificate_facts(pems[0]) if len(pems) == 1 else None


def caller_serial(
    context: grpc.aio.ServicerContext[Any, Any], auth: AuthContext | None = None
) -> int | None:
    """The serial of the certificate the caller presented (None: not exactly one)."""
    facts = caller_certificate(context.auth_context() if auth is None else auth)
    return None if facts is None else facts.serial


def _utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
