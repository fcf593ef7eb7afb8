"""What a change is, as the policy's rules and the verifier see it.

A patch applies to a state by one rule (each member sets its key; a null member
removes it). Invariants must hold on the resulting state and risk rules decide
whether it needs approval. The transition service applies these on every
proposal, and the offline verifier re-applies them to every stored record, so
they live here, in the shared core, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ztate.contract.canonical import JsonObject
from ztate.services.policy.model import Policy
from ztate.services.policy.rules import bind
from ztate.services.runtime import errors


def apply_patch(state: JsonObject, patch: JsonObject) -> JsonObject:
    """Each member sets its key; a null member removes it."""
    result = dict(state)
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = value
    return result


def changed_keys(old: JsonObject, patch: JsonObject) -> frozenset[str]:
    """The keys ``patch`` really changes in ``old`` (a value set to what it already is,
    or the removal of a key that is not there, changes nothing): what a version wakes
    nodes by, as a key risk rule matches only a real change."""
    return frozenset(key for key, value in patch.items() if value != old.get(key))


@dataclass(frozen=True, slots=True)
class Change:
    """A proposed change as the policy's rules see it."""

    state: JsonObject
    old: JsonObject
    patch: JsonObject
    node: str
    bound: Any  # the CEL context of the policy's expressions; None if it has none

    @classmethod
    def of(
        cls, policy: Policy, state: JsonObject, old: JsonObject, patch: JsonObject, node: str
    ) -> Change:
        values = {"state": state, "old": old, "patch": patch, "node": node}
        return cls(state, old, patch, node, bind(policy.reads, values) if policy.reads else None)


def check_invariants(policy: Policy, change: Change) -> None:
    broken = [inv for inv in policy.invariants if not inv.expression.holds(change.bound)]
    if broken:
        first = broken[0]
        raise errors.InvariantViolated(
            f"invariant {first.name!r} does not hold"
            + (f": {first.message}" if first.message else ""),
            rules=[inv.name for inv in broken],
        )


def matched_risk_rules(policy: Policy, change: Change) -> list[str]:
    """Names of the risk rules this change matches (a key rule needs a real change)."""
    old, patch = change.old, change.patch
    matched = []
    for rule in policy.risk_rules:
        if rule.expression is not None:
            hit = rule.expression.may_match(change.bound)
        else:
            hit = any(key in patch and patch[key] != old.get(key) for key in rule.keys)
        if hit:
            matched.append(rule.name)
    return matched
