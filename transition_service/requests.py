"""What the transition service's use cases take and give, free of gRPC: a proposal or a
revert as requested, and what became of it (committed, or parked for approval)."""

from __future__ import annotations

from dataclasses import dataclass

from ztate.services.store.rows import PendingTransition, StoredTransition


@dataclass(frozen=True, slots=True)
class Proposal:
    thread_id: str
    expected_version: int
    patch_json: bytes
    idempotency_key: str


@dataclass(frozen=True, slots=True)
class Committed:
    transition: StoredTransition
    replayed: bool


@dataclass(frozen=True, slots=True)
class Parked:
    pending: PendingTransition
    replayed: bool


Outcome = Committed | Parked


@dataclass(frozen=True, slots=True)
class Revert:
    """An operator's request to restore the state a thread had at ``to_version``."""

    thread_id: str
    to_version: int
    idempotency_key: str


@dataclass(frozen=True, slots=True)
class View:
    thread_id: str
    version: int
    head_digest: str
    state_json: bytes
