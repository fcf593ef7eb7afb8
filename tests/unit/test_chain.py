"""ztate.contract.record against the fixed vectors in tests/vectors/ledger-v1.json.

The expected bytes, digests and signatures are read from the committed file and
never recomputed here: a change to canonicalisation, hashing or signing that moves
a single byte fails these tests.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ztate.contract.canonical import canonical_bytes, parse_object, sha256_hex
from ztate.contract.errors import RecordInvalid
from ztate.contract.keyring import Keyring
from ztate.contract.record import (
    GENESIS_PARENT,
    RECORD_FORMAT,
    build_record,
    format_time,
    seal,
    sign_digest,
    verify_record,
)
from ztate.services.policy.changes import apply_patch

VECTORS: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parents[1] / "vectors" / "ledger-v1.json").read_text("ascii")
)
RECORDS: list[dict[str, Any]] = VECTORS["records"]
THREAD = VECTORS["thread_id"]
KEYS_HEX: dict[str, str] = VECTORS["keyring"]["keys_hex"]
IDS = [f"v{n}" for n in range(len(RECORDS))]


def keyring(current: str | None = None, *, only: tuple[str, ...] | None = None) -> Keyring:
    """The vector keyring, optionally with another current key or a subset of keys."""
    document = json.loads(json.dumps(VECTORS["keyring"]["document"]))
    if only is not None:
        document["keys"] = {k: v for k, v in document["keys"].items() if k in only}
        document["current"] = only[0]
    if current is not None:
        document["current"] = current
    return Keyring.from_json(json.dumps(document), source="ledger-v1.json")


# --- the vectors themselves ---------------------------------------------------------


def test_vector_keyring_base64_and_hex_agree() -> None:
    ring = keyring()
    assert ring.current == "vector-k2"
    assert ring.key_ids == ("vector-k1", "vector-k2")
    for key_id, key_hex in KEYS_HEX.items():
        assert ring.key(key_id) == bytes.fromhex(key_hex)
        assert len(ring.key(key_id)) == 32


def test_vectors_form_one_thread_from_genesis() -> None:
    assert VECTORS["format"] == 1 == RECORD_FORMAT - 1
    assert len(RECORDS) >= 3
    parent = GENESIS_PARENT
    for version, vector in enumerate(RECORDS):
        record = vector["record"]
        assert record["version"] == version
        assert record["thread_id"] == THREAD
        assert record["parent_digest"] == parent
        assert record["kind"] == ("genesis" if version == 0 else "transition")
        parent = vector["digest"]


# --- each record: bytes, digest, signature ------------------------------------------


@pytest.mark.parametrize("vector", RECORDS, ids=IDS)
def test_canonical_bytes_of_the_record(vector: dict[str, Any]) -> None:
    assert canonical_bytes(vector["record"]) == vector["canonical"].encode()


@pytest.mark.parametrize("vector", RECORDS, ids=IDS)
def test_digest_is_sha256_of_the_canonical_bytes(vector: dict[str, Any]) -> None:
    assert sha256_hex(vector["canonical"].encode()) == vector["digest"]


@pytest.mark.parametrize("vector", RECORDS, ids=IDS)
def test_signature_is_hmac_of_the_raw_digest_bytes(vector: dict[str, Any]) -> None:
    key = bytes.fromhex(KEYS_HEX[vector["record"]["key_id"]])
    assert sign_digest(key, vector["digest"]) == vector["signature"]
    # The MAC covers the 32 digest bytes, not their 64-character hex spelling.
    over_hex = hmac.new(key, vector["digest"].encode(), hashlib.sha256).hexdigest()
    assert over_hex != vector["signature"]


@pytest.mark.parametrize("vector", RECORDS, ids=IDS)
def test_seal_produces_the_vector(vector: dict[str, Any]) -> None:
    key_id = vector["record"]["key_id"]
    sealed = seal(vector["record"], keyring(key_id))
    assert sealed.record_bytes == vector["canonical"].encode()
    assert sealed.digest == vector["digest"]
    assert sealed.signature == vector["signature"]
    assert sealed.key_id == key_id


def test_seal_refuses_a_record_for_another_key() -> None:
    with pytest.raises(ValueError, match="record key_id must be the keyring's current key"):
        seal(RECORDS[0]["record"], keyring("vector-k2"))


@pytest.mark.parametrize("vector", RECORDS, ids=IDS)
def test_build_record_from_the_parsed_patch(vector: dict[str, Any]) -> None:
    record = vector["record"]
    committed_at = datetime.fromisoformat(record["committed_at"])
    assert format_time(committed_at) == record["committed_at"]
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
        committed_at=committed_at,
    )
    assert canonical_bytes(built) == vector["canonical"].encode()
    assert list(built) == list(record)


def test_state_follows_the_patches() -> None:
    state: dict[str, Any] = {}
    for vector in RECORDS:
        patch = vector["record"]["patch"]
        state = dict(patch) if vector["record"]["kind"] == "genesis" else apply_patch(state, patch)
        state_bytes = canonical_bytes(state)
        assert state_bytes == vector["state_canonical"].encode()
        assert canonical_bytes(vector["state"]) == state_bytes
        assert sha256_hex(state_bytes) == vector["state_digest"] == vector["record"]["state_digest"]


# --- verification of the valid chain ------------------------------------------------


@pytest.mark.parametrize("vector", RECORDS, ids=IDS)
def test_verify_record_returns_the_record(vector: dict[str, Any]) -> None:
    record = vector["record"]
    verified = verify_record(
        vector["canonical"].encode(),
        digest=vector["digest"],
        signature=vector["signature"],
        keyring=keyring(),
        expected_parent=record["parent_digest"],
        expected_version=record["version"],
    )
    assert canonical_bytes(verified) == vector["canonical"].encode()
    assert verified["state_digest"] == vector["state_digest"]


# --- refusals -------------------------------------------------------------------------


@pytest.mark.parametrize("vector", VECTORS["invalid"], ids=lambda v: v["description"])
def test_invalid_vectors_are_refused(vector: dict[str, Any]) -> None:
    with pytest.raises(RecordInvalid, match=re.escape(vector["error"])):
        verify_record(
            vector["canonical"].encode(),
            digest=vector["digest"],
            signature=vector["signature"],
            keyring=keyring(),
        )


def test_a_changed_byte_breaks_the_digest() -> None:
    vector = RECORDS[1]
    tampered = vector["canonical"].encode().replace(b"planner", b"plannes", 1)
    with pytest.raises(RecordInvalid) as refused:
        verify_record(
            tampered, digest=vector["digest"], signature=vector["signature"], keyring=keyring()
        )
    assert str(refused.value) == (
        f"digest mismatch: stored {vector['digest']}, recomputed {sha256_hex(tampered)}"
    )


def test_a_wrong_signature_is_refused() -> None:
    vector = RECORDS[1]
    flipped = vector["signature"][:-1] + ("0" if vector["signature"][-1] != "0" else "1")
    with pytest.raises(RecordInvalid) as refused:
        verify_record(
            vector["canonical"].encode(),
            digest=vector["digest"],
            signature=flipped,
            keyring=keyring(),
        )
    assert str(refused.value) == "HMAC signature does not verify under key 'vector-k1'"


def test_an_unknown_key_id_is_refused() -> None:
    vector = RECORDS[0]
    with pytest.raises(RecordInvalid) as refused:
        verify_record(
            vector["canonical"].encode(),
            digest=vector["digest"],
            signature=vector["signature"],
            keyring=keyring(only=("vector-k2",)),
        )
    assert str(refused.value) == "unknown key id 'vector-k1'"


NON_CANONICAL = [
    pytest.param(lambda r: json.dumps(r, ensure_ascii=False, sort_keys=True), id="spaces"),
    pytest.param(
        lambda r: json.dumps(r, indent=2, ensure_ascii=False, sort_keys=True), id="indent"
    ),
    pytest.param(lambda r: json.dumps(r, separators=(",", ":")), id="escaped-non-ascii-unsorted"),
    pytest.param(
        lambda r: json.dumps(r, separators=(",", ":"), ensure_ascii=False), id="member-order"
    ),
    pytest.param(
        lambda r: json.dumps(r, separators=(",", ":"), ensure_ascii=False, sort_keys=True),
        id="code-point-order-and-python-numbers",
    ),
]


@pytest.mark.parametrize("spell", NON_CANONICAL)
@pytest.mark.parametrize("vector", RECORDS[1:], ids=IDS[1:])
def test_a_non_canonical_spelling_is_refused_even_when_digest_and_hmac_match(
    vector: dict[str, Any], spell: Any
) -> None:
    text: bytes = spell(vector["record"]).encode()
    assert text != vector["canonical"].encode()
    assert json.loads(text) == json.loads(vector["canonical"])
    digest = sha256_hex(text)
    key = bytes.fromhex(KEYS_HEX[vector["record"]["key_id"]])
    with pytest.raises(RecordInvalid) as refused:
        verify_record(text, digest=digest, signature=sign_digest(key, digest), keyring=keyring())
    assert str(refused.value) == "record bytes are not in canonical (RFC 8785) form"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b'{"key_id":"vector-k1"', "record bytes are not JSON"),
        (b"\xff", "record bytes are not JSON"),
        (b'["vector-k1"]', "record is not a JSON object"),
        (
            b'{"format":1}',
            "missing members ['committed_at', 'key_id', 'kind', "
            "'node_id', 'parent_digest', 'patch', 'policy_digest', 'receipt_digest', "
            "'state_digest', 'thread_id', 'version'], unexpected []",
        ),
        # Crafted bytes whose digest matches must still fail as RecordInvalid, whatever they hold.
        (b'{"a":NaN}', "record holds values outside the canonical JSON domain"),
        (b'{"a":9007199254740992}', "record holds values outside the canonical JSON domain"),
        (b'{"a":"\\ud800"}', "record holds values outside the canonical JSON domain"),
        (
            b'{"a":' + b"[" * 300 + b"]" * 300 + b"}",
            "record holds values outside the canonical JSON domain",
        ),
        (b"[" * 100_000 + b"]" * 100_000, "record bytes are not JSON"),
    ],
    ids=[
        "truncated",
        "not-utf8",
        "array",
        "members",
        "nan",
        "2**53",
        "surrogate",
        "deep",
        "deeper",
    ],
)
def test_malformed_record_bytes_are_refused(text: bytes, message: str) -> None:
    digest = sha256_hex(text)
    with pytest.raises(RecordInvalid) as refused:
        verify_record(text, digest=digest, signature="0" * 64, keyring=keyring())
    assert str(refused.value) == message


def test_a_wrong_parent_is_refused() -> None:
    vector = RECORDS[2]
    with pytest.raises(RecordInvalid) as refused:
        verify_record(
            vector["canonical"].encode(),
            digest=vector["digest"],
            signature=vector["signature"],
            keyring=keyring(),
            expected_parent=RECORDS[0]["digest"],
        )
    assert str(refused.value) == (
        f"parent mismatch: expected {RECORDS[0]['digest']}, found {RECORDS[1]['digest']}"
    )


def test_a_non_hex_signature_is_refused() -> None:
    vector = RECORDS[0]
    with pytest.raises(RecordInvalid) as refused:
        verify_record(
            vector["canonical"].encode(),
            digest=vector["digest"],
            signature="\u00e9" * 64,
            keyring=keyring(),
        )
    assert str(refused.value) == "signature is not 64 lower-case hex characters"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": 2}, "missing members ['risk_rules'], unexpected []"),
        ({"format": 3}, "format 3 (1 or 2, an integer)"),
        ({"format": True}, "format True (1 or 2, an integer)"),
        ({"kind": "transition"}, "kind transition at version 0"),
        ({"kind": "revert"}, "kind revert at version 0"),
        ({"version": "0"}, "version is a str"),
        ({"extra": 1}, "missing members [], unexpected ['extra']"),
    ],
)
def test_records_outside_formats_1_and_2_are_refused(change: dict[str, Any], message: str) -> None:
    record = {**RECORDS[0]["record"], **change}
    text = canonical_bytes(record)
    digest = sha256_hex(text)
    key = bytes.fromhex(KEYS_HEX[RECORDS[0]["record"]["key_id"]])
    with pytest.raises(RecordInvalid) as refused:
        verify_record(text, digest=digest, signature=sign_digest(key, digest), keyring=keyring())
    assert str(refused.value) == message


def _resigned(change: dict[str, Any], vector: dict[str, Any]) -> tuple[bytes, str, str]:
    text = canonical_bytes({**vector["record"], **change})
    digest = sha256_hex(text)
    key = bytes.fromhex(KEYS_HEX[vector["record"]["key_id"]])
    return text, digest, sign_digest(key, digest)


def test_a_revert_after_genesis_is_a_record_kind() -> None:
    vector = RECORDS[1]
    text, digest, signature = _resigned({"kind": "revert"}, vector)
    record = verify_record(text, digest=digest, signature=signature, keyring=keyring())
    assert (record["kind"], record["version"]) == ("revert", vector["record"]["version"])


@pytest.mark.parametrize("kind", ["genesis", "proposal", "Revert"])
def test_only_transition_or_revert_follow_genesis(kind: str) -> None:
    vector = RECORDS[1]
    text, digest, signature = _resigned({"kind": kind}, vector)
    with pytest.raises(RecordInvalid) as refused:
        verify_record(text, digest=digest, signature=signature, keyring=keyring())
    version = vector["record"]["version"]
    assert str(refused.value) == f"kind {kind} at version {version}"


@settings(max_examples=500)
@given(st.datetimes(timezones=st.timezones()))
def test_format_time_is_rfc3339_utc_with_microseconds(moment: datetime) -> None:
    """The fast isoformat path writes exactly what the strftime format says."""
    expected = moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    assert format_time(moment) == expected
