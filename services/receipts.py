"""Approval receipts: a human decision bound to one exact transition, signed Ed25519.

The approval service signs receipts with a private key only it holds; the
transition service holds the public keys and verifies every receipt immediately
before the compare-and-swap. ``docs/approvals.md`` is the normative format;
``tests/vectors/receipt-v1.json`` holds fixed vectors. In short::

    receipt_bytes  = JCS(receipt)                  # RFC 8785
    signature      = Ed25519.sign(private_key[key_id], receipt_bytes)
    receipt_digest = sha256(receipt_bytes)         # what the ledger record carries
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ztate.services.canonical import JsonObject, canonical_bytes, sha256_hex
from ztate.services.chain import format_time
from ztate.services.runtime import errors

RECEIPT_FORMAT = 1
KIND_RECEIPT = "approval_receipt"
APPROVE, REJECT = "approve", "reject"
KEY_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}\Z")
HEX_256 = re.compile(r"^[0-9a-f]{64}\Z")
RECEIPT_MEMBERS = frozenset(
    {
        "format",
        "kind",
        "transition_digest",
        "thread_id",
        "base_version",
        "decision",
        "reviewers",
        "issued_at",
        "expires_at",
        "nonce",
        "key_id",
    }
)


class KeyFileError(ValueError):
    """An approval key file is unusable; the message never holds key material."""


@dataclass(frozen=True, slots=True)
class SignedReceipt:
    receipt_bytes: bytes
    signature: str  # Ed25519 signature over receipt_bytes, lower-case hex
    key_id: str

    @property
    def digest(self) -> str:
        return sha256_hex(self.receipt_bytes)


def build_receipt(
    *,
    transition_digest: str,
    thread_id: str,
    base_version: int,
    decision: str,
    reviewers: list[str],
    issued_at: datetime,
    expires_at: datetime,
    key_id: str,
    nonce: str | None = None,
) -> JsonObject:
    """The receipt of one decision (docs/approvals.md)."""
    return {
        "format": RECEIPT_FORMAT,
        "kind": KIND_RECEIPT,
        "transition_digest": transition_digest,
        "thread_id": thread_id,
        "base_version": base_version,
        "decision": decision,
        "reviewers": sorted(reviewers),
        "issued_at": format_time(issued_at),
        "expires_at": format_time(expires_at),
        "nonce": nonce or secrets.token_hex(16),
        "key_id": key_id,
    }


def sign_receipt(receipt: JsonObject, key: Ed25519PrivateKey) -> SignedReceipt:
    data = canonical_bytes(receipt)
    return SignedReceipt(data, key.sign(data).hex(), receipt["key_id"])


# exactly as format_time writes them (docs/approvals.md): the SDK checks the same
RECEIPT_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z")


def _parse_time(text: Any) -> datetime:
    if not isinstance(text, str) or not RECEIPT_TIME.fullmatch(text):
        raise errors.ReceiptInvalid(
            "receipt times must be RFC 3339 UTC with exactly six fraction digits and a Z"
        )
    try:
        return datetime.fromisoformat(text[:-1] + "+00:00")
    except ValueError:
        raise errors.ReceiptInvalid("receipt times must be valid dates and times") from None


def verify_receipt(
    signed: SignedReceipt, public_keys: dict[str, Ed25519PublicKey], *, now: datetime
) -> JsonObject:
    """Check a receipt's signature, form and validity period; return it parsed.

    What it authorises (its digest, thread and base version against a parked
    transition, and that its nonce is fresh) is for the caller to check.
    """
    key = public_keys.get(signed.key_id)
    if key is None:
        raise errors.ReceiptInvalid(f"no approval public key has id {signed.key_id!r}")
    try:
        key.verify(bytes.fromhex(signed.signature), signed.receipt_bytes)
    except (InvalidSignature, ValueError):
        raise errors.ReceiptInvalid("the receipt's Ed25519 signature does not verify") from None
    try:
        receipt = json.loads(signed.receipt_bytes)
    except ValueError:
        raise errors.ReceiptInvalid("the receipt is not JSON") from None
    if not isinstance(receipt, dict) or receipt.keys() != RECEIPT_MEMBERS:
        raise errors.ReceiptInvalid("the receipt does not have the members of format 1")
    if canonical_bytes(receipt) != signed.receipt_bytes:
        raise errors.ReceiptInvalid("the receipt is not in canonical (RFC 8785) form")
    if (receipt["format"], receipt["kind"]) != (RECEIPT_FORMAT, KIND_RECEIPT):
        raise errors.ReceiptInvalid("unsupported receipt format or kind")
    if receipt["key_id"] != signed.key_id:
        raise errors.ReceiptInvalid("the receipt names another signing key than it was signed with")
    if receipt["decision"] not in (APPROVE, REJECT):
        raise errors.ReceiptInvalid(f"unknown decision {receipt['decision']!r}")
    if not isinstance(receipt["transition_digest"], str) or not HEX_256.match(
        receipt["transition_digest"]
    ):
        raise errors.ReceiptInvalid("transition_digest must be 64 lower-case hex characters")
    if not isinstance(receipt["nonce"], str) or not re.fullmatch(r"[0-9a-f]{32}", receipt["nonce"]):
        raise errors.ReceiptInvalid("nonce must be 32 lower-case hex characters")
    issued, expires = _parse_time(receipt["issued_at"]), _parse_time(receipt["expires_at"])
    if not issued <= now < expires:
        raise errors.ReceiptExpired(
            f"the receipt is valid from {receipt['issued_at']} until {receipt['expires_at']}"
        )
    return receipt


# --- keys -------------------------------------------------------------------------------


def write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def generate_signing_key(private_path: Path, public_path: Path, key_id: str) -> None:
    """A new Ed25519 signing key (PEM, mode 0600) and the public keyring that verifies it."""
    if not KEY_ID.match(key_id):
        raise KeyFileError("key id must be 1-64 characters of [A-Za-z0-9._-]")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    write_private(private_path, pem)
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    public_path.parent.mkdir(parents=True, exist_ok=True)
    public_path.write_text(json.dumps({key_id: base64.b64encode(raw).decode()}, indent=2))


def add_signing_key(private_path: Path, public_path: Path, key_id: str) -> None:
    """A new Ed25519 signing key (PEM, mode 0600), its public half added to the public
    keyring at ``public_path`` (created if missing) under ``key_id``, which must be
    new there: rotating keeps the old public keys, so old signatures still verify.
    Nothing is written if the private file exists or the key id is taken."""
    if not KEY_ID.match(key_id):
        raise KeyFileError("key id must be 1-64 characters of [A-Za-z0-9._-]")
    if private_path.exists():
        raise KeyFileError(f"{private_path}: exists; a signing key is never overwritten")
    keyring: dict[str, str] = {}
    if public_path.exists():
        load_public_keys(public_path)  # refuses a malformed keyring before anything changes
        keyring = json.loads(public_path.read_text())
        if key_id in keyring:
            raise KeyFileError(f"{public_path}: already holds key id {key_id!r}")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    keyring[key_id] = base64.b64encode(raw).decode()
    write_private(private_path, pem)
    public_path.parent.mkdir(parents=True, exist_ok=True)
    public_path.write_text(json.dumps(keyring, indent=2))


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read the signing key ({exc.strerror})") from None
    except ValueError:
        raise KeyFileError(f"{path}: not a PEM private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path}: the approval signing key must be Ed25519")
    return key


def load_public_keys(path: Path) -> dict[str, Ed25519PublicKey]:
    """``{"<key id>": "<base64 of the 32-byte raw Ed25519 public key>", ...}``."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise KeyFileError(f"{path}: cannot read approval public keys ({exc.strerror})") from None
    except ValueError:
        raise KeyFileError(f"{path}: approval public keys must be a JSON object") from None
    if not isinstance(doc, dict) or not doc:
        raise KeyFileError(f"{path}: approval public keys must be a non-empty JSON object")
    keys: dict[str, Ed25519PublicKey] = {}
    for key_id, encoded in doc.items():
        if not KEY_ID.match(key_id):
            raise KeyFileError(
                f"{path}: key id {key_id!r} must be 1-64 characters of [A-Za-z0-9._-]"
            )
        try:
            keys[key_id] = Ed25519PublicKey.from_public_bytes(
                base64.b64decode(str(encoded), validate=True)
            )
        except (binascii.Error, ValueError):
            raise KeyFileError(
                f"{path}: key {key_id!r} is not a base64 Ed25519 public key"
            ) from None
    return keys


def now_utc() -> datetime:
    return datetime.now(UTC)
