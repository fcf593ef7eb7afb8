"""ztate.contract.record against tests/vectors/ledger-v2.json: record format 2, whose
records carry the names of the risk rules each transition matched, sorted, so that
a receipt's binding is checked offline with no CEL evaluator. Format 1 stays
readable (tests/unit/test_chain.py)."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.vectors import generate
from ztate.contract.canonical import canonical_bytes, parse_object, sha256_hex
from ztate.contract.errors import RecordInvalid
from ztate.contract.keyring import Keyring
from ztate.contract.record import (
    RECORD_FORMAT,
    build_proposal,
    build_record,
    parse_record,
    record_risk_rules,
    transition_digest,
    verify_record,
)

PATH = Path(__file__).resolve().parents[1] / "vectors" / "ledger-v2.json"
VECTORS: dict[str, Any] = json.loads(PATH.read_text("ascii"))
RECORDS: list[dict[str, Any]] = VECTORS["records"]
IDS = [f"v{n}" for n in range(len(RECORDS))]
KEYRING = Keyring.from_json(json.dumps(VECTORS["keyring"]["document"]), source="ledger-v2.json")


def test_the_file_is_what_the_generator_writes() -> None:
    assert PATH.read_text("ascii") == generate.render(2)
    assert VECTORS["format"] == RECORD_FORMAT == 2


@pytest.mark.parametrize("vector", RECORDS, ids=IDS)
def test_each_record_verifies_and_carries_its_rules_sorted(vector: dict[str, Any]) -> None:
    record = verify_record(
        vector["canonical"].encode(),
        digest=vector["digest"],
        signature=vector["signature"],
        keyring=KEYRING,
    )
    assert record["format"] == 2
    assert record["risk_rules"] == sorted(generate.RISK_RULES[record["version"]])
    assert sha256_hex(vector["canonical"].encode()) == vector["digest"]


@pytest.mark.parametrize("vector", RECORDS, ids=IDS)
def test_build_record_with_risk_rules_makes_the_vector(vector: dict[str, Any]) -> None:
    record = vector["record"]
    built = build_record(
        kind=record["kind"],
        thread_id=record["thread_id"],
        version=record["version"],
        parent_digest=record["parent_digest"],
        node_id=record["node_id"],
        patch=parse_object(vector["patch_json"].encode(), what="patch"),
        state_digest=record["state_digest"],
        policy_digest=record["policy_digest"],
        receipt_digest=record["receipt_digest"],
        key_id=record["key_id"],
        committed_at=datetime.fromisoformat(record["committed_at"]),
        risk_rules=generate.RISK_RULES[record["version"]],  # unsorted, as a server lists them
    )
    assert canonical_bytes(built) == vector["canonical"].encode()


def test_the_transition_digest_rebuilds_from_the_record_alone() -> None:
    record = parse_record(RECORDS[2]["canonical"].encode())
    proposal = build_proposal(
        thread_id=record["thread_id"],
        base_version=record["version"] - 1,
        parent_digest=record["parent_digest"],
        node_id=record["node_id"],
        patch=record["patch"],
        state_digest=record["state_digest"],
        policy_digest=record["policy_digest"],
        risk_rules=generate.RISK_RULES[2],
    )
    assert proposal["format"] == 1  # what a reviewer approves keeps its format
    assert record_risk_rules(record) == sorted(generate.RISK_RULES[2])
    assert transition_digest(record) == sha256_hex(canonical_bytes(proposal))
    assert transition_digest(record) == transition_digest(record, generate.RISK_RULES[2])


def test_a_format_1_record_needs_its_rules_given() -> None:
    v1 = json.loads((PATH.parent / "ledger-v1.json").read_text("ascii"))
    record = parse_record(v1["records"][1]["canonical"].encode())
    assert record_risk_rules(record) is None
    with pytest.raises(ValueError, match="a format 1 record carries no risk rules"):
        transition_digest(record)


@pytest.mark.parametrize("vector", VECTORS["invalid"], ids=lambda v: v["description"])
def test_invalid_vectors_are_refused(vector: dict[str, Any]) -> None:
    with pytest.raises(RecordInvalid, match=re.escape(vector["error"])):
        verify_record(
            vector["canonical"].encode(),
            digest=vector["digest"],
            signature=vector["signature"],
            keyring=KEYRING,
        )


def test_a_format_number_spelled_as_a_double_is_the_same_format() -> None:
    """``"format": 1.0`` is not canonical (RFC 8785 writes ``1``): refused for its
    bytes, never for its format, so a reader of doubles reports the same."""
    canonical = RECORDS[0]["canonical"]
    spelled = canonical.replace('"format":2', '"format":2.0', 1).encode()
    with pytest.raises(RecordInvalid, match="not in canonical"):
        parse_record(spelled)
    from ztate.contract.record import record_problems

    assert record_problems(json.loads(spelled)) == []
