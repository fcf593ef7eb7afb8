"""The policy: which state keys exist and what each node may read and write.

A policy is a YAML or JSON document, validated in full when loaded (a bad policy
stops start-up; it is never half-applied). Its digest, recorded in every ledger
record, is SHA-256 over the RFC 8785 form of the validated document.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)

from services.canonical import canonical_bytes, sha256_hex
from services.identity import NAME

POLICY_FORMAT = 1
KeyName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,63}$")]
NodeName = Annotated[str, StringConstraints(pattern=NAME.pattern)]


class PolicyError(ValueError):
    """The policy document is invalid; the message points at the offending entry."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class KeySpec(_Strict):
    """One state key."""

    description: str = ""


class NodeSpec(_Strict):
    """What one node may see and change."""

    read: list[KeyName] = Field(default_factory=list)
    write: list[KeyName] = Field(default_factory=list)
    max_patch_bytes: int | None = Field(default=None, gt=0, le=4 * 1024 * 1024)


class PolicyDocument(_Strict):
    """The policy file as written."""

    format: int = Field(description="policy format version")
    name: NodeName
    keys: dict[KeyName, KeySpec]
    nodes: dict[NodeName, NodeSpec]

    @model_validator(mode="after")
    def _references_resolve(self) -> PolicyDocument:
        if self.format != POLICY_FORMAT:
            raise ValueError(f"unsupported policy format {self.format}; expected {POLICY_FORMAT}")
        for node_name, node in self.nodes.items():
            for verb, keys in (("read", node.read), ("write", node.write)):
                unknown = sorted(set(keys) - set(self.keys))
                if unknown:
                    raise ValueError(f"nodes.{node_name}.{verb} names undeclared keys {unknown}")
        return self


class Policy:
    """A validated policy, indexed for the proposal path."""

    def __init__(self, document: PolicyDocument) -> None:
        self.document = document
        self.name = document.name
        self.digest = sha256_hex(canonical_bytes(document.model_dump(mode="json")))
        self.keys = frozenset(document.keys)
        self._readable = {name: frozenset(node.read) for name, node in document.nodes.items()}
        self._writable = {name: frozenset(node.write) for name, node in document.nodes.items()}

    def is_registered(self, node: str) -> bool:
        return node in self._readable

    def readable(self, node: str) -> frozenset[str]:
        return self._readable[node]

    def writable(self, node: str) -> frozenset[str]:
        return self._writable[node]

    def max_patch_bytes(self, node: str) -> int | None:
        return self.document.nodes[node].max_patch_bytes

    def unknown_keys(self, keys: Iterable[str]) -> list[str]:
        return sorted(set(keys) - self.keys)

    @classmethod
    def from_mapping(cls, raw: Any, *, source: str) -> Policy:
        try:
            return cls(PolicyDocument.model_validate(raw))
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(part) for part in err['loc']) or '<document>'}: {err['msg']}"
                for err in exc.errors()
            )
            raise PolicyError(f"{source}: {problems}") from None

    @classmethod
    def load(cls, path: Path) -> Policy:
        """Load and validate a policy file (.yaml, .yml or .json)."""
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise PolicyError(f"{path}: cannot read policy ({exc.strerror})") from None
        try:
            raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as exc:
            raise PolicyError(
                f"{path}: not valid {path.suffix.lstrip('.') or 'YAML'}: {exc}"
            ) from None
        return cls.from_mapping(raw, source=str(path))
