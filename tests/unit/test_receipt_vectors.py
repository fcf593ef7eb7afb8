"""Every receipt vector of tests/vectors/receipts/, one file per way to be right or wrong,
through the one receipt check (``ztate.contract.receipts``) as each consumer calls it:
the transition service (with its clock, the refusal translated to the reason a caller
is told), and the worker SDK and the offline verifier (signature and form now, the
validity period against the record's commit time). Another language's client runs
the same files (docs/approvals.md)."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from ztate.contract.errors import ContractError
from ztate.contract.receipts import SignedReceipt, verify_receipt
from ztate.services.runtime import errors

FOLDER = Path(__file__).resolve().parents[1] / "vectors" / "receipts"
CASES = sorted(FOLDER.glob("*.json"))
DURING = datetime(2026, 1, 2, 3, 5, tzinfo=UTC)  # inside the vectors' validity period


def load(path: Path) -> dict[str, Any]:
    case: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return case


def keys(case: dict[str, Any]) -> dict[str, Ed25519PublicKey]:
    raw = base64.b64decode(case["public_key_base64"])
    return {case["key_id"]: Ed25519PublicKey.from_public_bytes(raw)}


def signed(case: dict[str, Any]) -> SignedReceipt:
    return SignedReceipt(case["receipt_json"].encode(), case["signature"], case["key_id"])


def server_accepts(case: dict[str, Any]) -> bool:
    """As the transition service's ApplyDecision checks it: RECEIPT_INVALID if not."""
    try:
        verify_receipt(signed(case), keys(case), now=DURING)
    except ContractError as exc:
        refused = errors.from_contract(exc)
    else:
        return True
    assert type(refused) is errors.ReceiptInvalid
    return False


def offline_accepts(case: dict[str, Any]) -> bool:
    """As the worker SDK and ``ztate verify`` check it, before the binding."""
    try:
        verify_receipt(signed(case), keys(case), now=None)
    except ContractError:
        return False
    return True


def test_there_is_a_file_per_way_to_be_wrong_and_one_right() -> None:
    names = {path.stem for path in CASES}
    assert "valid" in names
    assert len(names) >= 14


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_every_consumer_gives_each_vector_its_verdict(path: Path) -> None:
    case = load(path)
    assert server_accepts(case) is case["valid"], case["why"]
    assert offline_accepts(case) is case["valid"], case["why"]


def test_the_vector_files_are_what_the_generator_writes() -> None:
    from tests.vectors import generate_receipt_cases

    for item in generate_receipt_cases.CASES:
        assert load(FOLDER / f"{item['name']}.json") == item
