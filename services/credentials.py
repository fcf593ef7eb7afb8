"""Credential detection in state values (interim version; being replaced)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_PATTERNS = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY( BLOCK)?-----|\bAKIA[0-9A-Z]{16}\b")


@dataclass(frozen=True, slots=True)
class CredentialFinding:
    kind: str
    path: str


def find_credential(value: object, *, high_entropy: bool = True) -> CredentialFinding | None:
    """First credential-looking string in a JSON value, or None."""
    if isinstance(value, str):
        return CredentialFinding("credential", "") if _PATTERNS.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            found = find_credential(key, high_entropy=high_entropy) or find_credential(
                item, high_entropy=high_entropy
            )
            if found:
                return CredentialFinding(found.kind, f"/{key}{found.path}")
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = find_credential(item, high_entropy=high_entropy)
            if found:
                return CredentialFinding(found.kind, f"/{index}{found.path}")
    return None
