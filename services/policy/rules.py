"""CEL expressions in a policy: semantic invariants and risk rules.

Expressions are written in CEL, the language Kubernetes uses for admission
policy, and run on ``common-expression-language`` (bindings to the Rust
implementation). Each expression sees:

``state``  the candidate state (after the patch), ``old`` the head state it
replaces, ``patch`` the patch itself, ``node`` the proposing node's name.

Handing Python values to CEL dominates the cost (about 3 µs per object member;
evaluating a compiled expression on bound values takes about 2 µs). So a
proposal binds its values once, in one ``cel.Context`` shared by every
expression of the policy, and binds of each variable only the top-level keys the
policy's expressions read (the whole value when an expression uses it other
than as ``var.key``).

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
_USED_WHOLE = {
    var: re.compile(rf"\b{var}\b(?!\s*\.\s*[A-Za-z_])") for var in ("state", "old", "patch", "node")
}
_USED = {var: re.compile(rf"\b{var}\b") for var in ("state", "old", "patch", "node")}

# What a set of expressions reads of each variable: the top-level keys, or None
# for the whole value. A variable nobody reads is absent.
Reads = dict[str, frozenset[str] | None]


class ExpressionError(ValueError):
    """An expression that does not compile or names what does not exist."""


@dataclass(frozen=True)
class Expression:
    """A compiled CEL expression over a thread's state."""

    source: str
    program: Any
    keys: frozenset[str]
    reads: Reads

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
        reads: Reads = {}
        for var, used in _USED.items():
            if not used.search(source):
                continue
            if _USED_WHOLE[var].search(source):
                reads[var] = None
            else:
                reads[var] = frozenset(m[2] for m in _KEY_REFERENCE.finditer(source) if m[1] == var)
        return cls(source, program, keys, reads)

    def outcome(self, activation: Any) -> bool | None:
        """The boolean result, or ``None`` when the expression cannot be evaluated
        or does not return a boolean."""
        try:
            result = self.program.execute(activation)
        except Exception:  # every evaluation error is "no result"
            # the CEL library raises KeyError, TypeError, ValueError, ZeroDivisionError,
            # OverflowError, but also IndexError (a list index out of range) and
            # RuntimeError (timestamp(), duration(), int() of a string it cannot parse, a
            # bad regex in matches()): each is an expression that cannot be evaluated on
            # this state, which an invariant refuses and a risk rule parks, never an
            # INTERNAL (whose text would quote state values into the log)
            return None
        return result if isinstance(result, bool) else None

    def holds(self, activation: Any) -> bool:
        """For invariants: only a clean ``true`` holds."""
        return self.outcome(activation) is True

    def may_match(self, activation: Any) -> bool:
        """For risk rules: anything but a clean ``false`` matches (fail closed)."""
        return self.outcome(activation) is not False


def merge_reads(expressions: list[Expression]) -> Reads:
    """What all of ``expressions`` read, together."""
    merged: Reads = {}
    for expression in expressions:
        for var, keys in expression.reads.items():
            if var in merged and (merged[var] is None or keys is None):
                merged[var] = None
            else:
                merged[var] = (merged.get(var) or frozenset()) | (keys or frozenset())
    return merged


def bind(reads: Reads, values: dict[str, Any]) -> Any:
    """One CEL context holding just what the expressions read of ``values``."""
    context = cel.Context()
    for var, keys in reads.items():
        value = values[var]
        if keys is not None and isinstance(value, dict):
            value = {key: value[key] for key in keys if key in value}
        context.add_variable(var, value)
    return context
