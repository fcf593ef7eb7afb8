"""What the vector generators share: an Ed25519 key from a fixed seed, its public half
as the key files hold it, and a signature over exact bytes (one bit flipped on demand)."""

from __future__ import annotations

import base64
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ztate.contract.canonical import canonical_bytes


def public_b64(seed: bytes) -> str:
    key = Ed25519PrivateKey.from_private_bytes(seed).public_key()
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()


def signed_case(
    members: dict[str, Any], data: bytes | None, seed: bytes, *, flip_bit: bool
) -> tuple[bytes, str]:
    """The signed bytes (``data``, else the canonical form of ``members``) and the hex
    Ed25519 signature over them by the key of ``seed``."""
    body = canonical_bytes(members) if data is None else data
    signature = bytearray(Ed25519PrivateKey.from_private_bytes(seed).sign(body))
    if flip_bit:
        signature[0] ^= 1
    return body, bytes(signature).hex()
