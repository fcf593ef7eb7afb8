"""Approval receipts: a human decision bound to one exact transition, signed Ed25519.

The approval service signs receipts with a private key only it holds; the
transition service, workers and auditors hold the public keys. ``docs/approvals.md``
is the normative format; ``tests/vectors/receipt-v1.json`` holds fixed vectors and
``tests/vectors/receipts/`` one file per way a receipt can be right or wrong. In short::

    receipt_bytes  = JCS(receipt)                  # RFC 8785
    signature      = Ed25519.sign(private_key[key_id], receipt_bytes)
    receipt_digest = sha256(receipt_bytes)         # what the ledger record carries
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ztate.contract.canonical import JsonObject, canonical_bytes, sha256_hex
from ztate.contract.errors import ReceiptExpired, ReceiptInvalid
from ztate.contract.record import HEX_256, format_time, parse_time, shown, transition_digest
from ztate.contract.signed import signed_object

RECEIPT_FORMAT = 1
KIND_RECEIPT = "approval_receipt"
APPROVE, REJECT = "approve", "reject"
NONCE = re.compile(r"^[0-9a-f]{32}\Z")
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


def verify_receipt(
    signed: SignedReceipt, public_keys: dict[str, Ed25519PublicKey], *, now: datetime | None
) -> JsonObject:
    """Check a receipt's signature and form, and that it is valid at ``now``; return it
    parsed. ``now=None`` leaves the validity period to the caller (``check_receipt_binds``
    compares it with a record's commit time).

    Raises ``ReceiptInvalid`` (check ``receipt.signature`` or ``receipt.form``) or
    ``ReceiptExpired``. Nothing unsigned is ever parsed. What it authorises (its
    digest, thread and base version against a parked transition or a record, and that
    its nonce is fresh) is for the caller to check.
    """
    receipt = signed_object(
        signed.receipt_bytes,
        signed.signature,
        signed.key_id,
        public_keys,
        what="receipt",
        signer="approval",
        members=RECEIPT_MEMBERS,
        error=ReceiptInvalid,
    )
    if (receipt["format"], receipt["kind"]) != (RECEIPT_FORMAT, KIND_RECEIPT):
        raise ReceiptInvalid("unsupported receipt format or kind")
    if receipt["key_id"] != signed.key_id:
        raise ReceiptInvalid("the receipt names another signing key than it was signed with")
    if receipt["decision"] not in (APPROVE, REJECT):
        raise ReceiptInvalid(f"unknown decision {shown(receipt['decision'])}")
    if not isinstance(receipt["transition_digest"], str) or not HEX_256.match(
        receipt["transition_digest"]
    ):
        raise ReceiptInvalid("transition_digest must be 64 lower-case hex characters")
    if not isinstance(receipt["thread_id"], str) or type(receipt["base_version"]) is not int:
        raise ReceiptInvalid("thread_id must be a string and base_version an integer")
    reviewers = receipt["reviewers"]
    if not isinstance(reviewers, list) or not all(isinstance(r, str) for r in reviewers):
        raise ReceiptInvalid("reviewers must be a list of strings")
    if not isinstance(receipt["nonce"], str) or not NONCE.match(receipt["nonce"]):
        raise ReceiptInvalid("nonce must be 32 lower-case hex characters")
    issued, expires = validity(receipt)
    if now is not None and not issued <= now < expires:
        raise ReceiptExpired(
            f"the receipt is valid from {receipt['issued_at']} until {receipt['expires_at']}"
        )
    return receipt


def validity(receipt: JsonObject) -> tuple[datetime, datetime]:
    """A receipt's ``issued_at`` and ``expires_at``, each exactly as ``format_time``
    writes times; ``ReceiptInvalid`` otherwise."""
    issued, expires = parse_time(receipt["issued_at"]), parse_time(receipt["expires_at"])
    if issued is None or expires is None:
        raise ReceiptInvalid(
            "receipt times must be RFC 3339 UTC with exactly six fraction digits and a Z"
        )
    return issued, expires


def check_receipt_binds(
    receipt: JsonObject, receipt_bytes: bytes, record: JsonObject, risk_rules: list[str]
) -> None:
    """The verified ``receipt`` approves exactly this parsed ``record``: its digest is
    the record's ``receipt_digest`` (``receipt.digest``), it binds the record's thread,
    base version and transition digest with the decision to approve
    (``receipt.binding``), and it was valid when the record was committed
    (``receipt.expired``)."""
    if record["receipt_digest"] != sha256_hex(receipt_bytes):
        raise ReceiptInvalid("the record names another receipt", check="receipt.digest")
    expected = {
        "thread_id": record["thread_id"],
        "base_version": record["version"] - 1,
        "decision": APPROVE,
        "transition_digest": transition_digest(record, risk_rules),
    }
    for name, value in expected.items():
        if receipt[name] != value:
            raise ReceiptInvalid(f"the receipt binds another {name}", check="receipt.binding")
    committed = parse_time(record["committed_at"])
    issued, expires = validity(receipt)
    if committed is None or not issued <= committed < expires:
        raise ReceiptExpired(
            f"valid from {receipt['issued_at']} until {receipt['expires_at']}, "
            f"committed at {shown(record['committed_at'])}"
        )


def now_utc() -> datetime:
    return datetime.now(UTC)
