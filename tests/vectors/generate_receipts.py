"""How tests/vectors/receipt-v1.json was made (the test never regenerates it).

Ed25519 signatures are deterministic (RFC 8032), so a fixed private key and
fixed receipts give fixed bytes, digests and signatures. Run with --write to
rewrite the file after an intended format change.
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ztate.contract.receipts import build_receipt, sign_receipt

SEED = bytes(range(32, 64))
KEY_ID = "vector-approval-k1"


def main() -> None:
    key = Ed25519PrivateKey.from_private_bytes(SEED)
    public = key.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    cases = []
    for decision, reviewers, nonce in (
        ("approve", ["spiffe://ztate.test/reviewer/alice"], "00112233445566778899aabbccddeeff"),
        (
            "approve",
            ["spiffe://ztate.test/reviewer/bob", "spiffe://ztate.test/reviewer/alice"],
            "ffeeddccbbaa99887766554433221100",
        ),
        ("reject", ["spiffe://ztate.test/reviewer/alice"], "0123456789abcdef0123456789abcdef"),
    ):
        receipt = build_receipt(
            transition_digest=hashlib.sha256(b"vector proposal").hexdigest(),
            thread_id="vector-thread-1",
            base_version=3,
            decision=decision,
            reviewers=reviewers,
            issued_at=datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC),
            expires_at=datetime(2026, 1, 2, 3, 14, 5, 6, tzinfo=UTC),
            key_id=KEY_ID,
            nonce=nonce,
        )
        signed = sign_receipt(receipt, key)
        cases.append(
            {
                "receipt": receipt,
                "canonical": signed.receipt_bytes.decode(),
                "receipt_digest": signed.digest,
                "signature": signed.signature,
            }
        )
    doc = {
        "description": "Approval receipt format 1 vectors; see docs/approvals.md",
        "key_id": KEY_ID,
        "private_seed_hex": SEED.hex(),
        "public_key_base64": base64.b64encode(public).decode(),
        "cases": cases,
    }
    text = json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
    if "--write" in sys.argv:
        Path(__file__).with_name("receipt-v1.json").write_text(text, encoding="utf-8")
    else:
        print(text)


if __name__ == "__main__":
    main()
