"""``StateValidator.check`` validates each key on its own strict validator: it must
answer exactly as the policy's whole strict model does (the same problems, worded
alike, in the same order), for good values, wrong types, unknown members at any
depth and undeclared keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from ztate.services.policy.model import Policy
from ztate.services.policy.schema import ObjectType, TypeMismatch, TypeSpec, _shown_loc

REPO = Path(__file__).resolve().parents[2]
POLICY = Policy.load(REPO / "services" / "defaults" / "policy.yaml")
VALIDATOR = POLICY.validator


def _names(spec: TypeSpec) -> set[str]:
    if isinstance(spec, ObjectType):
        return set(spec.properties).union(*(_names(sub) for sub in spec.properties.values()))
    items = getattr(spec, "items", None)
    return _names(items) if items is not None else set()


DECLARED = sorted(POLICY.document.keys)
MEMBER_NAMES = sorted(set(DECLARED).union(*(_names(s.type) for s in POLICY.document.keys.values())))
NAMES = st.sampled_from([*MEMBER_NAMES, "extra", "Password", "x" * 70])
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**53) + 1, 2**53 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["refund", "none", "A-42", "123e4567-e89b-42d3-a456-426614174000", ""])
    | st.text(max_size=8)
)
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(NAMES, inner, max_size=4)
)
MEMBERS = st.dictionaries(NAMES, VALUES, max_size=5)


def model_answer(members: dict[str, Any]) -> list[tuple[str, str]]:
    """What the policy's whole strict model says of ``members`` (the reference)."""
    present = {key: value for key, value in members.items() if value is not None}
    try:
        VALIDATOR.model.model_validate(present)
    except ValidationError as exc:
        return [
            (".".join(_shown_loc(err["loc"])) or "<patch>", err["msg"])
            for err in exc.errors(include_input=False, include_url=False)
        ]
    return []


def check_answer(members: dict[str, Any]) -> list[tuple[str, str]]:
    try:
        VALIDATOR.check(members)
    except TypeMismatch as mismatch:
        return mismatch.problems
    return []


@settings(max_examples=400, deadline=None)
@given(MEMBERS)
def test_per_key_validation_answers_as_the_whole_model(members: dict[str, Any]) -> None:
    assert check_answer(members) == model_answer(members)


@pytest.mark.parametrize(
    "members",
    [
        {"raw_text": "refund order 42", "target_user_id": "123e4567-e89b-42d3-a456-426614174000"},
        {"raw_text": 1, "authority": {"tenant": 2, "extra": True}, "zzz": 1, "aaa": None},
        {"requested_action": {"action": "refund", "order_id": "A-42", "Password": "x"}},
        {"execution_permissions": ["refund", 1, None], "target_user_id": "not-a-uuid"},
        {"undeclared": 1, "raw_text": "x" * 5000, "another": [1]},
    ],
    ids=["good", "wrong-types-and-extras", "nested-extra", "list-items", "undeclared-and-long"],
)
def test_known_members_answer_as_the_whole_model(members: dict[str, Any]) -> None:
    assert check_answer(members) == model_answer(members)
