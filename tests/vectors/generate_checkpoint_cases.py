"""How tests/vectors/checkpoints/*.json were made: one file per way a signed checkpoint
(``ztate.contract.checkpoints``, docs/verification.md) can be right or wrong, as
tests/vectors/receipts/ does for receipts, so that a client in any language runs the
same files. The test never regenerates them; run with --write after an intended
format change.

Each file: ``checkpoint_json`` (the exact signed bytes, as text), ``signature`` (hex),
``key_id``, ``public_key_base64`` (the raw Ed25519 key it is checked under, as the
only key of that id), ``valid`` (whether a verifier must accept its signature and
form), ``head`` (the head a worker read: ``thread_id``, ``version``, ``digest``) and
``binds`` (whether it is valid and names exactly that head, as the check before
acting requires).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from tests.vectors._signing import public_b64, signed_case

SEED = bytes(range(96, 128))
OTHER_SEED = bytes(range(128, 160))
KEY_ID = "vector-checkpoint-k1"
HEAD = {
    "thread_id": "vector-thread-1",
    "version": 4,
    "digest": hashlib.sha256(b"vector record 4").hexdigest(),
}
GOOD: dict[str, Any] = {
    "format": 1,
    "kind": "checkpoint",
    "thread_id": HEAD["thread_id"],
    "version": HEAD["version"],
    "head_digest": HEAD["digest"],
    "signed_at": "2026-01-02T03:06:00.000008Z",
    "key_id": KEY_ID,
}


def case(
    name: str,
    why: str,
    members: dict[str, Any],
    *,
    valid: bool,
    binds: bool | None = None,
    data: bytes | None = None,
    seed: bytes = SEED,
    flip_bit: bool = False,
) -> dict[str, Any]:
    body, signature = signed_case(members, data, seed, flip_bit=flip_bit)
    return {
        "name": name,
        "why": why,
        "checkpoint_json": body.decode(),
        "signature": signature,
        "key_id": KEY_ID,
        "public_key_base64": public_b64(SEED),
        "valid": valid,
        "head": HEAD,
        "binds": valid if binds is None else binds,
    }


def without(name: str) -> dict[str, Any]:
    return {k: v for k, v in GOOD.items() if k != name}


CASES = [
    case("valid", "a checkpoint of exactly the head read, under the vector key", GOOD, valid=True),
    case(
        "signature-bit-flipped",
        "one bit of the signature changed",
        GOOD,
        valid=False,
        flip_bit=True,
    ),
    case(
        "signed-by-another-key",
        "signed by a key not held under this id",
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
    case("member-missing", "no signed_at member", without("signed_at"), valid=False),
    case("member-extra", "a member format 1 does not have", {**GOOD, "note": "x"}, valid=False),
    case("wrong-kind", "kind is not checkpoint", {**GOOD, "kind": "approval_receipt"}, valid=False),
    case("wrong-format", "format is not 1", {**GOOD, "format": 2}, valid=False),
    case(
        "key-id-mismatch",
        "the checkpoint names another key id than it is checked under",
        {**GOOD, "key_id": "another-key"},
        valid=False,
    ),
    case(
        "head-digest-uppercase",
        "head_digest is not lower-case hex",
        {**GOOD, "head_digest": HEAD["digest"].upper()},
        valid=False,
    ),
    case("version-negative", "version is below 0", {**GOOD, "version": -1}, valid=False),
    case(
        "version-string", "version is a string, not a number", {**GOOD, "version": "4"}, valid=False
    ),
    case(
        "time-with-offset",
        "signed_at is not UTC with a Z",
        {**GOOD, "signed_at": "2026-01-02T03:06:00.000008+00:00"},
        valid=False,
    ),
    case(
        "time-without-microseconds",
        "signed_at has no fraction digits",
        {**GOOD, "signed_at": "2026-01-02T03:06:00Z"},
        valid=False,
    ),
    case(
        "other-thread",
        "valid, but a checkpoint of another thread",
        {**GOOD, "thread_id": "vector-thread-2"},
        valid=True,
        binds=False,
    ),
    case(
        "older-version",
        "valid, but of an earlier head (the head moved since it was signed)",
        {**GOOD, "version": 3, "head_digest": hashlib.sha256(b"vector record 3").hexdigest()},
        valid=True,
        binds=False,
    ),
    case(
        "other-head-digest",
        "valid, right version, but another record digest (a forked chain)",
        {**GOOD, "head_digest": hashlib.sha256(b"a forked record 4").hexdigest()},
        valid=True,
        binds=False,
    ),
]


def main() -> None:
    folder = Path(__file__).resolve().parent / "checkpoints"
    for item in CASES:
        text = json.dumps(item, indent=2, sort_keys=True) + "\n"
        path = folder / f"{item['name']}.json"
        if "--write" in sys.argv:
            path.write_text(text, encoding="utf-8")
        elif not path.exists() or path.read_text(encoding="utf-8") != text:
            raise SystemExit(f"{path} is out of date: run with --write")


if __name__ == "__main__":
    main()
