"""Checkpoints: a thread's head, signed with a public-key signature.

The HMAC chain needs the HMAC key to verify, and whoever holds that key could
rewrite a consistent chain. So the transition service also signs, every
``checkpoint_interval`` seconds, each thread head that moved since its last
checkpoint with an Ed25519 key. Anyone with the public key can then check, with
no secret at all, that the chain links hash correctly from genesis and pass
through every signed head (``ztate verify --public-only``).

    checkpoint_bytes = JCS({"format": 1, "kind": "checkpoint", "thread_id", "version",
                            "head_digest", "signed_at", "key_id"})
    signature        = hex(Ed25519.sign(key, checkpoint_bytes))
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ztate.services.canonical import JsonObject, canonical_bytes
from ztate.services.chain import format_time

CHECKPOINT_FORMAT = 1
KIND_CHECKPOINT = "checkpoint"
MEMBERS = frozenset(
    {"format", "kind", "thread_id", "version", "head_digest", "signed_at", "key_id"}
)


class CheckpointError(ValueError):
    """A checkpoint that does not verify; the message says why."""


@dataclass(frozen=True, slots=True)
class SignedCheckpoint:
    checkpoint: bytes
    signature: str
    key_id: str


def sign_checkpoint(
    key: Ed25519PrivateKey,
    key_id: str,
    *,
    thread_id: str,
    version: int,
    head_digest: str,
    signed_at: datetime,
) -> SignedCheckpoint:
    body: JsonObject = {
        "format": CHECKPOINT_FORMAT,
        "kind": KIND_CHECKPOINT,
        "thread_id": thread_id,
        "version": version,
        "head_digest": head_digest,
        "signed_at": format_time(signed_at),
        "key_id": key_id,
    }
    data = canonical_bytes(body)
    return SignedCheckpoint(data, key.sign(data).hex(), key_id)


def verify_checkpoint(
    signed: SignedCheckpoint, public_keys: dict[str, Ed25519PublicKey]
) -> JsonObject:
    """The checkpoint's content, once its signature and form check out."""
    key = public_keys.get(signed.key_id)
    if key is None:
        raise CheckpointError(f"no checkpoint public key has id {signed.key_id!r}")
    try:
        key.verify(bytes.fromhex(signed.signature), signed.checkpoint)
    except (InvalidSignature, ValueError):
        raise CheckpointError("the Ed25519 signature does not verify") from None
    try:
        body = json.loads(signed.checkpoint)
    except ValueError:
        raise CheckpointError("the checkpoint is not JSON") from None
    if not isinstance(body, dict) or body.keys() != MEMBERS:
        raise CheckpointError("the checkpoint does not have the members of format 1")
    if canonical_bytes(body) != signed.checkpoint:
        raise CheckpointError("the checkpoint is not in canonical (RFC 8785) form")
    if (body["format"], body["kind"], body["key_id"]) != (
        CHECKPOINT_FORMAT,
        KIND_CHECKPOINT,
        signed.key_id,
    ):
        raise CheckpointError("unsupported checkpoint format, kind or key id")
    return body
