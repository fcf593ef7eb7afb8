"""Typed state keys: the type language of a policy and the strict validators built from it.

Each key of a policy has a type. From those types ztate builds strict pydantic
validators (``extra="forbid"``, ``strict=True``, ``frozen=True``): nothing
is coerced ("1" is not 1, 1 is not true, 1.5 is not an integer), unknown members
are refused at every depth, and strings, lists and numbers are bounded. The
model only judges; the value committed is the parsed JSON itself, untouched.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from ztate.contract.canonical import MAX_SAFE_INTEGER
from ztate.services.policy.credentials import shown_name

UUID_PATTERN = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
# RFC 3339's date-time (upper-case T and Z): an offset's hour 00-23 and minute 00-59
# (Python's fromisoformat takes minutes up to 99, which CEL's timestamp() refuses)
RFC3339 = re.compile(
    r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,9})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)\Z",
    re.ASCII,
)
MEMBER_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"
DEFAULT_MAX_LENGTH = 4096
DEFAULT_MAX_ITEMS = 64
MAX_TYPE_DEPTH = 8

_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)


class _Spec(BaseModel):
    model_config = _STRICT

    description: str = ""


class StringType(_Spec):
    type: Literal["string"]
    min_length: int = Field(default=0, ge=0)
    max_length: int = Field(default=DEFAULT_MAX_LENGTH, gt=0, le=1024 * 1024)
    pattern: str | None = None

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"pattern is not a valid regular expression: {exc}") from None
        return pattern


class IntegerType(_Spec):
    type: Literal["integer"]
    minimum: int = Field(default=-MAX_SAFE_INTEGER, ge=-MAX_SAFE_INTEGER, le=MAX_SAFE_INTEGER)
    maximum: int = Field(default=MAX_SAFE_INTEGER, ge=-MAX_SAFE_INTEGER, le=MAX_SAFE_INTEGER)


class NumberType(_Spec):
    type: Literal["number"]
    minimum: float | None = None
    maximum: float | None = None


class BooleanType(_Spec):
    type: Literal["boolean"]


class EnumType(_Spec):
    type: Literal["enum"]
    values: list[str] = Field(min_length=1, max_length=256)

    @field_validator("values")
    @classmethod
    def _unique(cls, values: list[str]) -> list[str]:
        if len(set(values)) != len(values):
            raise ValueError("enum values must be unique")
        return values


class UuidType(_Spec):
    type: Literal["uuid"]


class TimestampType(_Spec):
    type: Literal["timestamp"]


class ListType(_Spec):
    type: Literal["list"]
    items: TypeSpec
    min_items: int = Field(default=0, ge=0)
    max_items: int = Field(default=DEFAULT_MAX_ITEMS, gt=0, le=10_000)


class ObjectType(_Spec):
    type: Literal["object"]
    properties: dict[Annotated[str, StringConstraints(pattern=MEMBER_NAME)], TypeSpec] = Field(
        min_length=1
    )
    required: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _required_are_properties(self) -> ObjectType:
        unknown = sorted(set(self.required) - set(self.properties))
        if unknown:
            raise ValueError(f"required names properties that do not exist: {unknown}")
        return self


TypeSpec = Annotated[
    StringType
    | IntegerType
    | NumberType
    | BooleanType
    | EnumType
    | UuidType
    | TimestampType
    | ListType
    | ObjectType,
    Field(discriminator="type"),
]
ListType.model_rebuild()
ObjectType.model_rebuild()


def _rfc3339(text: str) -> str:
    if not RFC3339.match(text):
        raise ValueError("must be an RFC 3339 timestamp such as 2026-01-02T03:04:05Z")
    try:
        datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError("is not a real date and time") from None
    return text


def type_depth(spec: TypeSpec) -> int:
    """How deep values of this type nest (a scalar is 0)."""
    if isinstance(spec, ListType):
        return 1 + type_depth(spec.items)
    if isinstance(spec, ObjectType):
        return 1 + max(type_depth(p) for p in spec.properties.values())
    return 0


def python_type(spec: TypeSpec, name: str) -> Any:
    """The strict pydantic annotation that admits exactly the values of ``spec``."""
    if isinstance(spec, StringType):
        return Annotated[
            str,
            StringConstraints(
                min_length=spec.min_length, max_length=spec.max_length, pattern=spec.pattern
            ),
        ]
    if isinstance(spec, IntegerType):
        return Annotated[int, Field(ge=spec.minimum, le=spec.maximum)]
    if isinstance(spec, NumberType):
        return Annotated[float, Field(ge=spec.minimum, le=spec.maximum, allow_inf_nan=False)]
    if isinstance(spec, BooleanType):
        return bool
    if isinstance(spec, EnumType):
        return Literal[tuple(spec.values)]
    if isinstance(spec, UuidType):
        return Annotated[str, StringConstraints(pattern=UUID_PATTERN)]
    if isinstance(spec, TimestampType):
        return Annotated[str, AfterValidator(_rfc3339)]
    if isinstance(spec, ListType):
        item = python_type(spec.items, f"{name}_item")
        return Annotated[list[item], Field(min_length=spec.min_items, max_length=spec.max_items)]  # type: ignore[valid-type]
    fields: dict[str, Any] = {
        prop: (python_type(sub, f"{name}_{prop}"), ... if prop in spec.required else None)
        for prop, sub in spec.properties.items()
    }
    return create_model(f"Object_{name}", __config__=_STRICT, **fields)


MAX_NAMED_PROBLEMS = 32


class TypeMismatch(ValueError):
    """Values that do not fit their declared types; ``problems`` never holds the values."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        self.keys = sorted({path.split(".", 1)[0] for path, _ in problems})
        # a value with a thousand extra members has a thousand problems: the message
        # names the first MAX_NAMED_PROBLEMS and counts the rest
        shown = "; ".join(f"{path}: {message}" for path, message in problems[:MAX_NAMED_PROBLEMS])
        more = len(problems) - MAX_NAMED_PROBLEMS
        super().__init__(shown if more <= 0 else f"{shown}; and {more} more")


class StateValidator:
    """Validates top-level state members against their declared types.

    One strict validator per declared key, so that a patch pays for the keys it
    writes, not for the policy's whole model (a one-key patch validated 5x faster).
    ``model`` is that whole model; ``check`` answers exactly as its
    ``model_validate`` would, problem for problem and in its order (declared keys in
    declaration order, then undeclared ones as given): a test holds them equal."""

    def __init__(self, name: str, types: dict[str, TypeSpec]) -> None:
        annotations = {key: python_type(spec, key) for key, spec in types.items()}
        fields: dict[str, Any] = {key: (kind, None) for key, kind in annotations.items()}
        self.model = create_model(f"State_{name}", __config__=_STRICT, **fields)
        self._adapters = {key: _strict_adapter(kind) for key, kind in annotations.items()}
        self._rank = {key: rank for rank, key in enumerate(annotations)}

    def check(self, members: dict[str, Any]) -> None:
        """Refuse members that do not fit their types (``None`` members are skipped:
        in a patch they remove a key)."""
        present = [key for key, value in members.items() if value is not None]
        if len(present) > 1:
            present.sort(key=lambda key: self._rank.get(key, len(self._rank)))
        problems: list[tuple[str, str]] = []
        for key in present:
            adapter = self._adapters.get(key)
            if adapter is None:
                problems.append((shown_name(key), "Extra inputs are not permitted"))
                continue
            try:
                adapter.validate_python(members[key])
            except ValidationError as exc:
                problems += [
                    (".".join(_shown_loc((key, *err["loc"]))), err["msg"])
                    for err in exc.errors(include_input=False, include_url=False)
                ]
        if problems:
            raise TypeMismatch(problems)


def _strict_adapter(kind: Any) -> TypeAdapter[Any]:
    """A validator of ``kind`` under the models' strict configuration (an object type
    is a model that carries it already, and may not be given it again)."""
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return TypeAdapter(kind)
    return TypeAdapter(kind, config=_STRICT)


def _shown_loc(loc: tuple[int | str, ...]) -> list[str]:
    """Error locations hold member names an attacker may have chosen (an extra
    member's name): show those that are not plain names by digest."""
    return [shown_name(part) if isinstance(part, str) else str(part) for part in loc]
