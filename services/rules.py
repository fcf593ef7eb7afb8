"""CEL expressions in a policy: semantic invariants and risk rules.

Expressions are written in CEL, the language Kubernetes uses for admission
policy, and run on ``common-expression-language`` (bindings to the Rust
implementation: about 8 µs per evaluation here). Each expression sees:

``state``  the candidate state (after the patch), ``old`` the head state it
replaces, ``patch`` the patch itself, ``node`` the proposing node's name.

An expression must return a boolean. Any error at evaluation (a missing field
without ``has()``, a type mismatch) counts as the outcome that refuses or
parks: rules fail closed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import cel

VARIABLES = frozenset({"state", "old", "patch", "node"})
_KEY_REFERENCE = re.compile(r"\b(state|old|patch)\s*\.\s*([A-Za-z_][A-Za-z0-9_]*)")
_BOUND_BY_MACRO = re.compile(r"\.\s*(?:all|exists|exists_one|map|filter)\s*\(\s*([A-Za-z_]\w*)\s*,")


class ExpressionError(ValueError):
    """An expression that does not compile or names what does not exist."""


@dataclass(frozen=True)
class Expression:
    """A compiled CEL expression over a thread's state."""

    source: str
    program: Any
    keys: frozenset[str]

    @classmethod
    def compile(cls, source: str, declared_keys: frozenset[str]) -> Expression:
        try:
            program = cel.compile(source)
        except ValueError as exc:
            raise ExpressionError(f"not valid CEL: {str(exc).splitlines()[0]}") from None
        bound = {match[1] for match in _BOUND_BY_MACRO.finditer(source)}
        unknown_vars = sorted(set(program.variables()) - VARIABLES - bound)
        if unknown_vars:
            raise ExpressionError(
                f"unknown variables {unknown_vars}; use state, old, patch and node"
            )
        keys = frozenset(match[2] for match in _KEY_REFERENCE.finditer(source))
        unknown_keys = sorted(keys - declared_keys)
        if unknown_keys:
            raise ExpressionError(f"names keys the policy does not declare: {unknown_keys}")
        return cls(source, program, keys)

    def outcome(self, activation: dict[str, Any]) -> bool | None:
        """The boolean result, or ``None`` when the expression cannot be evaluated
        or does not return a boolean."""
        try:
            result = self.program.execute(activation)
        except (KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError):
            return None
        return result if isinstance(result, bool) else None

    def holds(self, activation: dict[str, Any]) -> bool:
        """For invariants: only a clean ``true`` holds."""
        return self.outcome(activation) is True

    def may_match(self, activation: dict[str, Any]) -> bool:
        """For risk rules: anything but a clean ``false`` matches (fail closed)."""
        return self.outcome(activation) is not False
