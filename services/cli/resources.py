"""One JSON shape per resource, for ``-o json|jsonl|yaml`` of every command.

A protobuf message becomes a plain object by one rule (``as_resource``): every field
is present (a genesis record has ``"version": 0``), integers are JSON numbers (not the
strings of protobuf's JSON mapping), timestamps are RFC 3339 text, nested messages are
objects, and a ``*_json`` field (JSON text on the wire) is the parsed value under the
name without ``_json`` (``patch_json`` -> ``patch``; empty -> ``null``).
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

RELATIVE = re.compile(r"^([1-9][0-9]{0,5})([smhdw])\Z")
UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
TIME_FORMS = "RFC 3339 (2026-11-25T08:00:00Z) or a duration ago (90s, 30m, 1h, 2d, 1w)"


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
                found[name] = value.ToJsonString() if message.HasField(name) else None
            elif repeated:
                found[name] = [as_resource(item) for item in value]
            else:
                found[name] = as_resource(value) if message.HasField(name) else None
        elif repeated:
            found[name] = list(value)
        elif name.endswith("_json") and field.type == FieldDescriptor.TYPE_STRING:
            found[name.removesuffix("_json")] = json.loads(value) if value else None
        elif field.type == FieldDescriptor.TYPE_ENUM:
            found[name] = field.enum_type.values_by_number[value].name
        else:
            found[name] = value
    return found


def parse_time(text: str, flag: str) -> datetime:
    """An instant as people write it: RFC 3339, or a duration before now (``2d``)."""
    relative = RELATIVE.fullmatch(text.strip())
    if relative:
        amount = timedelta(**{UNITS[relative.group(2)]: int(relative.group(1))})
        return datetime.now(UTC) - amount
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        when = None
    if when is None or when.tzinfo is None or "T" not in text.upper():
        from ztate.services.cli.output import usage

        usage(f"{flag} {text!r}: give {TIME_FORMS}")
    return when
