"""Checking approval receipts and checkpoints with public keys only.

The byte formats are those of docs/approvals.md (receipts), docs/policy.md (the
transition digest) and docs/verification.md (checkpoints); the server's own code
(``ztate.services.receipts``, ``ztate.services.checkpoints``) is not imported, so a worker
holds no server module. ``tests/unit/test_sdk_evidence.py`` checks both sides
agree, on the fixed vectors too.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import rfc8785
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

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
CHECKPOINT_MEMBERS = frozenset(
    {"format", "kind", "thread_id", "version", "head_digest", "signed_at", "key_id"}
)
KEY_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}\Z")
HEX_256 = re.compile(r"^[0-9a-f]{64}\Z")
NONCE = re.compile(r"[0-9a-f]{32}")
TIME = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z\Z")

PublicKeys = dict[str, Ed25519PublicKey]


class EvidenceError(ValueError):
    """Evidence that does not verify; ``check`` names the failed check."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"{check}: {message}")
        self.check = check
        self.message = message


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical(value: Any, check: str = "form") -> bytes:
    """RFC 8785 bytes of a JSON value; a value outside its domain (an integer
    beyond I-JSON, NaN, a non-JSON type) is ``EvidenceError(check)``."""
    try:
        return rfc8785.dumps(value)
    except (rfc8785.CanonicalizationError, TypeError, ValueError):
        raise EvidenceError(check, "a value has no RFC 8785 form") from None


def parse_json(data: bytes, check: str) -> dict[str, Any]:
    """A JSON object in its own canonical (RFC 8785) form, or ``EvidenceError(check)``."""
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise EvidenceError(check, "not JSON") from None
    if not isinstance(body, dict):
        raise EvidenceError(check, "not a JSON object")
    if canonical(body, check) != data:
        raise EvidenceError(check, "not in canonical (RFC 8785) form")
    return body


def parse_time(text: Any, check: str) -> datetime:
    if not isinstance(text, str) or not TIME.match(text):
        raise EvidenceError(check, "times must be RFC 3339 UTC with microseconds and a Z")
    try:
        return datetime.fromisoformat(text[:-1] + "+00:00")
    except ValueError:
        raise EvidenceError(check, "not a valid time") from None


def load_public_keys(path: str | Path) -> PublicKeys:
    """A public keyring file: ``{"<key id>": "<base64 of the raw 32-byte Ed25519 key>"}``."""
    doc = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(doc, dict) or not doc:
        raise ValueError(f"{path}: public keys must be a non-empty JSON object")
    keys: PublicKeys = {}
    for key_id, encoded in doc.items():
        if not KEY_ID.match(key_id):
            raise ValueError(f"{path}: key id {key_id!r} must match {KEY_ID.pattern}")
        try:
            raw = base64.b64decode(str(encoded), validate=True)
            keys[key_id] = Ed25519PublicKey.from_public_bytes(raw)
        except (binascii.Error, ValueError):
            raise ValueError(f"{path}: key {key_id!r} is not a base64 Ed25519 key") from None
    return keys


def _signed_json(
    data: bytes, signature: str, key_id: str, keys: PublicKeys, what: str
) -> dict[str, Any]:
    """Verify an Ed25519 signature over ``data`` and return it parsed, if it is
    an object in its own canonical form."""
    key = keys.get(key_id)
    if key is None:
        raise EvidenceError(f"{what}.signature", f"no public key has id {key_id!r}")
    try:
        key.verify(bytes.fromhex(signature), data)
    except (InvalidSignature, ValueError, TypeError):
        raise EvidenceError(f"{what}.signature", "the Ed25519 signature does not verify") from None
    # parsed only now: nothing unsigned is ever interpreted
    return parse_json(data, f"{what}.form")


def verify_receipt(
    receipt_json: bytes, signature: str, key_id: str, keys: PublicKeys
) -> dict[str, Any]:
    """A receipt's signature and form (format 1); returns its members."""
    receipt = _signed_json(receipt_json, signature, key_id, keys, "receipt")
    if receipt.keys() != RECEIPT_MEMBERS:
        raise EvidenceError("receipt.form", "the receipt does not have the members of format 1")
    if (receipt["format"], receipt["kind"], receipt["key_id"]) != (1, "approval_receipt", key_id):
        raise EvidenceError("receipt.form", "unsupported receipt format, kind or key id")
    if not isinstance(receipt["transition_digest"], str) or not HEX_256.match(
        receipt["transition_digest"]
    ):
        raise EvidenceError("receipt.form", "transition_digest must be 64 lower-case hex")
    # as the transition service checks it (services/receipts.py): the copies agree
    if not isinstance(receipt["nonce"], str) or not NONCE.fullmatch(receipt["nonce"]):
        raise EvidenceError("receipt.form", "nonce must be 32 lower-case hex characters")
    return receipt


RECORD_MEMBERS = frozenset(
    {
        "format",
        "kind",
        "thread_id",
        "version",
        "parent_digest",
        "node_id",
        "patch",
        "state_digest",
        "policy_digest",
        "receipt_digest",
        "key_id",
        "committed_at",
    }
)


def parse_record(record_json: bytes) -> dict[str, Any]:
    """A ledger record (docs/ledger-format.md): canonical JSON with the members of
    format 1 and the types the checks below rely on."""
    record = parse_json(record_json, "record.form")
    if record.keys() != RECORD_MEMBERS:
        raise EvidenceError("record.form", "the record does not have the members of format 1")
    if not (
        isinstance(record["thread_id"], str)
        and type(record["version"]) is int
        and record["version"] >= 0
        and isinstance(record["patch"], dict)
        and (record["receipt_digest"] is None or isinstance(record["receipt_digest"], str))
    ):
        raise EvidenceError("record.form", "a member of the record has the wrong type")
    parse_time(record["committed_at"], "record.form")
    return record


def transition_digest(record: dict[str, Any], risk_rules: list[str]) -> str:
    """The digest a reviewer approved, rebuilt from the committed record and the
    rules its proposal matched (docs/policy.md, "the transition digest")."""
    proposal = {
        "format": record["format"],
        "kind": "proposal",
        "thread_id": record["thread_id"],
        "base_version": record["version"] - 1,
        "parent_digest": record["parent_digest"],
        "node_id": record["node_id"],
        "patch": record["patch"],
        "state_digest": record["state_digest"],
        "policy_digest": record["policy_digest"],
        "risk_rules": sorted(risk_rules),
    }
    return sha256_hex(canonical(proposal, "record.form"))


def check_receipt_binds(
    receipt: dict[str, Any], receipt_json: bytes, record: dict[str, Any], risk_rules: list[str]
) -> None:
    """The receipt approves exactly this record: its digest is the record's
    ``receipt_digest``, it binds the record's thread, base version and transition
    digest, and it was valid when the record was committed."""
    if record.get("receipt_digest") != sha256_hex(receipt_json):
        raise EvidenceError("receipt.digest", "the record names another receipt")
    expected = {
        "thread_id": record["thread_id"],
        "base_version": record["version"] - 1,
        "decision": "approve",
        "transition_digest": transition_digest(record, risk_rules),
    }
    for name, value in expected.items():
        if receipt[name] != value:
            raise EvidenceError("receipt.binding", f"the receipt binds another {name}")
    committed = parse_time(record["committed_at"], "record.form")
    issued = parse_time(receipt["issued_at"], "receipt.form")
    expires = parse_time(receipt["expires_at"], "receipt.form")
    if not issued <= committed < expires:
        raise EvidenceError(
            "receipt.expired",
            f"valid from {receipt['issued_at']} until {receipt['expires_at']}, "
            f"committed at {record['committed_at']}",
        )


def verify_checkpoint(
    checkpoint_json: bytes, signature: str, key_id: str, keys: PublicKeys
) -> dict[str, Any]:
    """A checkpoint's signature and form (format 1); returns its members."""
    body = _signed_json(checkpoint_json, signature, key_id, keys, "checkpoint")
    if body.keys() != CHECKPOINT_MEMBERS:
        raise EvidenceError(
            "checkpoint.form", "the checkpoint does not have the members of format 1"
        )
    if (body["format"], body["kind"], body["key_id"]) != (1, "checkpoint", key_id):
        raise EvidenceError("checkpoint.form", "unsupported checkpoint format, kind or key id")
    if not (
        isinstance(body["thread_id"], str)
        and type(body["version"]) is int
        and isinstance(body["head_digest"], str)
    ):
        raise EvidenceError("checkpoint.form", "a member of the checkpoint has the wrong type")
    return body


def now_utc() -> datetime:
    return datetime.now(UTC)
