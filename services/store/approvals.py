"""The transition service's side of approvals, in Postgres.

Applying an approval is one statement, like any commit: the compare-and-swap on
the head at the parked base version, the pending transition's status, the
receipt (whose nonce is unique forever) and the ledger record commit together or
not at all. Every change of a parked transition's status is announced on the
``ztate_outcomes`` channel so that waiting proposers, on any replica, wake up.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime, timedelta

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from ztate.contract.receipts import SignedReceipt
from ztate.contract.record import SealedRecord
from ztate.services.store.boundary import translated
from ztate.services.store.rows import PendingTransition, Rejection
from ztate.services.store.transitions import PENDING_COLUMNS, storable_rejection

NONCE_CONSTRAINT = "receipts_nonce_key"


class Approved(enum.Enum):
    """What ``ApprovalStore.commit_approved`` did; only ``COMMITTED`` wrote anything."""

    COMMITTED = "committed"
    HEAD_MOVED = "head moved"  # the thread moved on since the proposal was parked
    KEY_TAKEN = "key taken"  # a committed request took its idempotency key meanwhile
    NONCE_USED = "nonce used"  # the receipt's nonce authorised something before
    NOT_PENDING = "not pending"  # decided, expired or made stale meanwhile


@dataclass(frozen=True, slots=True)
class ApprovedCommit:
    """The outcome, and the parked row's status when it was ``NOT_PENDING``."""

    outcome: Approved
    status: str | None = None


OUTCOME_CHANNEL = "ztate_outcomes"

COMMIT_APPROVED = """
WITH head AS (
    UPDATE ztate.threads
       SET version = $3, head_digest = $4, state = $5, updated_at = $10
     WHERE thread_id = $1 AND version = $2 AND head_digest = $6
 RETURNING thread_id
), pend AS (
    UPDATE ztate.pending_transitions
       SET status = 'committed', decided_at = $10
     WHERE digest = $14 AND status = 'pending' AND EXISTS (SELECT 1 FROM head)
 RETURNING digest
), used AS (
    INSERT INTO ztate.receipts (receipt_digest, transition_digest, decision, nonce, receipt,
                                signature, key_id, applied_at)
    SELECT $15, digest, 'approve', $16, $17, $18, $19, $10 FROM pend
    RETURNING transition_digest
), announced AS (
    SELECT pg_notify('ztate_outcomes', transition_digest) FROM used
)
INSERT INTO ztate.transitions (thread_id, version, digest, parent_digest, node_id, key_id,
                               signature, record, state, idempotency_key, request_digest,
                               committed_at, receipt, receipt_signature, receipt_key_id)
SELECT thread_id, $3, $4, $6, $7, $8, $9, $11, $5, $12, $13, $10, $17, $18, $19
  FROM head, used, announced
RETURNING version
"""

CLOSE_REJECTED = """
WITH pend AS (
    UPDATE ztate.pending_transitions SET status = 'rejected', decided_at = $2
     WHERE digest = $1 AND status = 'pending'
 RETURNING digest
), used AS (
    INSERT INTO ztate.receipts (receipt_digest, transition_digest, decision, nonce, receipt,
                                signature, key_id, applied_at)
    SELECT $3, digest, 'reject', $4, $5, $6, $7, $2 FROM pend
    RETURNING transition_digest
)
SELECT pg_notify('ztate_outcomes', transition_digest) FROM used
"""

CLOSE_WITHOUT_DECISION = """
WITH pend AS (
    UPDATE ztate.pending_transitions SET status = $2, decided_at = $3
     WHERE digest = ANY($1::text[]) AND status = 'pending'
 RETURNING digest
)
SELECT digest, pg_notify('ztate_outcomes', digest) FROM pend
"""


# Refused at commit: the rejection row and the status change in one statement, so that
# a waiter woken by the notification always finds the reason.
CLOSE_REFUSED = """
WITH pend AS (
    UPDATE ztate.pending_transitions SET status = 'refused', decided_at = $2
     WHERE digest = $1 AND status = 'pending'
 RETURNING digest
), rejected AS (
    INSERT INTO ztate.rejections (method, node_id, thread_id, base_version, reason, keys,
                                  patch_digest, patch_bytes, message)
    SELECT $3, $4, $5, $6, $7, $8, NULL, NULL, $9 FROM pend
)
SELECT digest, pg_notify('ztate_outcomes', digest) FROM pend
"""


class ApprovalStore:
    """Parked transitions, receipts and the outbox towards the approval service."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @translated
    async def nonce_used(self, nonce: str) -> bool:
        used = await self._pool.fetchval("SELECT 1 FROM ztate.receipts WHERE nonce = $1", nonce)
        return used is not None

    @translated
    async def commit_approved(
        self,
        sealed: SealedRecord,
        state_bytes: bytes,
        pending: PendingTransition,
        receipt: SignedReceipt,
        nonce: str,
        committed_at: datetime,
    ) -> ApprovedCommit:
        """Commit a parked transition under its receipt, in one transaction that
        first locks the parked row; every outcome but ``COMMITTED`` wrote nothing."""
        try:
            async with self._pool.acquire() as conn, conn.transaction():
                status = await conn.fetchval(
                    "SELECT status FROM ztate.pending_transitions WHERE digest = $1 FOR UPDATE",
                    pending.digest,
                )
                if status != "pending":
                    return ApprovedCommit(Approved.NOT_PENDING, str(status))
                committed = await self._commit_locked(
                    conn, sealed, state_bytes, pending, receipt, nonce, committed_at
                )
        except asyncpg.UniqueViolationError as violation:
            # the whole transaction rolled back
            if violation.constraint_name == NONCE_CONSTRAINT:
                return ApprovedCommit(Approved.NONCE_USED)
            return ApprovedCommit(Approved.KEY_TAKEN)
        return ApprovedCommit(Approved.COMMITTED if committed else Approved.HEAD_MOVED)

    @staticmethod
    async def _commit_locked(
        conn: PoolConnectionProxy[asyncpg.Record],
        sealed: SealedRecord,
        state_bytes: bytes,
        pending: PendingTransition,
        receipt: SignedReceipt,
        nonce: str,
        committed_at: datetime,
    ) -> bool:
        record = sealed.record
        version = await conn.fetchval(
            COMMIT_APPROVED,
            record["thread_id"],
            pending.base_version,
            record["version"],
            sealed.digest,
            state_bytes,
            record["parent_digest"],
            record["node_id"],
            sealed.key_id,
            sealed.signature,
            committed_at,
            sealed.record_bytes,
            pending.idempotency_key,
            pending.request_digest,
            pending.digest,
            receipt.digest,
            nonce,
            receipt.receipt_bytes,
            receipt.signature,
            receipt.key_id,
        )
        return version is not None

    @translated
    async def close_rejected(
        self, pending: PendingTransition, receipt: SignedReceipt, nonce: str, at: datetime
    ) -> bool:
        """Record a rejection; False if the transition was no longer pending."""
        row = await self._pool.fetchrow(
            CLOSE_REJECTED,
            pending.digest,
            at,
            receipt.digest,
            nonce,
            receipt.receipt_bytes,
            receipt.signature,
            receipt.key_id,
        )
        return row is not None

    @translated
    async def close_refused(self, digest: str, rejection: Rejection, at: datetime) -> bool:
        """Close an approved transition the policy no longer allows, recording why, at
        once; False if it was no longer pending (nothing written)."""
        safe = storable_rejection(rejection)
        row = await self._pool.fetchrow(
            CLOSE_REFUSED,
            digest,
            at,
            safe.method,
            safe.node_id,
            safe.thread_id,
            safe.base_version,
            safe.reason,
            list(safe.keys),
            safe.message,
        )
        return row is not None

    @translated
    async def close_without_decision(
        self, digests: list[str], status: str, at: datetime
    ) -> list[str]:
        """Mark pending transitions stale or expired; returns those that changed."""
        rows = await self._pool.fetch(CLOSE_WITHOUT_DECISION, digests, status, at)
        return [row["digest"] for row in rows]

    @translated
    async def overdue(self, older_than: timedelta, now: datetime) -> list[str]:
        rows = await self._pool.fetch(
            "SELECT digest FROM ztate.pending_transitions "
            "WHERE status = 'pending' AND parked_at < $1 ORDER BY parked_at LIMIT 500",
            now - older_than,
        )
        return [row["digest"] for row in rows]

    @translated
    async def to_submit(self, limit: int) -> list[PendingTransition]:
        rows = await self._pool.fetch(
            f"SELECT {PENDING_COLUMNS} FROM ztate.pending_transitions "  # noqa: S608
            "WHERE submitted_at IS NULL AND status = 'pending' ORDER BY parked_at LIMIT $1",
            limit,
        )
        return [PendingTransition.from_row(row) for row in rows]

    @translated
    async def mark_submitted(self, digest: str, at: datetime) -> None:
        await self._pool.execute(
            "UPDATE ztate.pending_transitions SET submitted_at = $2 "
            "WHERE digest = $1 AND submitted_at IS NULL",
            digest,
            at,
        )

    @translated
    async def base_of(self, pending: PendingTransition) -> tuple[bytes, bytes | None]:
        """The ledger record and state body (None once pruned) a parked proposal builds
        on: the approval service derives the review from them (docs/approvals.md)."""
        row = await self._pool.fetchrow(
            "SELECT record, state FROM ztate.transitions WHERE thread_id = $1 AND version = $2",
            pending.thread_id,
            pending.base_version,
        )
        if row is None:
            raise LookupError(f"no record at {pending.thread_id}@{pending.base_version}")
        return bytes(row["record"]), None if row["state"] is None else bytes(row["state"])

    @translated
    async def candidate_state(self, digest: str) -> bytes | None:
        state: bytes | None = await self._pool.fetchval(
            "SELECT state FROM ztate.pending_transitions WHERE digest = $1", digest
        )
        return state
