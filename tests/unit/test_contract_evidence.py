"""The contract's evidence checks (``ztate.contract``), which the worker SDK, the
transition service and the offline verifier all run: receipts bound to the record
they approve, the transition digest rebuilt from a record, checkpoints; and the
fixed vectors of docs/approvals.md."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ztate.contract.canonical import canonical_bytes, sha256_hex
from ztate.contract.checkpoints import SignedCheckpoint, sign_checkpoint
from ztate.contract.checkpoints import verify_checkpoint as verify_signed_checkpoint
from ztate.contract.errors import ContractError as EvidenceError
from ztate.contract.keyring import PublicKeys, generate_signing_key
from ztate.contract.receipts import (
    SignedReceipt,
    build_receipt,
    check_receipt_binds,
    sign_receipt,
)
from ztate.contract.receipts import verify_receipt as verify_signed_receipt
from ztate.contract.record import KIND_TRANSITION, build_proposal, build_record, transition_digest
from ztate.worker_sdk import load_public_keys


def verify_receipt(data: bytes, signature: str, key_id: str, keys: PublicKeys) -> dict[str, Any]:
    """Signature and form, the validity period left to ``check_receipt_binds`` (as the
    worker SDK calls it)."""
    return verify_signed_receipt(SignedReceipt(data, signature, key_id), keys, now=None)


def verify_checkpoint(data: bytes, signature: str, key_id: str, keys: PublicKeys) -> dict[str, Any]:
    return verify_signed_checkpoint(SignedCheckpoint(data, signature, key_id), keys)


VECTORS = Path(__file__).resolve().parents[1] / "vectors" / "receipt-v1.json"
T0 = datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC)
RULES = ["large-refund", "permissions-widening"]


def test_the_receipt_vectors_verify() -> None:
    vectors = json.loads(VECTORS.read_text())
    key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(vectors["private_seed_hex"]))
    public = {vectors["key_id"]: key.public_key()}
    assert base64.b64decode(vectors["public_key_base64"]) == key.public_key().public_bytes_raw()
    for case in vectors["cases"]:
        data = case["canonical"].encode()
        receipt = verify_receipt(data, case["signature"], case["receipt"]["key_id"], public)
        assert receipt == case["receipt"]
        assert sha256_hex(data) == case["receipt_digest"]


def test_the_public_keyring_file_of_the_server_loads(tmp_path: Path) -> None:
    generate_signing_key(tmp_path / "k.pem", tmp_path / "public.json", "approval-k1")
    keys = load_public_keys(tmp_path / "public.json")
    assert list(keys) == ["approval-k1"]


def committed_record(patch: dict[str, Any], receipt_digest: str | None) -> dict[str, Any]:
    record: dict[str, Any] = build_record(
        kind=KIND_TRANSITION,
        thread_id="order-42",
        version=4,
        parent_digest="a" * 64,
        node_id="spiffe://ztate.test/node/approval-gate",
        patch=patch,
        state_digest="b" * 64,
        policy_digest="c" * 64,
        receipt_digest=receipt_digest,
        key_id="k1",
        committed_at=T0 + timedelta(seconds=30),
    )
    return record


def approved(patch: dict[str, Any], **overrides: Any) -> tuple[Any, dict[str, Any], Any]:
    """A receipt the server would sign for ``patch`` on order-42@3, and its record."""
    unsigned = committed_record(patch, None)
    proposal = build_proposal(
        thread_id="order-42",
        base_version=3,
        parent_digest=unsigned["parent_digest"],
        node_id=unsigned["node_id"],
        patch=patch,
        state_digest=unsigned["state_digest"],
        policy_digest=unsigned["policy_digest"],
        risk_rules=RULES,
    )
    fields: dict[str, Any] = {
        "transition_digest": sha256_hex(canonical_bytes(proposal)),
        "thread_id": "order-42",
        "base_version": 3,
        "decision": "approve",
        "reviewers": ["spiffe://ztate.test/reviewer/alice"],
        "issued_at": T0,
        "expires_at": T0 + timedelta(minutes=10),
        "key_id": "approval-k1",
    }
    fields.update(overrides)
    key = Ed25519PrivateKey.generate()
    signed = sign_receipt(build_receipt(**fields), key)
    record = committed_record(patch, signed.digest)
    return signed, record, {"approval-k1": key.public_key()}


PATCH = {"approved_action": {"action": "refund", "order_id": "A-42", "amount_cents": 75000}}


def test_a_receipt_the_server_signed_verifies_and_binds_its_record() -> None:
    signed, record, keys = approved(PATCH)
    receipt = verify_receipt(signed.receipt_bytes, signed.signature, signed.key_id, keys)
    check_receipt_binds(receipt, signed.receipt_bytes, record, RULES)


def test_the_transition_digest_is_rebuilt_as_the_server_builds_it() -> None:
    record = committed_record(PATCH, None)
    proposal = build_proposal(
        thread_id="order-42",
        base_version=3,
        parent_digest=record["parent_digest"],
        node_id=record["node_id"],
        patch=PATCH,
        state_digest=record["state_digest"],
        policy_digest=record["policy_digest"],
        risk_rules=list(reversed(RULES)),
    )
    assert transition_digest(record, RULES) == sha256_hex(canonical_bytes(proposal))


@pytest.mark.parametrize(
    ("tamper", "check"),
    [
        ("signature", "receipt.signature"),
        ("unknown-key", "receipt.signature"),
        ("not-canonical", "receipt.signature"),
    ],
)
def test_a_tampered_receipt_is_refused(tamper: str, check: str) -> None:
    signed, _, keys = approved(PATCH)
    data, signature, key_id = signed.receipt_bytes, signed.signature, signed.key_id
    if tamper == "signature":
        signature = ("0" if signature[0] != "0" else "1") + signature[1:]
    elif tamper == "unknown-key":
        key_id = "approval-k2"
    else:
        data = json.dumps(json.loads(data), indent=1).encode()
    with pytest.raises(EvidenceError) as refused:
        verify_receipt(data, signature, key_id, keys)
    assert refused.value.check == check


def test_a_signed_but_non_canonical_receipt_is_refused() -> None:
    key = Ed25519PrivateKey.generate()
    signed, _, _ = approved(PATCH)
    data = json.dumps(json.loads(signed.receipt_bytes), indent=1).encode()
    with pytest.raises(EvidenceError) as refused:
        verify_receipt(data, key.sign(data).hex(), "approval-k1", {"approval-k1": key.public_key()})
    assert refused.value.check == "receipt.form"


@pytest.mark.parametrize(
    ("overrides", "check"),
    [
        ({"base_version": 2}, "receipt.binding"),
        ({"thread_id": "order-43"}, "receipt.binding"),
        ({"decision": "reject"}, "receipt.binding"),
        ({"transition_digest": "d" * 64}, "receipt.binding"),
        ({"expires_at": T0 + timedelta(seconds=10)}, "receipt.expired"),
        ({"issued_at": T0 + timedelta(minutes=1)}, "receipt.expired"),
    ],
)
def test_a_receipt_for_something_else_does_not_bind(overrides: dict[str, Any], check: str) -> None:
    signed, record, keys = approved(PATCH, **overrides)
    receipt = verify_receipt(signed.receipt_bytes, signed.signature, signed.key_id, keys)
    with pytest.raises(EvidenceError) as refused:
        check_receipt_binds(receipt, signed.receipt_bytes, record, RULES)
    assert refused.value.check == check


def test_a_receipt_the_record_does_not_name_does_not_bind() -> None:
    signed, record, keys = approved(PATCH)
    other, _, _ = approved(PATCH)
    receipt = verify_receipt(signed.receipt_bytes, signed.signature, signed.key_id, keys)
    record["receipt_digest"] = other.digest
    with pytest.raises(EvidenceError) as refused:
        check_receipt_binds(receipt, signed.receipt_bytes, record, RULES)
    assert refused.value.check == "receipt.digest"


def test_a_checkpoint_the_server_signed_verifies_and_a_forged_one_does_not() -> None:
    key = Ed25519PrivateKey.generate()
    signed = sign_checkpoint(
        key, "ck1", thread_id="order-42", version=4, head_digest="e" * 64, signed_at=T0
    )
    keys = {"ck1": key.public_key()}
    body = verify_checkpoint(signed.checkpoint, signed.signature, signed.key_id, keys)
    assert (body["thread_id"], body["version"], body["head_digest"]) == ("order-42", 4, "e" * 64)
    forged = signed.checkpoint.replace(b'"version":4', b'"version":5')
    with pytest.raises(EvidenceError) as refused:
        verify_checkpoint(forged, signed.signature, signed.key_id, keys)
    assert refused.value.check == "checkpoint.signature"
    other = Ed25519PrivateKey.generate()
    with pytest.raises(EvidenceError) as wrong_key:
        verify_checkpoint(signed.checkpoint, signed.signature, "ck1", {"ck1": other.public_key()})
    assert wrong_key.value.check == "checkpoint.signature"
