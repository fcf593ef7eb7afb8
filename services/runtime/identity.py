"""Who is calling: the SPIFFE ID in the caller's verified client certificate.

An identity is ``spiffe://<trust-domain>/<role>/<name>``. TLS has already
verified the certificate chain to the configured CA and its validity period
before a handler runs; this module only reads the identity out of it. Nothing in
a request body or its metadata can claim an identity.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import grpc

from ztate.services.runtime.errors import IdentityInvalid

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

    @property
    def spiffe_id(self) -> str:
        return f"spiffe://{self.trust_domain}/{self.role.value}/{self.name}"

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


def identity_from_context(
    context: grpc.aio.ServicerContext[Any, Any], trust_domain: str
) -> Identity:
    """The caller's identity from the TLS-verified peer certificate of this call.

    gRPC core sets ``peer_spiffe_id`` only when the verified certificate carries
    exactly one URI SAN and it is a well-formed SPIFFE ID.
    """
    auth = context.auth_context()
    if auth.get("transport_security_type") != [b"ssl"]:
        raise IdentityInvalid("call did not arrive over TLS")
    spiffe_ids = list(auth.get("peer_spiffe_id") or ())
    if len(spiffe_ids) != 1:
        raise IdentityInvalid("client certificate must carry exactly one SPIFFE ID as URI SAN")
    return parse_spiffe_id(spiffe_ids[0].decode("ascii", "replace"), trust_domain)
