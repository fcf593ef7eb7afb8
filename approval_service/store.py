"""The approval service's storage: reviews, decisions, signed receipts and their outbox.

Everything lives in the schema ``ztate_approval``, reached through the service's own
pool as its own least-privilege role: it can read and append reviews, decisions and
receipts and change only a review's status and a receipt's delivery mark, and it
cannot see the transition service's tables at all. Deciding on a review locks its
row (``SELECT ... FOR UPDATE``) for the whole transaction, so reviewers deciding at
the same moment are serialised and a review is closed, and its receipt signed,
exactly once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from ztate.contract.receipts import SignedReceipt
from ztate.services.runtime.revocation import serial_text
from ztate.services.store.transitions import keep_session

OPEN, APPROVED, REJECTED, EXPIRED = "open", "approved", "rejected", "expired"
STATUSES = (OPEN, APPROVED, REJECTED, EXPIRED)

REVIEW_COLUMNS = """
r.digest, r.thread_id, r.base_version, r.node_id, r.risk_rules, r.required_approvals,
r.redacted_diff, r.status, r.opened_at, r.expires_at, r.closed_at,
ARRAY(SELECT d.reviewer FROM ztate_approval.decisions d
       WHERE d.digest = r.digest AND d.decision = 'approve'
       ORDER BY d.reviewer) AS approvers,
c.receipt, c.signature AS receipt_signature, c.key_id AS receipt_key_id, c.delivered_at,
c.outcome
"""

REVIEWS = "ztate_approval.reviews r LEFT JOIN ztate_approval.receipts c ON c.digest = r.digest"

INSERT_REVIEW = """
INSERT INTO ztate_approval.reviews (digest, thread_id, base_version, node_id, risk_rules,
                                    required_approvals, proposal, redacted_diff, opened_at,
                                    expires_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)
ON CONFLICT (digest) DO NOTHING
RETURNING digest
"""

# Keyset pagination: open reviews are a queue (oldest first); decided ones are
# history (newest first). The position is the last (opened_at, digest) seen; a first
# page starts before (after) every review, opened_at being the service's clock, never
# infinite. Each statement is a range of the order of an index (approval migration
# 0004: ``reviews_by_status``, ``reviews_by_thread`` with the thread), the status and
# thread equalities its leading columns: whatever the statistics its plan was made
# with, a page reads the reviews it returns, where a status or thread written as an
# optional parameter led every plan to read every review and sort those of the status.
_BY_STATUS = "r.status = $1"
_BY_THREAD = "r.thread_id = $5 AND r.status = $1"
_AFTER = (
    "(r.opened_at, r.digest) > (coalesce($2::timestamptz, '-infinity'), coalesce($3::text, ''))"
)
_BEFORE = (
    "(r.opened_at, r.digest) < (coalesce($2::timestamptz, 'infinity'), coalesce($3::text, ''))"
)


def _page_of(where: str, position: str, order: str) -> str:
    return f"""
SELECT {REVIEW_COLUMNS} FROM {REVIEWS}
 WHERE {where} AND {position}
 ORDER BY {order}
 LIMIT $4
"""  # noqa: S608 - constant columns, tables and conditions


_OLDEST, _NEWEST = "r.opened_at, r.digest", "r.opened_at DESC, r.digest DESC"
# (oldest first, newest first), of any thread and of the thread $5
LIST_PAGE = {
    False: (_page_of(_BY_STATUS, _AFTER, _OLDEST), _page_of(_BY_STATUS, _BEFORE, _NEWEST)),
    True: (_page_of(_BY_THREAD, _AFTER, _OLDEST), _page_of(_BY_THREAD, _BEFORE, _NEWEST)),
}

# The overdue open reviews, in the deadline order of ``reviews_open_expiry`` (approval
# migration 0004); no index had expires_at, and every pass read every open review.
EXPIRE_OPEN = """
UPDATE ztate_approval.reviews SET status = 'expired', closed_at = $1
 WHERE status = 'open' AND expires_at < $1
RETURNING digest, thread_id, risk_rules
"""

# Closing the locked review. Its row is found by its primary key as a range of one
# value, LIMIT 1 (an order only the key's index gives), and updated by its physical
# address (a TID scan): written ``WHERE digest = $1 AND status = 'open'``, the generic
# plan made on tables never analysed read every open review through a partial index of
# the open ones, the digest filtered; so did a subquery giving the digest. The row is
# locked by this transaction (``ReviewStore.locked``), so the version found is the one
# updated; the digest is checked again all the same.
CLOSE_REVIEW = """
UPDATE ztate_approval.reviews SET status = $2, closed_at = $3
 WHERE ctid = (SELECT ctid FROM ztate_approval.reviews
                WHERE digest BETWEEN $1 AND $1 ORDER BY digest LIMIT 1)
   AND digest = $1 AND status = 'open'
"""

UNDELIVERED = """
SELECT digest, receipt, signature, key_id FROM ztate_approval.receipts
 WHERE delivered_at IS NULL
 ORDER BY signed_at, digest
 LIMIT $1
"""


@dataclass(frozen=True, slots=True)
class NewReview:
    """A review as the transition service submits it."""

    digest: str
    thread_id: str
    base_version: int
    node_id: str
    risk_rules: tuple[str, ...]
    required_approvals: int
    proposal: bytes
    redacted_diff: bytes
    opened_at: datetime
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class StoredReview:
    """A review as stored, with its approvers so far and its receipt once decided."""

    digest: str
    thread_id: str
    base_version: int
    node_id: str
    risk_rules: tuple[str, ...]
    required_approvals: int
    redacted_diff: bytes
    status: str
    opened_at: datetime
    expires_at: datetime
    closed_at: datetime | None
    approvers: tuple[str, ...]
    receipt: SignedReceipt | None
    delivered_at: datetime | None
    outcome: str | None  # what the transition service did with the decision

    @classmethod
    def from_row(cls, row: asyncpg.Record) -> StoredReview:
        receipt = None
        if row["receipt"] is not None:
            receipt = SignedReceipt(
                bytes(row["receipt"]), row["receipt_signature"], row["receipt_key_id"]
            )
        return cls(
            digest=row["digest"],
            thread_id=row["thread_id"],
            base_version=row["base_version"],
            node_id=row["node_id"],
            risk_rules=tuple(row["risk_rules"]),
            required_approvals=row["required_approvals"],
            redacted_diff=bytes(row["redacted_diff"]),
            status=row["status"],
            opened_at=row["opened_at"],
            expires_at=row["expires_at"],
            closed_at=row["closed_at"],
            approvers=tuple(row["approvers"]),
            receipt=receipt,
            delivered_at=row["delivered_at"],
            outcome=row["outcome"],
        )


@dataclass(frozen=True, slots=True)
class Approver:
    """A reviewer who approved, and the serial of the certificate they approved with
    (None: a decision recorded before the service kept it)."""

    spiffe_id: str
    cert_serial: int | None


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where a page of reviews ended: keyset pagination on (opened_at, digest)."""

    opened_at: datetime
    digest: str


@dataclass(frozen=True, slots=True)
class ExpiredReview:
    digest: str
    thread_id: str
    risk_rules: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    """A signed receipt the transition service has not taken yet."""

    digest: str
    receipt: SignedReceipt

    @classmethod
    def from_row(cls, row: asyncpg.Record) -> OutboxEntry:
        receipt = SignedReceipt(bytes(row["receipt"]), row["signature"], row["key_id"])
        return cls(row["digest"], receipt)


async def _read_review(conn: PoolConnectionProxy[Any], digest: str) -> StoredReview | None:
    row = await conn.fetchrow(
        f"SELECT {REVIEW_COLUMNS} FROM {REVIEWS} WHERE r.digest = $1",  # noqa: S608
        digest,
    )
    return StoredReview.from_row(row) if row else None


class LockedReview:
    """One review, its row locked until the surrounding transaction ends."""

    def __init__(self, conn: PoolConnectionProxy[Any], review: StoredReview) -> None:
        self._conn = conn
        self.review = review

    async def reread(self) -> StoredReview:
        """The review as this transaction leaves it (its decisions, status and receipt)."""
        review = await _read_review(self._conn, self.review.digest)
        assert review is not None  # reviews are never deleted
        return review

    async def record_decision(
        self, reviewer: str, decision: str, at: datetime, cert_serial: int | None
    ) -> bool:
        """Record a reviewer's decision, made with the certificate of serial
        ``cert_serial`` (None: not known); False if this reviewer already decided."""
        inserted = await self._conn.fetchval(
            "INSERT INTO ztate_approval.decisions (digest, reviewer, decision, decided_at, "
            "cert_serial) VALUES ($1, $2, $3, $4, $5) "
            "ON CONFLICT (digest, reviewer) DO NOTHING RETURNING 1",
            self.review.digest,
            reviewer,
            decision,
            at,
            None if cert_serial is None else serial_text(cert_serial),
        )
        return inserted is not None

    async def approvers(self) -> list[Approver]:
        """The reviewers who approved so far, and their certificates' serials (None:
        not recorded), in this transaction's view."""
        rows = await self._conn.fetch(
            "SELECT reviewer, cert_serial FROM ztate_approval.decisions "
            "WHERE digest = $1 AND decision = 'approve' ORDER BY reviewer",
            self.review.digest,
        )
        return [
            Approver(
                row["reviewer"],
                None if row["cert_serial"] is None else int(row["cert_serial"], 16),
            )
            for row in rows
        ]

    async def close(self, status: str, at: datetime) -> None:
        """Close the review as approved, rejected or expired. The review is open and
        locked by this transaction (``ReviewStore.locked``); a close that changed no row
        would let a receipt be signed for a review still open, so it ends the
        transaction instead (rolled back: nothing signed)."""
        closed = await self._conn.execute(CLOSE_REVIEW, self.review.digest, status, at)
        if closed != "UPDATE 1":
            raise RuntimeError(f"review {self.review.digest[:16]} was not closed ({closed})")

    async def store_receipt(self, receipt: SignedReceipt, nonce: str, at: datetime) -> None:
        """Keep the review's signed receipt; it waits in the outbox until delivered."""
        await self._conn.execute(
            "INSERT INTO ztate_approval.receipts (digest, receipt, signature, key_id, nonce, "
            "signed_at) VALUES ($1, $2, $3, $4, $5, $6)",
            self.review.digest,
            receipt.receipt_bytes,
            receipt.signature,
            receipt.key_id,
            nonce,
            at,
        )


class ReviewStore:
    """The approval service's tables, through its own least-privilege role."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @classmethod
    async def open(cls, dsn: str, *, role: str, pool_size: int) -> ReviewStore:
        pool = await asyncpg.create_pool(
            dsn,
            min_size=min(2, pool_size),
            max_size=pool_size,
            reset=keep_session,
            server_settings={"role": role, "application_name": "ztate-approval"},
        )
        return cls(pool)

    @property
    def pool(self) -> asyncpg.Pool:
        return self._pool

    async def close(self) -> None:
        await self._pool.close()

    async def ping(self) -> None:
        await self._pool.fetchval("SELECT 1")

    async def submit(self, review: NewReview) -> tuple[StoredReview, bool]:
        """Open a review, or return the one already open for this digest; the flag
        says whether this call opened it."""
        inserted = await self._pool.fetchval(
            INSERT_REVIEW,
            review.digest,
            review.thread_id,
            review.base_version,
            review.node_id,
            list(review.risk_rules),
            review.required_approvals,
            review.proposal,
            review.redacted_diff,
            review.opened_at,
            review.expires_at,
        )
        stored = await self.get(review.digest)
        assert stored is not None  # inserted now, or before: reviews are never deleted
        return stored, inserted is not None

    async def get(self, digest: str) -> StoredReview | None:
        row = await self._pool.fetchrow(
            f"SELECT {REVIEW_COLUMNS} FROM {REVIEWS} WHERE r.digest = $1",  # noqa: S608
            digest,
        )
        return StoredReview.from_row(row) if row else None

    async def page(
        self, status: str, *, thread_id: str | None, limit: int, after: Cursor | None
    ) -> list[StoredReview]:
        """One page of reviews with ``status``: open ones oldest first, others newest first."""
        oldest_first, newest_first = LIST_PAGE[thread_id is not None]
        query = oldest_first if status == OPEN else newest_first
        position = (after.opened_at, after.digest) if after else (None, None)
        thread = () if thread_id is None else (thread_id,)
        rows = await self._pool.fetch(query, status, *position, limit, *thread)
        return [StoredReview.from_row(row) for row in rows]

    @asynccontextmanager
    async def locked(self, digest: str) -> AsyncIterator[LockedReview | None]:
        """A transaction holding the review's row lock; ``None`` if there is no such review.

        Leaving the block normally commits; an exception rolls everything back."""
        async with self._pool.acquire() as conn, conn.transaction():
            # Lock first, then read in a second statement: in READ COMMITTED a
            # statement that waited for the lock still reads with the snapshot it
            # started with, and would miss decisions committed while it waited.
            await conn.execute(
                "SELECT 1 FROM ztate_approval.reviews WHERE digest = $1 FOR UPDATE", digest
            )
            review = await _read_review(conn, digest)
            yield LockedReview(conn, review) if review else None

    async def expire_open(self, now: datetime) -> list[ExpiredReview]:
        """Close every open review whose deadline passed; returns those closed now."""
        rows = await self._pool.fetch(EXPIRE_OPEN, now)
        return [ExpiredReview(r["digest"], r["thread_id"], tuple(r["risk_rules"])) for r in rows]

    async def undelivered(self, limit: int) -> list[OutboxEntry]:
        """Signed receipts the transition service has not taken, oldest first."""
        rows = await self._pool.fetch(UNDELIVERED, limit)
        return [OutboxEntry.from_row(row) for row in rows]

    async def mark_delivered(self, digest: str, at: datetime, outcome: str) -> None:
        """The decision reached the transition service, which answered ``outcome``."""
        await self._pool.execute(
            "UPDATE ztate_approval.receipts SET delivered_at = $2, outcome = $3 "
            "WHERE digest = $1 AND delivered_at IS NULL",
            digest,
            at,
            outcome,
        )
