"""Policy loading: a bad policy is refused whole, each problem named with its line."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from ztate.services.policy.model import Layer, Policy, PolicyError, PolicySet

REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO / "services" / "defaults" / "policy.yaml"
GOOD: dict[str, Any] = {
    "format": 1,
    "name": "p",
    "keys": {
        "a": {"layer": "working", "type": "string", "max_length": 10},
        "b": {"layer": "working", "type": "integer", "description": "bee"},
        "c": {"layer": "core", "type": "boolean"},
    },
    "nodes": {"n": {"layer": "working", "read": ["a", "c"], "write": ["a", "b"]}},
    "invariants": [{"name": "small-b", "expression": "!has(state.b) || state.b < 10"}],
    "risk": [{"name": "touch-a", "keys": ["a"]}],
}


def changed(**changes: Any) -> dict[str, Any]:
    doc = copy.deepcopy(GOOD)
    doc.update(changes)
    return doc


def woken(wake: dict[str, Any]) -> dict[str, Any]:
    return changed(nodes={"n": {"layer": "working", "read": ["a", "c"], "wake": wake}})


def test_default_policy_loads_with_a_stable_digest() -> None:
    policy = Policy.load(DEFAULT)
    assert policy.name == "pipeline"
    assert policy.digest == Policy.load(DEFAULT).digest
    assert len(policy.digest) == 64
    assert policy.writable("input-parser") == {"requested_action"}
    assert policy.key_layer("authority") is Layer.CORE
    assert [r.name for r in policy.risk_rules] == [
        "target-user-change",
        "permissions-widening",
        "large-refund",
    ]


def test_only_nodes_marked_read_records_read_records() -> None:
    assert not Policy.from_mapping(GOOD, source="p").reads_records("n")  # the default
    marked = changed(nodes={"n": {"layer": "working", "read_records": True}})
    assert Policy.from_mapping(marked, source="p").reads_records("n")
    default = Policy.load(DEFAULT)
    assert [n for n in default.document.nodes if default.reads_records(n)] == ["db-writer"]


def test_digest_ignores_formatting_but_not_content(tmp_path: Path) -> None:
    compact = tmp_path / "a.json"
    compact.write_text(
        '{"format":1,"name":"p","keys":{"a":{"layer":"working","type":"boolean"}},'
        '"nodes":{"n":{"layer":"working","read":["a"],"write":["a"]}}}'
    )
    spaced = tmp_path / "b.yaml"
    spaced.write_text(
        "# comment\nformat: 1\nname: p\nkeys:\n  a: {type: boolean, layer: working}\n"
        "nodes:\n  n: {write: [a], read: [a], layer: working}\n"
    )
    assert Policy.load(compact).digest == Policy.load(spaced).digest
    renamed = spaced.read_text().replace("name: p", "name: q")
    spaced.write_text(renamed)
    assert Policy.load(spaced).digest != Policy.load(compact).digest


@pytest.mark.parametrize(
    ("document", "fragment"),
    [
        (changed(format=2), "format: unsupported policy format 2"),
        (changed(extra=1), "extra: Extra inputs are not permitted"),
        (changed(keys={"Bad-Key": {"layer": "working", "type": "boolean"}}), "keys.Bad-Key"),
        (changed(keys={"a": {"layer": "working", "type": "strin"}}), "does not match any"),
        (changed(keys={"a": {"layer": "top", "type": "boolean"}}), "keys.a.layer"),
        (
            changed(keys={"a": {"layer": "working", "type": "string", "pattern": "("}}),
            "pattern is not a valid regular expression",
        ),
        (
            changed(keys={"a": {"layer": "working", "type": "enum", "values": ["x", "x"]}}),
            "enum values must be unique",
        ),
        (
            changed(
                keys={
                    "a": {
                        "layer": "working",
                        "type": "object",
                        "properties": {"x": {"type": "boolean"}},
                        "required": ["y"],
                    }
                }
            ),
            "required names properties that do not exist: ['y']",
        ),
        (
            changed(nodes={"n": {"layer": "working", "write": ["c"]}}),
            "nodes.n.write.0: grants write access to core key 'c'",
        ),
        (
            changed(
                keys={"s": {"layer": "shared", "type": "boolean"}},
                nodes={"n": {"layer": "working", "write": ["s"]}},
            ),
            "key 's' is in layer shared, above the node's layer working",
        ),
        (changed(nodes={"n": {"layer": "core"}}), "nodes act at shared or below, not core"),
        (changed(nodes={"n": {"layer": "working", "read": ["zz"]}}), "undeclared key 'zz'"),
        (changed(nodes={"n": {"layer": "working", "admin": True}}), "nodes.n.admin"),
        (
            changed(nodes={"n": {"layer": "working", "read_records": "yes"}}),
            "nodes.n.read_records: Input should be a valid boolean",
        ),
        (
            changed(nodes={"n": {"layer": "working", "read_records": 1}}),
            "nodes.n.read_records: Input should be a valid boolean",
        ),
        (
            changed(invariants=[{"name": "x", "expression": "state.a >"}]),
            "invariants.0.expression: not valid CEL",
        ),
        (
            changed(invariants=[{"name": "x", "expression": "state.zz == 1"}]),
            "names keys the policy does not declare: ['zz']",
        ),
        (
            changed(invariants=[{"name": "x", "expression": "attacker.a == 1"}]),
            "unknown variables ['attacker']",
        ),
        (changed(risk=[{"name": "r", "keys": ["zz"]}]), "risk.0.keys: undeclared keys ['zz']"),
        (changed(risk=[{"name": "r"}]), "risk.0: give exactly one of keys or expression"),
        (
            changed(risk=[{"name": "r", "keys": ["a"]}, {"name": "r", "keys": ["b"]}]),
            "risk.1.name: duplicate rule name 'r'",
        ),
        (woken({}), "nodes.n.wake: give keys, when, or both"),
        (woken({"keys": []}), "nodes.n.wake.keys: List should have at least 1 item"),
        (woken({"keys": ["zz"]}), "nodes.n.wake.keys.0: key 'zz' is not in the node's read list"),
        (woken({"keys": ["b"]}), "nodes.n.wake.keys.0: key 'b' is not in the node's read list"),
        (woken({"when": "state.a >"}), "nodes.n.wake.when: not valid CEL"),
        (woken({"when": "has(state.b)"}), "nodes.n.wake.when: reads keys the node may not read"),
        (woken({"when": "has(patch.a)"}), "a wake condition sees only state"),
        (woken({"when": "node == 'n'"}), "a wake condition sees only state"),
        (woken({"keys": ["a"], "who": "x"}), "nodes.n.wake.who: Extra inputs are not permitted"),
    ],
)
def test_invalid_policies_are_refused_whole(document: dict[str, Any], fragment: str) -> None:
    with pytest.raises(PolicyError) as caught:
        Policy.from_mapping(document, source="policy.yaml")
    assert fragment in str(caught.value)
    assert str(caught.value).startswith("policy.yaml: ")


def test_every_problem_is_reported_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "format: 1\n"
        "name: bad\n"
        "keys:\n"
        "  a: {layer: core, type: string}\n"
        "  b: {layer: shared, type: integer}\n"
        "nodes:\n"
        "  n:\n"
        "    layer: working\n"
        "    write: [a, b, zz]\n"
        "risk:\n"
        "  - name: r\n"
        "    expression: 'state.q > 1'\n"
    )
    with pytest.raises(PolicyError) as caught:
        Policy.load(path)
    lines = str(caught.value).splitlines()
    assert lines == [
        f"{path}:9: nodes.n.write.2: undeclared key 'zz'",
        f"{path}:9: nodes.n.write.0: grants write access to core key 'a'; core and "
        "characteristics keys are set only when a thread is created",
        f"{path}:9: nodes.n.write.1: key 'b' is in layer shared, above the node's layer "
        "working: a lower layer never overrides a higher one",
        f"{path}:12: risk.0.expression: names keys the policy does not declare: ['q']",
    ]


def test_unreadable_and_unparsable_files(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read policy"):
        Policy.load(tmp_path / "absent.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("format: [1\n")
    with pytest.raises(PolicyError, match="not valid YAML"):
        Policy.load(broken)


def test_a_folder_loads_several_policies_and_a_node_belongs_to_one(tmp_path: Path) -> None:
    (tmp_path / "one.json").write_text(
        '{"format":1,"name":"one","keys":{"a":{"layer":"working","type":"boolean"}},'
        '"nodes":{"n1":{"layer":"working","write":["a"]}}}'
    )
    (tmp_path / "two.yaml").write_text(
        "format: 1\nname: two\nkeys: {a: {layer: working, type: boolean}}\n"
        "nodes: {n2: {layer: working, write: [a]}}\n"
    )
    policies = PolicySet.load(tmp_path)
    assert set(policies.policies) == {"one", "two"}
    assert policies.of_node("n2") is policies.get("two")
    assert policies.only is None
    (tmp_path / "three.yaml").write_text(
        "format: 1\nname: three\nkeys: {a: {layer: working, type: boolean}}\n"
        "nodes: {n1: {layer: working}}\n"
    )
    with pytest.raises(PolicyError, match="node 'n1' is registered in both"):
        PolicySet.load(tmp_path)


def test_an_empty_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="no policy files"):
        PolicySet.load(tmp_path)


def test_a_version_wakes_nodes_by_their_declaration() -> None:
    doc = changed(
        nodes={
            "keyed": {"layer": "working", "read": ["a", "c"], "wake": {"keys": ["a"]}},
            "cond": {"layer": "working", "read": ["a"], "wake": {"when": "state.a == 'go'"}},
            "both": {
                "layer": "working",
                "read": ["a", "c"],
                "write": ["a"],
                "wake": {"keys": ["a"], "when": "has(state.c) && state.c"},
            },
            "asleep": {"layer": "working", "read": ["a"]},
        }
    )
    policy = Policy.from_mapping(doc, source="p")
    assert set(policy.wakes) == {"keyed", "cond", "both"}
    a = frozenset({"a"})
    assert policy.woken(a, {"a": "go", "c": True}, None) == ["keyed", "cond", "both"]
    assert policy.woken(a, {"a": "no", "c": False}, None) == ["keyed"]
    # a change of keys a node does not read, or not among its wake keys, wakes no one
    assert policy.woken(frozenset({"b"}), {"a": "go", "b": 1, "c": True}, None) == []
    assert policy.woken(frozenset({"c"}), {"a": "go", "c": True}, None) == []
    # a node's own transition never wakes it
    assert policy.woken(a, {"a": "go", "c": True}, "both") == ["keyed", "cond"]
    # a condition that cannot be evaluated does not wake (a missing key without has())
    assert policy.woken(a, {"c": True}, None) == ["keyed", "both"]


def test_the_default_policy_declares_a_wake_for_every_node() -> None:
    default = Policy.load(DEFAULT)
    assert set(default.wakes) == set(default.document.nodes)
    assert default.woken(frozenset({"raw_text"}), {"raw_text": "x"}, None) == ["input-parser"]
