"""Canonical JSON (RFC 8785, JCS) and the strict parser that admits values into it.

Every digest in ztate is taken over JCS bytes. ``rfc8785`` is the reference
implementation; where ``orjson`` is installed (the control plane installs it, a
worker need not), ``canonical_bytes`` takes a faster path through it only for
values on which the two are proven byte-identical (``tests/unit/test_canonical.py``
checks this with property-based tests over the whole I-JSON domain):

* no floats: ECMAScript number formatting differs from orjson's (``1.0`` vs ``1``,
  ``1e+21`` vs ``1e21``), so any float goes to the reference;
* integers within +/-(2^53 - 1): enforced for every admitted value anyway;
* no object member name outside the Basic Multilingual Plane: JCS sorts names by
  UTF-16 code units and orjson by code points, which differ only there.

String escaping (control characters as ``\\uXXXX`` except ``\\b\\t\\n\\f\\r``, raw
UTF-8 otherwise) is the same in both.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections.abc import Callable
from typing import Any, TypeVar

import rfc8785

from ztate.contract.errors import ContractError, JsonMalformed, JsonOutOfRange

try:
    import orjson
except ImportError:  # a worker's install: the reference alone, byte for byte the same
    orjson = None  # type: ignore[assignment]

MAX_SAFE_INTEGER = 2**53 - 1
DEFAULT_MAX_DEPTH = 32

JsonObject = dict[str, Any]
ContractErrorT = TypeVar("ContractErrorT", bound=ContractError)


def sha256_hex(data: bytes) -> str:
    """Lower-case hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def canonical_bytes(value: Any) -> bytes:
    """The RFC 8785 canonical form of an admitted JSON value.

    Raises ``rfc8785.CanonicalizationError`` (a ``ValueError``) or ``TypeError`` for a
    value outside the I-JSON domain; ``canonical_or_error`` says it as a contract error.
    """
    if orjson is not None and _fast_path_safe(value):
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    return rfc8785.dumps(value)


def canonical_or_error(value: Any, error: type[ContractErrorT], check: str) -> bytes:
    """``canonical_bytes(value)``, or ``error(check=check)`` when the value has no
    RFC 8785 form (an integer beyond I-JSON, NaN, a type JSON does not have)."""
    try:
        return canonical_bytes(value)
    except (ValueError, TypeError, RecursionError):
        raise error("a value has no RFC 8785 form", check=check) from None


def _fast_path_safe(value: Any) -> bool:
    kind = type(value)
    if kind is str or kind is bool or value is None:
        return True
    if kind is int:
        return bool(-MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER)
    if kind is dict:
        for key, item in value.items():
            if not key.isascii() and max(key) > "\uffff":
                return False
            if not _fast_path_safe(item):
                return False
        return True
    if kind is list:
        return all(_fast_path_safe(item) for item in value)
    return False


# What ``orjson_canonical`` looks for in bytes orjson wrote, to know that the
# value they encode is inside the fast path without walking it: any float (a
# number with a fraction or an exponent), any integer of 16 digits or more (the
# bound is 2^53 - 1, 16 digits) and any character outside the Basic Multilingual
# Plane (a 4-byte UTF-8 sequence, which orjson never escapes). Strings are cut
# out first, so that digits and dots inside them ("...T00:00:01.000000Z") do not
# count. Over-approximating is safe: it only sends a value to the slow path.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_OUTSIDE_FAST_PATH_NUMBER = re.compile(rb"[0-9][.eE]|[0-9]{16}")
_NON_BMP = re.compile(rb"[\xf0-\xff]")


def orjson_canonical(data: bytes, value: Any) -> bool:
    """True when ``data`` is what orjson writes of ``value`` (keys sorted) and lies
    inside the fast path, so that ``data == canonical_bytes(value)`` without a walk
    of ``value``. False says nothing: ask ``canonical_bytes``.
    """
    if orjson is None or not fast_path_bytes(data):
        return False
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS) == data
    except orjson.JSONEncodeError:
        return False


def fast_path_bytes(data: bytes) -> bool:
    """Whether JSON bytes (compact, as orjson writes them) hold no float, no integer
    of 16 digits or more and no character outside the BMP: then the value they
    encode is one on which ``canonical_bytes`` takes the orjson fast path."""
    if not data.isascii() and _NON_BMP.search(data):
        return False
    # with no escapes, every other piece between quotes is a string
    skeleton = _STRING.sub(b'""', data) if b"\\" in data else b"".join(data.split(b'"')[::2])
    return _OUTSIDE_FAST_PATH_NUMBER.search(skeleton) is None


def hashed_name(name: str) -> str:
    """A member name an attacker chose, shown by the first 16 hex digits of its SHA-256
    (the default of ``parse_object``: it never repeats what it was sent)."""
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
    return f"sha256:{digest[:16]}"


def _duplicate_free(shown: Callable[[str], str]) -> Callable[[list[tuple[str, Any]]], JsonObject]:
    def build(pairs: list[tuple[str, Any]]) -> JsonObject:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            seen: set[str] = set()
            for name, _ in pairs:
                if name in seen:
                    raise JsonMalformed(f"duplicate member name {shown(name)}")
                seen.add(name)
        return obj

    return build


class _NumberRefused(Exception):
    """Raised inside the JSON parser's number hooks; re-raised with context."""


# A double at or above 2^53 is an integer that JCS writes as a bare integer (up to
# 1e21, where exponent notation starts); it would canonicalise outside I-JSON.
_FIRST_EXPONENT_FORM = 1e21


def _parse_int(literal: str) -> int:
    # Checked on the literal first: Python refuses to convert over 4300 digits.
    if len(literal.lstrip("-")) > 16 or abs(value := int(literal)) > MAX_SAFE_INTEGER:
        raise _NumberRefused("an integer outside the I-JSON range +/-(2^53 - 1)")
    return value


def _parse_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _NumberRefused("a number too large for a double")
    if value == 0.0 and any(c in "123456789" for c in literal.lower().partition("e")[0]):
        raise _NumberRefused("a number too small for a double (it would round to 0)")
    if MAX_SAFE_INTEGER < abs(value) < _FIRST_EXPONENT_FORM:
        raise _NumberRefused("an integer outside the I-JSON range +/-(2^53 - 1)")
    return value


def _parse_constant(name: str) -> Any:
    raise _NumberRefused(f"{name}, which is not a JSON number")


@functools.lru_cache(maxsize=16)
def _decoder(shown_name: Callable[[str], str]) -> json.JSONDecoder:
    """One decoder per way of naming a duplicate: ``json.loads`` with hooks builds a
    new decoder on every call, a third of the parse of a 1 KB patch. A decoder keeps
    no state between calls (its scanner clears the member-name memo after each)."""
    return json.JSONDecoder(
        object_pairs_hook=_duplicate_free(shown_name),
        parse_int=_parse_int,
        parse_float=_parse_float,
        parse_constant=_parse_constant,
    )


def parse_object(
    data: bytes,
    *,
    what: str,
    max_depth: int = DEFAULT_MAX_DEPTH,
    shown_name: Callable[[str], str] = hashed_name,
) -> JsonObject:
    """Parse ``data`` as a UTF-8 JSON object inside the I-JSON domain (RFC 7493).

    Refuses, with ``JsonMalformed``: bytes that are not UTF-8, text that is not
    JSON, a top-level value that is not an object, duplicate member names (named
    by ``shown_name``) and lone surrogates. Refuses, with ``JsonOutOfRange``: integers beyond
    +/-(2^53 - 1) (also when written as a float such as ``1e20``), numbers that
    overflow or underflow a double, NaN and infinities, and nesting deeper than
    ``max_depth``. Nothing is rounded out of range or coerced.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonMalformed(f"{what} is not valid UTF-8 (byte {exc.start})") from None
    try:
        value = _decoder(shown_name).decode(text)
    except json.JSONDecodeError as exc:
        raise JsonMalformed(
            f"{what} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        ) from None
    except _NumberRefused as exc:
        raise JsonOutOfRange(f"{what} holds {exc}") from None
    except RecursionError:
        raise JsonOutOfRange(f"{what} nests deeper than {max_depth} levels") from None
    if type(value) is not dict:
        raise JsonMalformed(f"{what} must be a JSON object")
    _check_structure(value, 1, max_depth, what)
    return value


def _check_string(text: str, what: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise JsonMalformed(f"{what} holds a lone surrogate") from None


def _check_structure(value: Any, depth: int, max_depth: int, what: str) -> None:
    """Depth and string checks the parser's hooks cannot make."""
    kind = type(value)
    if kind is str:
        _check_string(value, what)
    elif kind is dict or kind is list:
        if depth > max_depth:
            raise JsonOutOfRange(f"{what} nests deeper than {max_depth} levels")
        if kind is dict:
            for key, item in value.items():
                _check_string(key, what)
                _check_structure(item, depth + 1, max_depth, what)
        else:
            for item in value:
                _check_structure(item, depth + 1, max_depth, what)
