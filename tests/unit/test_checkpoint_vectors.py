"""Every vector of tests/vectors/checkpoints/, one file per way a signed checkpoint can be
right or wrong, through the one checkpoint check (``ztate.contract.checkpoints``) and
the binding to the head a worker read, as the worker SDK's check before acting does it
(worker_sdk/_verify.py). The TypeScript client runs the same files."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from ztate.contract.checkpoints import SignedCheckpoint, verify_checkpoint
from ztate.contract.errors import CheckpointInvalid

FOLDER = Path(__file__).resolve().parents[1] / "vectors" / "checkpoints"
CASES = sorted(FOLDER.glob("*.json"))


def load(path: Path) -> dict[str, Any]:
    case: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return case


def verified(case: dict[str, Any]) -> dict[str, Any] | None:
    raw = base64.b64decode(case["public_key_base64"])
    keys = {case["key_id"]: Ed25519PublicKey.from_public_bytes(raw)}
    signed = SignedCheckpoint(case["checkpoint_json"].encode(), case["signature"], case["key_id"])
    try:
        return verify_checkpoint(signed, keys)
    except CheckpointInvalid:
        return None


def test_there_is_a_file_per_way_to_be_wrong_and_one_right() -> None:
    names = {path.stem for path in CASES}
    assert {"valid", "signature-bit-flipped", "older-version"} <= names
    assert len(names) >= 14


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_each_vector_gets_its_verdict_and_binds_only_its_head(path: Path) -> None:
    case = load(path)
    body = verified(case)
    assert (body is not None) is case["valid"], case["why"]
    head = case["head"]
    binds = body is not None and (body["thread_id"], body["version"], body["head_digest"]) == (
        head["thread_id"],
        head["version"],
        head["digest"],
    )
    assert binds is case["binds"], case["why"]


def test_the_vector_files_are_what_the_generator_writes() -> None:
    from tests.vectors import generate_checkpoint_cases

    assert len(CASES) == len(generate_checkpoint_cases.CASES)
    for item in generate_checkpoint_cases.CASES:
        assert load(FOLDER / f"{item['name']}.json") == item
