"""Every vector of tests/vectors/transition-digests/: the transition digest a reviewer
approved, rebuilt from a committed record and its risk rules by the one implementation
(``ztate.contract.record.transition_digest``), the same way the worker SDK and the
offline verifier rebuild it. The TypeScript client runs the same files
(worker_sdk/typescript)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ztate.contract.canonical import sha256_hex
from ztate.contract.record import parse_record, transition_digest

FOLDER = Path(__file__).resolve().parents[1] / "vectors" / "transition-digests"
CASES = sorted(FOLDER.glob("*.json"))


def load(path: Path) -> dict[str, Any]:
    case: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return case


def test_there_is_a_file_per_way_to_be_wrong_and_one_right() -> None:
    names = {path.stem for path in CASES}
    assert {"valid", "rules-not-sorted", "base-version-is-record-version"} <= names
    assert len(names) >= 10


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_the_rebuilt_digest_agrees_with_each_claim_as_the_file_says(path: Path) -> None:
    case = load(path)
    record = parse_record(case["record_json"].encode())
    # null: a format-2 record carries its rules, and they are taken from it
    rebuilt = transition_digest(record, case["risk_rules"])
    assert rebuilt == sha256_hex(case["proposal_json"].encode())
    assert (rebuilt == case["transition_digest"]) is case["valid"], case["why"]


def test_the_vector_files_are_what_the_generator_writes() -> None:
    from tests.vectors import generate_digest_cases

    assert len(CASES) == len(generate_digest_cases.CASES)
    for item in generate_digest_cases.CASES:
        assert load(FOLDER / f"{item['name']}.json") == item
