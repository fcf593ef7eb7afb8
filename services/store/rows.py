"""The rows the transition store hands out: plain values, no driver types.

What each field means is in docs/ledger-format.md (the tables) and in the store's
contract (``ztate.services.store.interface``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol


class Row(Protocol):
    """A database row as a driver returns it: named columns."""

    def items(self) -> Iterable[tuple[str, Any]]: ...


@dataclass(frozen=True, slots=True)
class Head:
    """A thread's head as stored."""

    thread_id: str
    version: int
    digest: str
    state_bytes: bytes
    policy_name: str
    policy_digest: str


@dataclass(frozen=True, slots=True)
class StoredTransition:
    """One ledger row, with the exact record bytes that were hashed."""

    thread_id: str
    version: int
    digest: str
    parent_digest: str
    node_id: str
    key_id: str
    signature: str
    record: bytes
    committed_at: datetime
    idempotency_key: str | None
    request_digest: str | None

    @classmethod
    def from_row(cls, row: Row) -> StoredTransition:
        return cls(**dict(row.items()))


@dataclass(frozen=True, slots=True)
class Evidence:
    """What a record was committed under: its approval receipt (if any), and the
    risk rules the approved proposal matched."""

    receipt: bytes | None
    receipt_signature: str | None
    receipt_key_id: str | None
    risk_rules: list[str]


@dataclass(frozen=True, slots=True)
class VersionState:
    """One version of a thread with its kept state body (None once pruned)."""

    version: int
    digest: str
    state: bytes | None


@dataclass(frozen=True, slots=True)
class CheckpointRow:
    """A signed checkpoint of a thread head, as stored."""

    checkpoint: bytes
    signature: str
    key_id: str


@dataclass(frozen=True, slots=True)
class PendingTransition:
    """A proposal parked for approval."""

    digest: str
    thread_id: str
    base_version: int
    parent_digest: str
    node_id: str
    proposal: bytes
    risk_rules: list[str]
    idempotency_key: str
    request_digest: str
    status: str
    parked_at: datetime
    sensitive_keys: list[str]
    required_approvals: int

    @classmethod
    def from_row(cls, row: Row) -> PendingTransition:
        return cls(**dict(row.items()))


@dataclass(frozen=True, slots=True)
class Rejection:
    """One refused request, as the rejections ledger records it."""

    method: str
    node_id: str
    thread_id: str | None
    base_version: int | None
    reason: str
    keys: Sequence[str]
    patch_digest: str | None
    patch_bytes: int | None
    message: str


@dataclass(frozen=True, slots=True)
class Backend:
    """A Postgres session: its backend pid and when it started (unique together)."""

    pid: int
    started: datetime
