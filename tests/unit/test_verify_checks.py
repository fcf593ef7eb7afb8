"""The check names are defined once (``ztate.services.verify.checks.CHECKS``) and
docs/verification.md lists exactly those, in the same order, so a second
implementation reads the same names the verifier reports."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ztate.services.verify import bundle, checks

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[2] / "docs" / "verification.md"


def documented_checks() -> list[tuple[str, str]]:
    text = DOC.read_text(encoding="utf-8")
    table = text.split("### Check names", 1)[1].split("\n\n", 3)[2]
    rows = re.findall(r"^\| `([^`]+)` \| (.+) \|$", table, flags=re.MULTILINE)
    return [(name, meaning) for name, meaning in rows]


def test_the_docs_list_exactly_the_checks_of_the_code_in_its_order() -> None:
    assert documented_checks() == list(checks.CHECKS.items())


def test_every_check_a_finding_can_name_is_in_the_table() -> None:
    named = {
        value
        for module in (checks, bundle)
        for name, value in vars(module).items()
        if name.isupper() and isinstance(value, str) and value in checks.CHECKS
    }
    column = {f"{checks.COLUMN}.<name>"}
    assert named | column == set(checks.CHECKS)


@pytest.mark.parametrize(
    ("node_id", "role"),
    [
        ("spiffe://ztate.test/operator/alice", "operator"),
        ("spiffe://ztate.test/node/planner", "node"),
        ("spiffe://ztate.test/service/approval", "service"),
        ("spiffe://ztate.test/node", None),
        ("spiffe://ztate.test/a/b/c", None),
        ("https://ztate.test/node/planner", None),
    ],
)
def test_the_role_is_the_first_path_segment_of_a_spiffe_id(node_id: str, role: str | None) -> None:
    assert checks.role_of(node_id) == role


def test_each_kind_needs_its_role() -> None:
    assert checks.ROLES_OF_KIND == {
        "genesis": ("operator", "service"),
        "transition": ("node",),
        "revert": ("operator",),
    }
