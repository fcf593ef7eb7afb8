"""How tests/vectors/transition-digests/*.json were made: rebuilding the transition digest
a reviewer approved from a committed record and the risk rules its proposal matched
(docs/policy.md, "the transition digest"; ``ztate.contract.record.transition_digest``),
one file per way to get it right or wrong, so that a client in any language checks its
rebuild against the same bytes. The test never regenerates them; run with --write after
an intended format change.

Each file: ``record_json`` (the record's exact bytes, as text, as GetTransition sends
them), ``risk_rules`` (as GetTransitionResponse.risk_rules lists them), ``proposal_json``
(the canonical proposal a correct rebuild makes, as text), ``transition_digest`` (the
digest claimed, as a receipt's ``transition_digest`` holds it: in the wrong cases, what a
plausible mistake computes) and ``valid`` (whether a correct rebuild equals the claim).

The ``format-2-*`` files hold a format-2 record, which carries its matched risk rules
(sorted): their ``risk_rules`` is null, and the rebuild takes the rules from the record,
with no CEL evaluator and no server's list.
"""

from __future__ import annotations

import hashlib
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ztate.contract.canonical import canonical_bytes, sha256_hex
from ztate.contract.record import KIND_TRANSITION, build_proposal, build_record

RULES = ["refund-over-limit", "admin-flag"]  # as a server might list them: not sorted
RECORD = build_record(
    kind=KIND_TRANSITION,
    thread_id="vector-thread-1",
    version=4,
    parent_digest=sha256_hex(b"vector record 3"),
    node_id="spiffe://ztate.test/node/planner",
    patch={"is_admin": True, "refund": {"amount_cents": 250000, "note": "caf\u00e9 \u20ac"}},
    state_digest=sha256_hex(b"vector state 4"),
    policy_digest=sha256_hex(b"vector policy"),
    receipt_digest=sha256_hex(b"vector receipt"),
    key_id="vector-k1",
    committed_at=datetime(2026, 1, 2, 3, 5, 0, 7, tzinfo=UTC),
)
RECORD_BYTES = canonical_bytes(RECORD)
# the same transition, as the service writes it since record format 2
RECORD_2 = build_record(
    **{
        name: RECORD[name]
        for name in (
            "kind", "thread_id", "version", "parent_digest", "node_id", "patch",
            "state_digest", "policy_digest", "receipt_digest", "key_id",
        )
    },
    committed_at=datetime(2026, 1, 2, 3, 5, 0, 7, tzinfo=UTC),
    risk_rules=RULES,
)  # fmt: skip
RECORD_2_BYTES = canonical_bytes(RECORD_2)


def proposal(**changes: Any) -> dict[str, Any]:
    """The proposal a correct rebuild makes, with ``changes`` (a mistake) applied."""
    body = build_proposal(
        thread_id=RECORD["thread_id"],
        base_version=RECORD["version"] - 1,
        parent_digest=RECORD["parent_digest"],
        node_id=RECORD["node_id"],
        patch=RECORD["patch"],
        state_digest=RECORD["state_digest"],
        policy_digest=RECORD["policy_digest"],
        risk_rules=RULES,
    )
    return {**body, **changes}


CORRECT = canonical_bytes(proposal())


def case(
    name: str,
    why: str,
    claimed: str,
    *,
    valid: bool,
    rules: list[str] | None = RULES,
    record: bytes = RECORD_BYTES,
) -> dict[str, Any]:
    return {
        "name": name,
        "why": why,
        "record_json": record.decode(),
        "risk_rules": rules,
        "proposal_json": CORRECT.decode(),
        "transition_digest": claimed,
        "valid": valid,
    }


def digest_of(**changes: Any) -> str:
    return sha256_hex(canonical_bytes(proposal(**changes)))


CASES = [
    case(
        "valid",
        "the rebuild: rules sorted, base version = version - 1",
        sha256_hex(CORRECT),
        valid=True,
    ),
    case(
        "valid-rules-already-sorted",
        "the same digest whatever order risk_rules arrive in",
        sha256_hex(CORRECT),
        valid=True,
        rules=sorted(RULES),
    ),
    case(
        "rules-not-sorted",
        "the claim hashed risk_rules in the order received, unsorted",
        digest_of(risk_rules=RULES),
        valid=False,
    ),
    case(
        "rule-missing",
        "the claim covers one risk rule fewer",
        digest_of(risk_rules=sorted(RULES)[:1]),
        valid=False,
    ),
    case(
        "base-version-is-record-version",
        "the claim used the record's version as base_version (it is version - 1)",
        digest_of(base_version=RECORD["version"]),
        valid=False,
    ),
    case(
        "kind-transition",
        "the claim kept the record's kind (a proposal's kind is proposal)",
        digest_of(kind=KIND_TRANSITION),
        valid=False,
    ),
    case(
        "patch-differs",
        "the approved patch is not the committed one (another refund amount)",
        digest_of(patch={**RECORD["patch"], "refund": {"amount_cents": 25, "note": "x"}}),
        valid=False,
    ),
    case(
        "record-digest",
        "the claim is the record's own digest, not the transition digest",
        sha256_hex(RECORD_BYTES),
        valid=False,
    ),
    case(
        "not-canonical",
        "the claim hashed JSON with spaces and sorted keys, not RFC 8785",
        hashlib.sha256(
            json.dumps(proposal(), sort_keys=True, ensure_ascii=False).encode()
        ).hexdigest(),
        valid=False,
    ),
    case(
        "ascii-escaped",
        "the claim hashed non-ASCII text as \\u escapes (RFC 8785 writes UTF-8)",
        hashlib.sha256(
            json.dumps(proposal(), sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest(),
        valid=False,
    ),
    case(
        "uppercase-hex",
        "the right digest written in upper-case hex (digests are lower-case)",
        sha256_hex(CORRECT).upper(),
        valid=False,
    ),
    case(
        "format-2-valid",
        "a format-2 record: the rules it carries, sorted, make the same digest",
        sha256_hex(CORRECT),
        valid=True,
        rules=None,
        record=RECORD_2_BYTES,
    ),
    case(
        "format-2-rules-ignored",
        "the claim ignored the rules the format-2 record carries (hashed none)",
        digest_of(risk_rules=[]),
        valid=False,
        rules=None,
        record=RECORD_2_BYTES,
    ),
]


def main() -> None:
    folder = Path(__file__).resolve().parent / "transition-digests"
    for item in CASES:
        text = json.dumps(item, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        path = folder / f"{item['name']}.json"
        if "--write" in sys.argv:
            path.write_text(text, encoding="utf-8")
        elif not path.exists() or path.read_text(encoding="utf-8") != text:
            raise SystemExit(f"{path} is out of date: run with --write")


if __name__ == "__main__":
    main()
