"""How tests/vectors/receipts/*.json were made: one file per way a receipt can be right or
wrong (as transparency-dev/merkle's testdata does), each with the exact signed bytes, so
that an implementation in any language can run them. The test never regenerates them;
run with --write after an intended format change.

Each file: ``receipt_json`` (the exact bytes, as text), ``signature`` (hex), ``key_id``,
``public_key_base64`` (the key that verifies it: the vector key of receipt-v1.json, or
another), and ``valid`` (whether a verifier must accept its signature and form). The
checks of validity period and binding are not in these files (they need a clock and a
transition).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from tests.vectors._signing import public_b64, signed_case
from ztate.contract.canonical import canonical_bytes

SEED = bytes(range(32, 64))  # the receipt-v1.json key
OTHER_SEED = bytes(range(64, 96))
KEY_ID = "vector-approval-k1"
GOOD: dict[str, Any] = {
    "format": 1,
    "kind": "approval_receipt",
    "transition_digest": hashlib.sha256(b"vector proposal").hexdigest(),
    "thread_id": "vector-thread-1",
    "base_version": 3,
    "decision": "approve",
    "reviewers": ["spiffe://ztate.test/reviewer/alice"],
    "issued_at": "2026-01-02T03:04:05.000006Z",
    "expires_at": "2026-01-02T03:14:05.000006Z",
    "nonce": "00112233445566778899aabbccddeeff",
    "key_id": KEY_ID,
}


def case(
    name: str,
    why: str,
    members: dict[str, Any],
    *,
    valid: bool,
    data: bytes | None = None,
    seed: bytes = SEED,
    flip_bit: bool = False,
    upper: bool = False,
) -> dict[str, Any]:
    body, signature = signed_case(members, data, seed, flip_bit=flip_bit)
    if upper:
        signature = signature.upper()
    return {
        "name": name,
        "why": why,
        "receipt_json": body.decode(),
        "signature": signature,
        "key_id": KEY_ID,
        "public_key_base64": public_b64(SEED),
        "valid": valid,
    }


def without(name: str) -> dict[str, Any]:
    return {k: v for k, v in GOOD.items() if k != name}


CASES = [
    case("valid", "a well-formed receipt under the vector key", GOOD, valid=True),
    case(
        "signature-bit-flipped",
        "one bit of the signature changed",
        GOOD,
        valid=False,
        flip_bit=True,
    ),
    case(
        "signed-by-another-key",
        "signed by a key the keyring does not hold under this id",
        GOOD,
        valid=False,
        seed=OTHER_SEED,
    ),
    case(
        "not-canonical",
        "the signed bytes are JSON but not RFC 8785 (spaces)",
        GOOD,
        valid=False,
        data=json.dumps(GOOD, sort_keys=True).encode(),
    ),
    case(
        "time-without-microseconds",
        "issued_at has no fraction digits",
        {**GOOD, "issued_at": "2026-01-02T03:04:05Z"},
        valid=False,
    ),
    case(
        "time-with-offset",
        "expires_at is not UTC with a Z",
        {**GOOD, "expires_at": "2026-01-02T03:14:05.000006+00:00"},
        valid=False,
    ),
    case(
        "nonce-uppercase",
        "the nonce is not lower-case hex",
        {**GOOD, "nonce": "00112233445566778899AABBCCDDEEFF"},
        valid=False,
    ),
    case(
        "nonce-short",
        "the nonce is not 32 hex characters",
        {**GOOD, "nonce": "0011223344"},
        valid=False,
    ),
    case(
        "transition-digest-uppercase",
        "the transition digest is not lower-case hex",
        {**GOOD, "transition_digest": GOOD["transition_digest"].upper()},
        valid=False,
    ),
    case("member-missing", "no nonce member", without("nonce"), valid=False),
    case(
        "member-extra",
        "a member format 1 does not have",
        {**GOOD, "note": "approved by phone"},
        valid=False,
    ),
    case("wrong-kind", "kind is not approval_receipt", {**GOOD, "kind": "checkpoint"}, valid=False),
    case("wrong-format", "format is not 1", {**GOOD, "format": 2}, valid=False),
    case(
        "format-true",
        "format is the JSON true, not the integer 1 (Python's True == 1 must not pass it)",
        {**GOOD, "format": True},
        valid=False,
    ),
    case(
        "signature-uppercase",
        "the genuine signature written in upper-case hex: one way of writing it is taken",
        GOOD,
        valid=False,
        upper=True,
    ),
    case(
        "lone-surrogate",
        "thread_id holds a lone surrogate (\\ud800): not Unicode text, which I-JSON refuses",
        GOOD,
        valid=False,
        data=canonical_bytes({**GOOD, "thread_id": "LONE"}).replace(b'"LONE"', b'"\\ud800"'),
    ),
    case(
        "integer-beyond-2-53",
        "base_version is 2^53, an integer I-JSON cannot carry exactly",
        GOOD,
        valid=False,
        data=canonical_bytes({**GOOD, "base_version": 123454321}).replace(
            b"123454321", b"9007199254740992"
        ),
    ),
    case(
        "key-id-mismatch",
        "the receipt names another key id than it is checked under",
        {**GOOD, "key_id": "another-key"},
        valid=False,
    ),
]


def main() -> None:
    folder = Path(__file__).resolve().parent / "receipts"
    for item in CASES:
        text = json.dumps(item, indent=2, sort_keys=True) + "\n"
        path = folder / f"{item['name']}.json"
        if "--write" in sys.argv:
            path.write_text(text, encoding="utf-8")
        elif not path.exists() or path.read_text(encoding="utf-8") != text:
            raise SystemExit(f"{path} is out of date: run with --write")


if __name__ == "__main__":
    main()
