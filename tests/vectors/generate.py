"""How ``tests/vectors/ledger-v1.json`` and ``ledger-v2.json`` were made.

``ledger-v1.json`` is record format 1; ``ledger-v2.json`` the same thread in
format 2, whose records carry the names of the risk rules each transition matched
(``--format 2``). The v1 file was made once, kept as documentation; the v2 file is
compared with this script's output by tests/unit/test_chain_v2.py.

The vectors were generated once with this script and then cross-checked with tools
that share no code with ztate (a JavaScript JCS written from RFC 8785 section 3.2,
``sha256sum`` and ``openssl dgst -hmac``). The tests compare against the committed
JSON and never regenerate it, so a change in ``ztate.contract.canonical`` or
``ztate.contract.record`` that alters a byte fails them instead of silently moving the
expectations.

Print the vectors (to diff against the committed file)::

    .venv/bin/python -m tests.vectors.generate | diff - tests/vectors/ledger-v1.json
    .venv/bin/python -m tests.vectors.generate --format 2 | diff - tests/vectors/ledger-v2.json

Rewrite a file (only when the record format changes, as a new format version)::

    .venv/bin/python -m tests.vectors.generate [--format 2] --write
"""

from __future__ import annotations

import base64
import json
import sys
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from ztate.contract.canonical import canonical_bytes, parse_object, sha256_hex
from ztate.contract.keyring import Keyring
from ztate.contract.record import (
    GENESIS_PARENT,
    KIND_GENESIS,
    KIND_TRANSITION,
    build_record,
    seal,
    sign_digest,
)
from ztate.services.policy.changes import apply_patch

OUT = {1: Path(__file__).with_name("ledger-v1.json"), 2: Path(__file__).with_name("ledger-v2.json")}
# format 2: the risk rules each step matched, by version (as a server lists them:
# unsorted; records carry them sorted)
RISK_RULES = {0: [], 1: [], 2: ["budget-over-limit", "auto-approve-flag"]}
THREAD_ID = "vector-thread-1"
# Opaque to a verifier: any 64 lower-case hex characters.
POLICY_DIGEST = sha256_hex(b"ztate ledger-v1 test vector policy")
KEYS = {"vector-k1": bytes(range(0x00, 0x20)), "vector-k2": bytes(range(0x20, 0x40))}

# Each step: (description, kind, node_id, signing key id, committed_at, patch as sent).
STEPS: list[tuple[str, str, str, str, datetime, bytes]] = [
    (
        "genesis: the initial state applied to {}; integers at the I-JSON bounds",
        KIND_GENESIS,
        "spiffe://ztate.test/operator/vector-admin",
        "vector-k1",
        datetime(2025, 1, 2, 3, 4, 5, 6, tzinfo=UTC),
        b'{"goal": "book a flight", "budget_cents": 9007199254740991,'
        b' "floor": -9007199254740991, "approved": false, "tags": ["travel"],'
        b' "draft": "to be removed"}',
    ),
    (
        "transition: null removes 'draft'; non-ASCII and non-BMP text, control characters,"
        " nested objects and lists, a nested null that is kept, member names whose UTF-16"
        " order differs from their code point order",
        KIND_TRANSITION,
        "spiffe://ztate.test/node/planner",
        "vector-k1",
        datetime(2025, 1, 2, 3, 5, 0, 250000, tzinfo=UTC),
        b'{"draft": null, "itinerary": {"traveller": "Zo\\u00eb \\u00c5ngstr\\u00f6m",'
        b' "greeting": "\\u3053\\u3093\\u306b\\u3061\\u306f \\ud83d\\ude00",'
        b' "legs": [{"from": "OSL", "to": "NRT", "stops": []},'
        b' {"from": "NRT", "to": "SFO", "note": null}],'
        b' "names": {"\\ufb01": "U+FB01", "\\ud83d\\ude00": "U+1F600", "\\u20ac": "U+20AC",'
        b' "a": "U+0061", "": "empty name"}},'
        b' "memo": "tab\\tnewline\\nquote\\" backslash\\\\ ctl\\u0001 del\\u007f slash/"}',
    ),
    (
        "transition under the rotated key vector-k2: ECMAScript number formatting"
        " (1.5, 1e21, 1e-7, 0.000001, 1/3, -0.0, 4.0, largest double, smallest subnormal);"
        " null for a key that is absent is a no-op; committed_at given at +02:00",
        KIND_TRANSITION,
        "spiffe://ztate.test/node/pricer",
        "vector-k2",
        datetime(2025, 1, 2, 5, 6, 7, 890123, tzinfo=timezone(timedelta(hours=2))),
        b'{"quote": {"ratio": 1.5, "huge": 1e21, "tiny": 1e-7, "micro": 0.000001,'
        b' "third": 0.3333333333333333, "neg_zero": -0.0, "whole": 4.0,'
        b' "max_double": 1.7976931348623157e308, "min_subnormal": 5e-324},'
        b' "approved": true, "never_set": null}',
    ),
]


def keyring_document(current: str) -> dict[str, Any]:
    return {
        "current": current,
        "keys": {key_id: base64.b64encode(key).decode() for key_id, key in KEYS.items()},
    }


def build(form: int = 1) -> dict[str, Any]:
    records: list[dict[str, Any]] = []
    state: dict[str, Any] = {}
    parent = GENESIS_PARENT
    for version, (description, kind, node_id, key_id, committed_at, patch_json) in enumerate(STEPS):
        patch = parse_object(patch_json, what="patch")
        state = apply_patch({} if kind == KIND_GENESIS else state, patch)
        state_bytes = canonical_bytes(state)
        keyring = Keyring.from_json(json.dumps(keyring_document(key_id)), source="vectors")
        sealed = seal(
            build_record(
                kind=kind,
                thread_id=THREAD_ID,
                version=version,
                parent_digest=parent,
                node_id=node_id,
                patch=patch,
                state_digest=sha256_hex(state_bytes),
                policy_digest=POLICY_DIGEST,
                receipt_digest=None,
                key_id=key_id,
                committed_at=committed_at,
                risk_rules=None if form == 1 else RISK_RULES[version],
            ),
            keyring,
        )
        records.append(
            {
                "description": description,
                "patch_json": patch_json.decode(),
                "record": sealed.record,
                "canonical": sealed.record_bytes.decode(),
                "digest": sealed.digest,
                "signature": sealed.signature,
                "state": state,
                "state_canonical": state_bytes.decode(),
                "state_digest": sha256_hex(state_bytes),
            }
        )
        parent = sealed.digest
    return {
        "description": (
            f"ztate ledger record format {form} (docs/ledger-format.md): one thread of three"
            " records with their canonical bytes, digests, HMAC signatures and states,"
            " plus invalid variants a verifier must refuse. Made by tests/vectors/generate.py"
            + ("." if form == 1 else " --format 2.")
        ),
        "format": form,
        "keyring": {
            "document": keyring_document("vector-k2"),
            "keys_hex": {key_id: key.hex() for key_id, key in KEYS.items()},
        },
        "thread_id": THREAD_ID,
        "records": records,
        "invalid": invalid(records, form),
    }


def invalid(records: list[dict[str, Any]], form: int = 1) -> list[dict[str, Any]]:
    """Stored rows that must not verify, each with the first check that fails."""
    genesis, first = records[0], records[1]
    spaced = genesis["canonical"].replace(f'"format":{form}', f'"format": {form}', 1).encode()
    spaced_digest = sha256_hex(spaced)
    flipped = first["canonical"].replace('"version":1', '"version":2', 1)
    return [
        {
            "description": "record 0 with one space added: same JSON, digest and HMAC valid",
            "version": 0,
            "canonical": spaced.decode(),
            "digest": spaced_digest,
            "signature": sign_digest(KEYS["vector-k1"], spaced_digest),
            "error": "record bytes are not in canonical (RFC 8785) form",
        },
        {
            "description": "record 1 with one byte changed, stored digest and signature kept",
            "version": 1,
            "canonical": flipped,
            "digest": first["digest"],
            "signature": first["signature"],
            "error": "digest mismatch",
        },
        {
            "description": "record 1 carrying the signature of record 0",
            "version": 1,
            "canonical": first["canonical"],
            "digest": first["digest"],
            "signature": genesis["signature"],
            "error": "HMAC signature does not verify under key 'vector-k1'",
        },
    ] + (invalid_v2(records) if form == 2 else [])


def invalid_v2(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Format-2 records whose risk_rules are not a sorted list of distinct names,
    correctly hashed and signed: refused for their form."""
    risky = records[2]
    cases = []
    for description, rules in (
        ("record 2 with its risk_rules out of order", sorted(RISK_RULES[2], reverse=True)),
        ("record 2 with a risk rule named twice", sorted(RISK_RULES[2] * 2)),
        ("record 2 with a risk rule that is not a string", [1]),
    ):
        record = {**risky["record"], "risk_rules": rules}
        data = canonical_bytes(record)
        digest = sha256_hex(data)
        cases.append(
            {
                "description": description,
                "version": 2,
                "canonical": data.decode(),
                "digest": digest,
                "signature": sign_digest(KEYS["vector-k2"], digest),
                "error": "risk_rules is not",
            }
        )
    record = {key: value for key, value in risky["record"].items() if key != "risk_rules"}
    data = canonical_bytes(record)
    digest = sha256_hex(data)
    cases.append(
        {
            "description": "record 2 of format 2 without risk_rules",
            "version": 2,
            "canonical": data.decode(),
            "digest": digest,
            "signature": sign_digest(KEYS["vector-k2"], digest),
            "error": "missing members ['risk_rules']",
        }
    )
    return cases


def render(form: int = 1) -> str:
    return json.dumps(build(form), indent=2, ensure_ascii=True) + "\n"


def main(argv: list[str]) -> None:
    form = 1
    if argv[:2] == ["--format", "2"]:
        form, argv = 2, argv[2:]
    text = render(form)
    if argv == ["--write"]:
        OUT[form].write_text(text, encoding="ascii")
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main(sys.argv[1:])
