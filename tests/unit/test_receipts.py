"""Approval receipts against fixed vectors, and every way a receipt can be wrong.

The vectors' signatures were also checked independently with
``openssl pkeyutl -verify -rawin`` against the vector public key.
"""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ztate.contract.canonical import canonical_bytes
from ztate.contract.errors import ReceiptExpired, ReceiptInvalid
from ztate.contract.keyring import generate_signing_key, load_public_keys, load_signing_key
from ztate.contract.receipts import SignedReceipt, build_receipt, sign_receipt, verify_receipt

VECTORS = json.loads(
    (Path(__file__).resolve().parents[1] / "vectors" / "receipt-v1.json").read_text()
)
KEY_ID = VECTORS["key_id"]
PRIVATE = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(VECTORS["private_seed_hex"]))
PUBLIC = {
    KEY_ID: Ed25519PublicKey.from_public_bytes(base64.b64decode(VECTORS["public_key_base64"]))
}
DURING = datetime(2026, 1, 2, 3, 5, tzinfo=UTC)
CASES = VECTORS["cases"]


@pytest.mark.parametrize("case", CASES, ids=[c["receipt"]["decision"] for c in CASES])
def test_vectors_canonical_bytes_digest_and_signature(case: dict[str, Any]) -> None:
    signed = sign_receipt(case["receipt"], PRIVATE)
    assert signed.receipt_bytes == case["canonical"].encode()
    assert signed.digest == case["receipt_digest"]
    assert signed.digest == hashlib.sha256(case["canonical"].encode()).hexdigest()
    assert signed.signature == case["signature"]  # Ed25519 is deterministic
    assert verify_receipt(signed, PUBLIC, now=DURING) == case["receipt"]


def test_build_receipt_sorts_reviewers_and_draws_a_fresh_nonce() -> None:
    kwargs: dict[str, Any] = {
        "transition_digest": "a" * 64,
        "thread_id": "t",
        "base_version": 0,
        "decision": "approve",
        "reviewers": ["spiffe://d/reviewer/zed", "spiffe://d/reviewer/amy"],
        "issued_at": DURING,
        "expires_at": DURING + timedelta(minutes=10),
        "key_id": KEY_ID,
    }
    first, second = build_receipt(**kwargs), build_receipt(**kwargs)
    assert first["reviewers"] == ["spiffe://d/reviewer/amy", "spiffe://d/reviewer/zed"]
    assert first["nonce"] != second["nonce"]
    assert len(first["nonce"]) == 32


def signed(case: dict[str, Any], **changes: Any) -> SignedReceipt:
    return sign_receipt({**case["receipt"], **changes}, PRIVATE)


def test_a_receipt_signed_with_another_key_is_refused() -> None:
    forged = sign_receipt(CASES[0]["receipt"], Ed25519PrivateKey.generate())
    with pytest.raises(ReceiptInvalid, match="signature does not verify"):
        verify_receipt(forged, PUBLIC, now=DURING)


def test_a_changed_byte_breaks_the_signature() -> None:
    good = signed(CASES[0])
    tampered = SignedReceipt(
        good.receipt_bytes.replace(b'"base_version":3', b'"base_version":4'),
        good.signature,
        good.key_id,
    )
    with pytest.raises(ReceiptInvalid, match="signature does not verify"):
        verify_receipt(tampered, PUBLIC, now=DURING)


@pytest.mark.parametrize(
    ("now", "expected"),
    [
        (datetime(2026, 1, 2, 3, 14, 5, 6, tzinfo=UTC), ReceiptExpired),
        (datetime(2026, 1, 2, 3, 4, 5, 5, tzinfo=UTC), ReceiptExpired),
    ],
    ids=["at-expiry", "before-issue"],
)
def test_outside_its_validity_period(now: datetime, expected: type[Exception]) -> None:
    with pytest.raises(expected, match="the receipt is valid from"):
        verify_receipt(signed(CASES[0]), PUBLIC, now=now)


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"decision": "maybe"}, "unknown decision"),
        ({"format": 2}, "unsupported receipt format"),
        ({"kind": "other"}, "unsupported receipt format"),
        ({"nonce": "short"}, "nonce must be 32"),
        ({"transition_digest": "XYZ"}, "transition_digest must be 64"),
        ({"issued_at": "2026-01-02T03:04:05+01:00"}, "six fraction digits and a Z"),
        ({"extra": 1}, "members of format 1"),
    ],
)
def test_malformed_receipts_signed_by_the_right_key_are_still_refused(
    changes: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ReceiptInvalid, match=fragment):
        verify_receipt(signed(CASES[0], **changes), PUBLIC, now=DURING)


def test_a_receipt_naming_another_key_than_it_was_signed_with() -> None:
    other = signed(CASES[0], key_id="someone-else")
    relabelled = SignedReceipt(other.receipt_bytes, other.signature, KEY_ID)
    with pytest.raises(ReceiptInvalid, match="names another signing key"):
        verify_receipt(relabelled, PUBLIC, now=DURING)


def test_non_canonical_bytes_are_refused_even_when_signed() -> None:
    spaced = json.dumps(CASES[0]["receipt"], indent=1).encode()
    assert json.loads(spaced) == CASES[0]["receipt"]
    receipt = SignedReceipt(spaced, PRIVATE.sign(spaced).hex(), KEY_ID)
    with pytest.raises(ReceiptInvalid, match="canonical"):
        verify_receipt(receipt, PUBLIC, now=DURING)


def test_unknown_key_id_and_garbage_signature() -> None:
    good = signed(CASES[0])
    with pytest.raises(ReceiptInvalid, match="no approval public key"):
        verify_receipt(
            SignedReceipt(good.receipt_bytes, good.signature, "nope"), PUBLIC, now=DURING
        )
    with pytest.raises(ReceiptInvalid, match="signature does not verify"):
        verify_receipt(SignedReceipt(good.receipt_bytes, "zz", KEY_ID), PUBLIC, now=DURING)


def test_generated_keys_round_trip_and_stay_private(tmp_path: Path) -> None:
    private_path, public_path = tmp_path / "a" / "signing.pem", tmp_path / "b" / "public.json"
    generate_signing_key(private_path, public_path, "k9")
    assert private_path.stat().st_mode & 0o077 == 0
    key, public = load_signing_key(private_path), load_public_keys(public_path)
    receipt = sign_receipt({**CASES[0]["receipt"], "key_id": "k9"}, key)
    assert verify_receipt(receipt, public, now=DURING)["key_id"] == "k9"
    assert canonical_bytes(json.loads(receipt.receipt_bytes)) == receipt.receipt_bytes


@pytest.mark.parametrize(
    ("member", "value", "server_says"),
    [
        # the server took times without microseconds; the SDK refused them
        ("issued_at", "2026-01-02T03:04:05Z", "six fraction digits"),
        ("expires_at", "2026-01-02T03:14:05.5Z", "six fraction digits"),
        ("issued_at", "2026-01-02T03:04:05.000000+00:00", "six fraction digits"),
        # the SDK took any nonce; the server refused these
        ("nonce", "ABCDEF0123456789abcdef0123456789", "nonce must be 32 lower-case hex"),
        ("nonce", "short", "nonce must be 32 lower-case hex"),
    ],
)
def test_what_the_two_former_copies_disagreed_on_is_refused_with_or_without_a_clock(
    member: str, value: str, server_says: str
) -> None:
    """Issue 12: the server's and the SDK's copies of the receipt check disagreed on
    these; the one contract check refuses them for the service (which passes its
    clock) and for a worker or auditor (who compares with the commit time)."""
    receipt = {**CASES[0]["receipt"], member: value}
    signed = sign_receipt(receipt, PRIVATE)
    with pytest.raises(ReceiptInvalid, match=server_says):
        verify_receipt(signed, PUBLIC, now=DURING)
    with pytest.raises(ReceiptInvalid, match=server_says):
        verify_receipt(signed, PUBLIC, now=None)
