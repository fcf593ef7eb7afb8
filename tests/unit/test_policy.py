"""Policy loading: a bad policy is refused whole, with a message naming the entry."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.policy import Policy, PolicyError

REPO = Path(__file__).resolve().parents[2]
GOOD = {
    "format": 1,
    "name": "p",
    "keys": {"a": {}, "b": {"description": "bee"}},
    "nodes": {"n": {"read": ["a"], "write": ["b"]}},
}


def test_default_policy_loads_with_a_stable_digest() -> None:
    policy = Policy.load(REPO / "services" / "defaults" / "policy.yaml")
    again = Policy.load(REPO / "services" / "defaults" / "policy.yaml")
    assert policy.name == "pipeline"
    assert policy.digest == again.digest
    assert len(policy.digest) == 64
    assert policy.writable("input-parser") == {"requested_action"}


def test_digest_ignores_formatting_but_not_content(tmp_path: Path) -> None:
    compact = tmp_path / "a.json"
    compact.write_text(
        '{"format":1,"name":"p","keys":{"a":{},"b":{"description":"bee"}},'
        '"nodes":{"n":{"read":["a"],"write":["b"]}}}'
    )
    spaced = tmp_path / "b.yaml"
    spaced.write_text(
        "# comment\nformat: 1\nname: p\nkeys:\n  b: {description: bee}\n  a: {}\n"
        "nodes:\n  n: {write: [b], read: [a]}\n"
    )
    assert Policy.load(compact).digest == Policy.load(spaced).digest
    changed = Policy.from_mapping({**GOOD, "name": "q"}, source="x")
    assert changed.digest != Policy.load(compact).digest


@pytest.mark.parametrize(
    ("mutation", "fragment"),
    [
        ({"nodes": {"n": {"read": ["a"], "write": ["missing"]}}}, "nodes.n.write names undeclared"),
        ({"nodes": {"n": {"read": ["nope"]}}}, "nodes.n.read names undeclared"),
        ({"nodes": {"n": {"read": ["a"], "admin": True}}}, "nodes.n.admin"),
        ({"format": 2}, "unsupported policy format 2"),
        ({"keys": {"Bad-Key": {}}}, "keys.Bad-Key"),
        ({"nodes": {"Bad Node": {}}}, "nodes.Bad Node"),
        ({"extra": 1}, "extra"),
        ({"nodes": {"n": {"max_patch_bytes": 0}}}, "nodes.n.max_patch_bytes"),
    ],
)
def test_invalid_policies_are_refused_whole(mutation: dict[str, object], fragment: str) -> None:
    with pytest.raises(PolicyError) as caught:
        Policy.from_mapping({**GOOD, **mutation}, source="policy.yaml")
    assert fragment in str(caught.value)
    assert str(caught.value).startswith("policy.yaml: ")


def test_unreadable_and_unparsable_files(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read policy"):
        Policy.load(tmp_path / "absent.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("format: [1\n")
    with pytest.raises(PolicyError, match="not valid yaml"):
        Policy.load(broken)
