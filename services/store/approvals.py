"""The transition service's side of approvals, in Postgres.

Applying an approval is one transaction: the parked row locked, then the
compare-and-swap on the head at the parked base version, the pending transition's
status and the ledger record (one statement, routed to the thread's shard on
Citus), the receipt (whose nonce is unique forever) and the announcement; they
commit together or not at all. Every change of a parked transition's status is
announced on the ``ztate_outcomes`` channel, on the connection that made it (on
Citus: the coordinator, where every replica LISTENs), so that waiting proposers, on
any replica, wake up.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from ztate.contract.receipts import SignedReceipt
from ztate.contract.record import SealedRecord
from ztate.services.store.boundary import translated
from ztate.services.store.rows import Head, PendingTransition, Rejection
from ztate.services.store.transitions import (
    PENDING_COLUMNS,
    record_at,
    storable_rejection,
)

NONCE_CONSTRAINT = "receipts_nonce_key"


class Approved(enum.Enum):
    """What ``ApprovalStore.commit_approved`` did: ``COMMITTED`` wrote the commit,
    ``HEAD_MOVED`` only closed the parked row as stale, the others wrote nothing."""

    COMMITTED = "committed"
    # the thread moved on since the proposal was parked: the parked row is closed as
    # stale (and announced) in the same call, nothing else written
    HEAD_MOVED = "head moved"
    KEY_TAKEN = "key taken"  # a committed request took its idempotency key meanwhile
    NONCE_USED = "nonce used"  # the receipt's nonce authorised something before
    NOT_PENDING = "not pending"  # decided, expired or made stale meanwhile


class Rejected(enum.Enum):
    """What ``ApprovalStore.close_rejected`` did; only ``CLOSED`` wrote anything."""

    CLOSED = "closed"
    NONCE_USED = "nonce used"  # the receipt (its nonce) authorised something before
    NOT_PENDING = "not pending"  # decided, expired or made stale meanwhile


@dataclass(frozen=True, slots=True)
class ApprovedCommit:
    """The outcome, and the parked row's status when it was ``NOT_PENDING``."""

    outcome: Approved
    status: str | None = None


OUTCOME_CHANNEL = "ztate_outcomes"

# Every statement on pending_transitions names its thread: on Citus each is routed to
# the one shard that holds it (FOR UPDATE runs only there). The receipt (a reference
# table), the rejection (on the coordinator) and the announcement are separate
# statements of the same transaction: Citus cannot write a reference table or a
# coordinator table from a statement routed to a worker, and a pg_notify evaluated on
# a worker would never reach the LISTEN connections on the coordinator. Postgres
# delivers the announcement at commit, so a woken waiter finds everything written. The
# statements of an approved commit are one call of ztate.commit_approved, which runs
# on the coordinator and sends each of them where it belongs.

# Applying an approval: one call (migrations 0016 and 0018: with the nodes the version
# wakes), one round trip; on Citus each of its
# statements on the thread's tables is a router query to the worker holding the thread.
COMMIT_APPROVED = """
SELECT outcome, status FROM ztate.commit_approved($1, $2, $3, $4, $5, $6, $7, $8, $9, $10,
                                                  $11, $12, $13, $14, $15, $16, $17, $18, $19,
                                                  $20)
"""

# What a decision needs before it commits, in one query by the receipt's thread (a
# router query on Citus): the parked row with its candidate state, the thread's head,
# and whether the receipt's nonce authorised something before. The parked row is found
# by its digest written as record_at writes a version (a join on "p.digest = $2" was
# planned, on tables never analysed, as the thread's parked rows read and filtered).
DECISION_LOOKUP = f"""
SELECT {", ".join(f"p.{c} AS p_{c}" for c in PENDING_COLUMNS.split(", "))},
       p.state AS p_state, h.version AS h_version, h.head_digest AS h_digest,
       h.state AS h_state, h.policy_name AS h_policy_name, h.policy_digest AS h_policy_digest,
       EXISTS (SELECT 1 FROM ztate.receipts r WHERE r.nonce = $3) AS nonce_used
  FROM (SELECT 1) AS one
  LEFT JOIN LATERAL (SELECT {PENDING_COLUMNS}, state FROM ztate.pending_transitions
                      WHERE thread_id = $1 AND digest BETWEEN $2 AND $2
                      ORDER BY digest LIMIT 1) p ON true
  LEFT JOIN ztate.threads h ON h.thread_id = $1
"""  # noqa: S608 - constant column list


@dataclass(frozen=True, slots=True)
class DecisionLookup:
    """``ApprovalStore.decision_lookup``: None where there is no such row."""

    pending: PendingTransition | None
    candidate_state: bytes | None
    head: Head | None
    nonce_used: bool


CLOSE_PENDING = """
UPDATE ztate.pending_transitions SET status = $3, decided_at = $4
 WHERE thread_id = $1 AND digest = $2 AND status = 'pending'
RETURNING digest
"""

# A decision that does not commit, in one call each (migration 0017); like an approved
# commit, they run on the coordinator and send each statement where it belongs.
CLOSE_REJECTED = "SELECT ztate.close_rejected($1, $2, $3, $4, $5, $6, $7, $8)"
CLOSE_REFUSED = "SELECT ztate.close_refused($1, $2, $3, $4, $5, $6, $7, $8, $9)"

# The record a parked proposal builds on, by the primary key whatever the statistics
# (record_at says why it is not written "version = $2").
BASE_OF = record_at("record, state")

NONCE_TAKEN = "SELECT EXISTS (SELECT 1 FROM ztate.receipts WHERE nonce = $1)"

ANNOUNCE = "SELECT pg_notify('ztate_outcomes', d) FROM unnest($1::text[]) AS d"


async def announce(conn: PoolConnectionProxy[asyncpg.Record], digests: list[str]) -> None:
    """Announce status changes of parked transitions on ``ztate_outcomes``; in a
    transaction, Postgres delivers them once it commits."""
    if digests:
        await conn.execute(ANNOUNCE, digests)


class PendingKey(Protocol):
    """What names a parked transition: its thread (the distribution column) and digest.
    A ``PendingTransition`` is one."""

    @property
    def thread_id(self) -> str: ...

    @property
    def digest(self) -> str: ...


@dataclass(frozen=True, slots=True)
class ParkedKey:
    """A ``PendingKey`` without the rest of the row."""

    thread_id: str
    digest: str


# Where the outbox's last full page of submissions ended: (parked_at, digest).
SubmitPosition = tuple[datetime, str]
# The parked transitions to submit, oldest first, in a total order (parked_at, digest) so
# that a page may start after the last one's position; one statement with the position
# and one without (an optional parameter in one statement no index serves).
TO_SUBMIT = (
    f"SELECT {PENDING_COLUMNS} FROM ztate.pending_transitions "  # noqa: S608
    "WHERE submitted_at IS NULL AND status = 'pending' "
    "AND NOT (digest = ANY($2::text[])) ORDER BY parked_at, digest LIMIT $1"
)
TO_SUBMIT_AFTER = (
    f"SELECT {PENDING_COLUMNS} FROM ztate.pending_transitions "  # noqa: S608
    "WHERE submitted_at IS NULL AND status = 'pending' "
    "AND NOT (digest = ANY($2::text[])) AND (parked_at, digest) > ($3, $4) "
    "ORDER BY parked_at, digest LIMIT $1"
)


class ApprovalStore:
    """Parked transitions, receipts and the outbox towards the approval service."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    @translated
    async def commit_approved(
        self,
        sealed: SealedRecord,
        state_bytes: bytes,
        pending: PendingTransition,
        receipt: SignedReceipt,
        nonce: str,
        committed_at: datetime,
        woken: Sequence[str] = (),
    ) -> ApprovedCommit:
        """Commit a parked transition under its receipt, in one transaction that
        first locks the parked row (see ``Approved`` for what each outcome wrote)."""
        record = sealed.record
        try:
            row = await self._pool.fetchrow(
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
                receipt.receipt_bytes,
                receipt.signature,
                receipt.key_id,
                receipt.digest,
                nonce,
                list(woken),
            )
        except asyncpg.UniqueViolationError as violation:
            # the whole call rolled back. Citus relays a worker's violation without the
            # constraint's name, so a nameless one is told apart by asking whether the
            # nonce is taken (committed: the violation waited for its writer). Taking
            # it for KEY_TAKEN closed a parked transition whose receipt merely lost a
            # race with another receipt of the same nonce as stale.
            if violation.constraint_name == NONCE_CONSTRAINT or await self._pool.fetchval(
                NONCE_TAKEN, nonce
            ):
                return ApprovedCommit(Approved.NONCE_USED)
            return ApprovedCommit(Approved.KEY_TAKEN)
        assert row is not None  # a function's one row
        if row["outcome"] == "not pending":
            return ApprovedCommit(Approved.NOT_PENDING, str(row["status"]))
        if row["outcome"] == "head moved":
            return ApprovedCommit(Approved.HEAD_MOVED)
        return ApprovedCommit(Approved.COMMITTED)

    @translated
    async def decision_lookup(self, thread_id: str, digest: str, nonce: str) -> DecisionLookup:
        """The parked transition ``digest`` of ``thread_id`` with its candidate state, the
        thread's head, and whether ``nonce`` was used: one round trip."""
        row = await self._pool.fetchrow(DECISION_LOOKUP, thread_id, digest, nonce)
        assert row is not None  # (SELECT 1) LEFT JOIN ...: always one row
        pending = None
        if row["p_digest"] is not None:
            pending = PendingTransition(**{c: row[f"p_{c}"] for c in PENDING_COLUMNS.split(", ")})
        head = None
        if row["h_version"] is not None:
            head = Head(
                thread_id=thread_id,
                version=row["h_version"],
                digest=row["h_digest"],
                state_bytes=row["h_state"],
                policy_name=row["h_policy_name"],
                policy_digest=row["h_policy_digest"],
            )
        return DecisionLookup(pending, row["p_state"], head, row["nonce_used"])

    @translated
    async def close_rejected(
        self, pending: PendingTransition, receipt: SignedReceipt, nonce: str, at: datetime
    ) -> Rejected:
        """Record a rejection in one call (migration 0017). A receipt used before (its
        nonce, or the receipt itself, by a decision that won a race with this one's
        look-up) rolls the whole call back."""
        try:
            closed = await self._pool.fetchval(
                CLOSE_REJECTED,
                pending.thread_id,
                pending.digest,
                at,
                receipt.digest,
                nonce,
                receipt.receipt_bytes,
                receipt.signature,
                receipt.key_id,
            )
        except asyncpg.UniqueViolationError:
            return Rejected.NONCE_USED
        return Rejected.CLOSED if closed else Rejected.NOT_PENDING

    @translated
    async def close_refused(
        self, pending: PendingTransition, rejection: Rejection, at: datetime
    ) -> bool:
        """Close an approved transition the policy no longer allows, recording why, in
        one call (migration 0017: a woken waiter always finds the reason); False if it
        was no longer pending (nothing written)."""
        safe = storable_rejection(rejection)
        closed: bool = await self._pool.fetchval(
            CLOSE_REFUSED,
            pending.thread_id,
            pending.digest,
            at,
            safe.method,
            safe.node_id,
            safe.base_version,
            safe.reason,
            list(safe.keys),
            safe.message,
        )
        return closed

    @translated
    async def close_without_decision(
        self, parked: list[PendingKey], status: str, at: datetime
    ) -> list[str]:
        """Mark pending transitions stale or expired; returns the digests of those that
        changed."""
        closed: list[str] = []
        async with self._pool.acquire() as conn, conn.transaction():
            for key in parked:
                digest = await conn.fetchval(CLOSE_PENDING, key.thread_id, key.digest, status, at)
                if digest is not None:
                    closed.append(digest)
            await announce(conn, closed)
        return closed

    @translated
    async def overdue(self, older_than: timedelta, now: datetime) -> list[PendingKey]:
        rows = await self._pool.fetch(
            "SELECT thread_id, digest FROM ztate.pending_transitions "
            "WHERE status = 'pending' AND parked_at < $1 ORDER BY parked_at LIMIT 500",
            now - older_than,
        )
        return [ParkedKey(row["thread_id"], row["digest"]) for row in rows]

    @translated
    async def to_submit(
        self, limit: int, set_aside: list[str], after: SubmitPosition | None = None
    ) -> list[PendingTransition]:
        """The oldest parked transitions not yet submitted, in (parked_at, digest) order,
        from the start or ``after`` a position, but for the digests ``set_aside`` (those
        the approval service refused)."""
        if after is None:
            rows = await self._pool.fetch(TO_SUBMIT, limit, set_aside)
        else:
            rows = await self._pool.fetch(TO_SUBMIT_AFTER, limit, set_aside, *after)
        return [PendingTransition.from_row(row) for row in rows]

    @translated
    async def mark_submitted(self, pending: PendingKey, at: datetime) -> None:
        await self._pool.execute(
            "UPDATE ztate.pending_transitions SET submitted_at = $3 "
            "WHERE thread_id = $1 AND digest = $2 AND submitted_at IS NULL",
            pending.thread_id,
            pending.digest,
            at,
        )

    @translated
    async def base_of(self, pending: PendingTransition) -> tuple[bytes, bytes | None]:
        """The ledger record and state body (None once pruned) a parked proposal builds
        on: the approval service derives the review from them (docs/approvals.md)."""
        row = await self._pool.fetchrow(BASE_OF, pending.thread_id, pending.base_version)
        if row is None:
            raise LookupError(f"no record at {pending.thread_id}@{pending.base_version}")
        return bytes(row["record"]), None if row["state"] is None else bytes(row["state"])
