"""The patch a revert commits: applied to the current state it yields exactly the
earlier state, whatever was added, changed or removed in between."""

from __future__ import annotations

from ztate.contract.canonical import JsonObject
from ztate.services.policy.changes import apply_patch
from ztate.transition_service.checks import restoring_patch, revert_digest
from ztate.transition_service.requests import Revert


def test_restoring_patch_sets_every_earlier_key_and_removes_later_ones() -> None:
    earlier: JsonObject = {"a": 1, "b": {"x": [1, 2]}, "c": "kept"}
    current: JsonObject = {"a": 2, "c": "kept", "d": True, "e": None}
    patch = restoring_patch(current, earlier)
    assert patch == {"a": 1, "b": {"x": [1, 2]}, "c": "kept", "d": None, "e": None}
    assert apply_patch(current, patch) == earlier


def test_restoring_an_empty_state_removes_everything() -> None:
    assert restoring_patch({"a": 1}, {}) == {"a": None}
    assert apply_patch({"a": 1}, restoring_patch({"a": 1}, {})) == {}


def test_a_revert_request_is_identified_by_its_target_version() -> None:
    first = revert_digest(Revert("t", 1, "k"))
    assert first == revert_digest(Revert("other", 1, "other-key"))
    assert first != revert_digest(Revert("t", 2, "k"))
