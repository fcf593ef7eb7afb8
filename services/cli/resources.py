"""One JSON shape per resource, for ``-o json|jsonl|yaml`` of every command.

A protobuf message becomes a plain object by one rule (``as_resource``): every field
is present (a genesis record has ``"version": 0``), integers are JSON numbers (not the
strings of protobuf's JSON mapping), timestamps are RFC 3339 text, nested messages are
objects, and a ``*_json`` field (JSON text on the wire) is the parsed value under the
name without ``_json`` (``patch_json`` -> ``patch``; empty -> ``null``).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

RELATIVE = re.compile(r"^([1-9][0-9]{0,5})([smhdw])\Z")
UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
TIME_FORMS = "RFC 3339 (2026-11-25T08:00:00Z) or a duration ago (90s, 30m, 1h, 2d, 1w)"


MAX_VERSION = 2**63 - 1  # a version is a Postgres bigint (and a protobuf int64)


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number from ``low`` to ``high`` (else exit 2, never a
    traceback from a number the wire or the database cannot hold)."""

    def parse(text: str) -> int:
        import argparse

        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {low} to {high}")
        return value

    return parse


POLICY_NAME_RULE = "1-64 characters of a-z 0-9 . _ -, the first and last a letter or digit"


def policy_name(text: str) -> str:
    """An argparse type: a policy's name as a policy file must give it (the identity
    name rule, services/runtime/identity.py ``NAME``), else exit 2 before anything is
    dialled. The text is not echoed: it may be long, or hold what a terminal acts on."""
    import argparse

    from ztate.services.runtime.identity import NAME

    if not NAME.fullmatch(text):  # fullmatch: the pattern's "$" would take a "\n"
        raise argparse.ArgumentTypeError(f"not a policy name: {POLICY_NAME_RULE}")
    return text


def bounded_float(low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a finite number from ``low`` to ``high`` (else exit 2)."""

    def parse(text: str) -> float:
        import argparse

        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not low <= value <= high:  # NaN fails every comparison
            raise argparse.ArgumentTypeError(f"must be {low:g} to {high:g}")
        return value

    return parse


CALL_TIMEOUT_SECONDS = 30.0


async def paged(
    fetch: Callable[..., Awaitable[Any]],
    request: Any,
    rows: Callable[[Any], Sequence[Any]],
    limit: int,
    convert: Callable[[Any], dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """The rows of a paged call (``fetch(request)``; ``rows(response)`` its page), each
    ``convert``ed (``as_resource``), at most ``limit`` of them. Paging stops at the
    limit, at the last page (no ``next_page_token``), and at a page the service would
    never send: one with no rows yet a token, or a token given before (a hostile or
    broken server must not keep the command asking forever)."""
    found: list[dict[str, Any]] = []
    tokens: set[str] = set()  # at most one a page, and pages are at most ``limit``
    while len(found) < limit:
        response = await fetch(request, timeout=CALL_TIMEOUT_SECONDS)
        page = rows(response)
        found += [(convert or as_resource)(row) for row in page]
        token = response.next_page_token
        if not token or not page or token in tokens:
            break
        tokens.add(token)
        request.page_token = token
    return found[:limit]


def as_resource(message: Any) -> dict[str, Any]:
    """``message`` as the one JSON shape of its kind."""
    from google.protobuf.descriptor import FieldDescriptor

    found: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        name = field.name
        repeated = (
            field.is_repeated
            if hasattr(field, "is_repeated")
            else (field.label == FieldDescriptor.LABEL_REPEATED)
        )
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.message_type.full_name == "google.protobuf.Timestamp":
                found[name] = reply_time(value, name) if message.HasField(name) else None
            elif repeated:
                found[name] = [as_resource(item) for item in value]
            else:
                found[name] = as_resource(value) if message.HasField(name) else None
        elif repeated:
            found[name] = list(value)
        elif name.endswith("_json") and field.type == FieldDescriptor.TYPE_STRING:
            found[name.removesuffix("_json")] = reply_json(value, name) if value else None
        elif field.type == FieldDescriptor.TYPE_ENUM:
            known = field.enum_type.values_by_number.get(value)
            found[name] = known.name if known is not None else value  # a newer server's
        else:
            found[name] = value
    return found


# A state or patch nests at most 128 levels (the service's ZTATE_MAX_DEPTH bound); a
# record holds them a few levels down. Deeper is no reply a ztate service sends.
MAX_REPLY_DEPTH = 160


def malformed(said: str) -> Any:
    """A reply no ztate service sends (``said`` why): one line, exit 1, nothing printed."""
    from ztate.services.cli.output import FAILED, CliError

    return CliError(f"malformed reply: {said}", FAILED)


def reply_json(text: str | bytes, what: str) -> Any:
    """A JSON value of a reply (``what``: its field), parsed as the contract admits
    values (``contract.canonical.parse_object``: no NaN or infinity, integers within
    I-JSON, no duplicate names, bounded nesting), else ``malformed``: what ``-o json``
    prints of it is then always valid JSON, and a hostile reply is no traceback."""
    from ztate.contract.canonical import parse_object
    from ztate.contract.errors import ContractError

    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    try:  # any value, not only an object: wrapped in one, its only member
        wrapped = parse_object(b'{"value":' + data + b"}", what=what, max_depth=MAX_REPLY_DEPTH + 1)
    except ContractError as exc:
        raise malformed(exc.message) from None
    if list(wrapped) != ["value"]:  # "1,\"b\":2" is no single JSON value
        raise malformed(f"{what} is not valid JSON: more than one value")
    return wrapped["value"]


def reply_time(stamp: Any, what: str) -> str:
    """A reply's timestamp as RFC 3339 text, else ``malformed`` (out of range)."""
    try:
        text: str = stamp.ToJsonString()
    except (ValueError, OverflowError):
        raise malformed(f"{what} is not a valid timestamp") from None
    return text


def parse_time(text: str, flag: str) -> datetime:
    """An instant as people write it: RFC 3339, or a duration before now (``2d``), in
    UTC; a usage error (exit 2) for anything else, or for an instant before year 1 or
    after 9999 (what a protobuf Timestamp holds)."""
    when: datetime | None = None
    try:
        relative = RELATIVE.fullmatch(text.strip())
        if relative:
            amount = timedelta(**{UNITS[relative.group(2)]: int(relative.group(1))})
            when = datetime.now(UTC) - amount
        elif "T" in text.upper():
            parsed = datetime.fromisoformat(
                text.strip().replace("Z", "+00:00").replace("z", "+00:00")
            )
            if parsed.tzinfo is not None:
                when = parsed.astimezone(UTC)
    except (ValueError, OverflowError):
        when = None
    if when is None:
        from ztate.services.cli.output import usage

        usage(f"{flag} {text!r}: give {TIME_FORMS}")
    return when
